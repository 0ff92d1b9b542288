# The strategies on GPU tensors (tests/gpu/test_gpu_ring.cpp): ring attention through
# dattn::attention on a GPU Runtime (NCCL cp group, CUDA kernels) against the CPU backend and the
# float64 reference, with exact byte counts. Built when the root found NCCL (the GPU Runtime needs
# it). gpu_ring_np1/np2 need one GPU per rank and exit 77 (Skipped, with the reason) otherwise.
if(DATTN_WITH_NCCL)
  add_executable(test_gpu_ring ${CMAKE_CURRENT_SOURCE_DIR}/test_gpu_ring.cpp)
  target_link_libraries(test_gpu_ring PRIVATE dattn_mpi_main dattn_test_support CUDA::cudart)
  target_compile_options(test_gpu_ring PRIVATE ${DATTN_WARNINGS})

  foreach(np 1 2)
    add_test(NAME gpu_ring_np${np}
             COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${np} ${MPIEXEC_PREFLAGS}
                     $<TARGET_FILE:test_gpu_ring> ${MPIEXEC_POSTFLAGS})
    set_tests_properties(gpu_ring_np${np} PROPERTIES
      TIMEOUT 180
      PROCESSORS ${np}
      SKIP_RETURN_CODE 77
      LABELS gpu
      ENVIRONMENT "${DATTN_TEST_MPI_ENV}")
  endforeach()
endif()
