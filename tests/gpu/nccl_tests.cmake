# The NCCL communicator's multi-rank tests (tests/gpu/test_nccl.cpp), built when the root found
# NCCL. nccl_np1/nccl_np2 need one GPU per rank and exit 77 (Skipped, with the reason) otherwise;
# nccl_nogpu_np2 hides every GPU and checks that creation fails cleanly on every rank, so it runs
# (and must pass) on every machine.
if(DATTN_WITH_NCCL)
  dattn_add_gpu_mpi_test(nccl test_nccl ${CMAKE_CURRENT_SOURCE_DIR}/test_nccl.cpp)

  # CUDA_VISIBLE_DEVICES=-1: no device is visible, on a GPU machine too. A short watchdog
  # deadline (30 s in the test) keeps a regression that hangs well inside the ctest timeout.
  add_test(NAME nccl_nogpu_np2
           COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} 2 ${MPIEXEC_PREFLAGS}
                   $<TARGET_FILE:test_nccl> --gtest_filter=NcclNoGpu.* ${MPIEXEC_POSTFLAGS})
  set_tests_properties(nccl_nogpu_np2 PROPERTIES
    TIMEOUT 120
    PROCESSORS 2
    LABELS gpu
    ENVIRONMENT "${DATTN_TEST_MPI_ENV};CUDA_VISIBLE_DEVICES=-1;DATTN_NCCL_TEST_NO_GPU=1")
endif()
