# The strategies on GPU tensors (tests/gpu/test_gpu_ring.cpp): ring attention through
# dattn::attention on a GPU Runtime (NCCL cp group, CUDA kernels) against the CPU backend and the
# float64 reference, with exact byte counts. Built when the root found NCCL (the GPU Runtime needs
# it). gpu_ring_np1/np2 need one GPU per rank and exit 77 (Skipped, with the reason) otherwise.
if(DATTN_WITH_NCCL)
  dattn_add_gpu_mpi_test(gpu_ring test_gpu_ring ${CMAKE_CURRENT_SOURCE_DIR}/test_gpu_ring.cpp)
  # The tree decode on a GPU Runtime over a device KV cache (tests/gpu/test_gpu_decode.cpp):
  # against the CPU backend, the float64 reference and decode_send_bytes; ring/allgather rejected.
  dattn_add_gpu_mpi_test(gpu_decode test_gpu_decode ${CMAKE_CURRENT_SOURCE_DIR}/test_gpu_decode.cpp)
endif()
