# kernels/movement on the GPU (movement::cuda against movement::host on the same inputs).
# Included by tests/gpu/CMakeLists.txt; Skipped (exit 77) where CUDA sees no device.
dattn_add_gpu_test(test_cuda_movement test_cuda_movement.cpp)
