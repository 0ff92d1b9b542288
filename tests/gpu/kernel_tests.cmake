# The CUDA kernels' tests (kernels/cuda): the attention forward and backward, the split-KV decode
# and the MLA decode step against float64 references. Included by tests/gpu/CMakeLists.txt.
dattn_add_gpu_test(test_cuda_attention test_cuda_attention.cpp test_cuda_decode.cpp
                   test_cuda_backward.cpp)
