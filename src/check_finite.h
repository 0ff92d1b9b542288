// The optional check of the API's input tensors for NaN and inf (RuntimeOptions.check_finite or
// DATTN_CHECK_FINITE=1): the first non-finite value of a bshd tensor, named by batch, the token's
// global position, head and dim. The entry points run it inside their agreed validation.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "kernels/cpu/finite.h"
#include "src/base/error.h"
#include "src/base/tensor.h"

namespace dattn {

// Scans rows [row0, row0 + rows) of every batch entry of the bshd tensor t [B, S, H, D] (or
// [B, S, C]) and
// throws dattn::Error naming `name`, the first non-finite value and where it is: batch, the
// global position position(row) of its row, the local row, head and dim. Batch by batch, rows
// in order: the first in memory order. A device tensor is copied to the host to be scanned: the
// check is a debugging mode, off by default, and the host scan names positions as on the CPU.
inline void check_finite_rows(const Tensor& tensor, const std::string& name, int64_t row0,
                              int64_t rows, const std::function<int64_t(int64_t)>& position) {
  const int64_t S = tensor.size(1), H = tensor.size(2), D = tensor.size(3);
  if (rows <= 0 || H * D == 0) return;
  const Tensor t = tensor.device().is_cpu() ? tensor : tensor.to_device(Device::cpu());
  for (int64_t b = 0; b < t.size(0); ++b) {
    const int64_t first = (b * S + row0) * H * D;
    const int64_t i = cpu::find_non_finite(
        static_cast<const char*>(t.data()) + size_t(first) * dtype_size(t.dtype()), t.dtype(),
        rows * H * D);
    if (i < 0) continue;
    const int64_t row = row0 + i / (H * D), h = (i / D) % H, d = i % D;
    // [B, S, H, D] names head and dim; a [B, S, C] tensor (MLA's latent cache) its column.
    const std::string where =
        t.dim() == 3 ? detail::cat("column ", h) : detail::cat("head ", h, ", dim ", d);
    DATTN_THROW("invalid ", name, " = ", t.get(first + i), " at batch ", b, ", position ",
                position(row), " (local row ", row, "), ", where,
                ": expected finite values (the non-finite check is on: "
                "RuntimeOptions.check_finite or DATTN_CHECK_FINITE=1)");
  }
}

// The whole tensor.
inline void check_finite_tensor(const Tensor& t, const std::string& name,
                                const std::function<int64_t(int64_t)>& position) {
  check_finite_rows(t, name, 0, t.size(1), position);
}

}  // namespace dattn
