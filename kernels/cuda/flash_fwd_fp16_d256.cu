// One instantiation of the CUDA attention forward (flash_fwd.cuh): fp16, head_dim padded to 256,
// head_dim_v padded to 256. One per file keeps each nvcc run small and the build parallel.
#include "kernels/cuda/flash_fwd.cuh"

namespace dattn::cuda::detail {
template void launch_flash_fwd<__half, 256, 256>(const FlashParams&, cudaStream_t);
}  // namespace dattn::cuda::detail
