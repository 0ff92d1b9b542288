// One instantiation of the CUDA attention forward (flash_fwd.cuh): bf16, head_dim padded to 128,
// head_dim_v padded to 128. One per file keeps each nvcc run small and the build parallel.
#include "kernels/cuda/flash_fwd.cuh"

namespace dattn::cuda::detail {
template void launch_flash_fwd<__nv_bfloat16, 128, 128>(const FlashParams&, cudaStream_t);
}  // namespace dattn::cuda::detail
