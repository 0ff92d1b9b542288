# The strategies on GPU tensors (tests/gpu/test_gpu_attention.cpp): ring, Ulysses and hybrid
# attention through dattn::attention on a GPU Runtime (NCCL cp group and its splits, CUDA kernels)
# against the CPU backend and the float64 reference, with exact byte counts. Built when the root
# found NCCL (the GPU Runtime needs it). gpu_attention_np1/np2 need one GPU per rank and exit 77
# (Skipped, with the reason) otherwise.
if(DATTN_WITH_NCCL)
  dattn_add_gpu_mpi_test(gpu_attention test_gpu_attention
                         ${CMAKE_CURRENT_SOURCE_DIR}/test_gpu_attention.cpp)
  # Tree, ring and allgather decoding on a GPU Runtime over a device KV cache
  # (tests/gpu/test_gpu_decode.cpp): against the CPU backend, the float64 reference and
  # decode_send_bytes.
  dattn_add_gpu_mpi_test(gpu_decode test_gpu_decode ${CMAKE_CURRENT_SOURCE_DIR}/test_gpu_decode.cpp)
  # Star attention's two phases on a GPU Runtime (tests/gpu/test_gpu_star.cpp): against the CPU
  # backend and the star byte models.
  dattn_add_gpu_mpi_test(gpu_star test_gpu_star ${CMAKE_CURRENT_SOURCE_DIR}/test_gpu_star.cpp)
  # The distributed MLA decode (head split, TPLA) on a GPU Runtime (tests/gpu/test_gpu_mla.cpp):
  # against the CPU backend and mla_decode_send_bytes.
  dattn_add_gpu_mpi_test(gpu_mla test_gpu_mla ${CMAKE_CURRENT_SOURCE_DIR}/test_gpu_mla.cpp)
endif()
