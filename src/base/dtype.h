// Storage dtypes (fp32, bf16, fp16) and their host conversions to and from fp32.
// Accumulation is always fp32; bf16/fp16 exist only as storage and on the wire.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace dattn {

enum class DType : uint8_t { f32 = 0, bf16 = 1, f16 = 2 };

inline size_t dtype_size(DType t) {
  return t == DType::f32 ? 4 : 2;
}
const char* dtype_name(DType t);
// Parses "fp32"/"f32"/"float32", "bf16"/"bfloat16", "fp16"/"f16"/"float16"; throws dattn::Error.
DType parse_dtype(const std::string& name);

// 16-bit storage types: just the bits. Conversions round to nearest even.
struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};

inline float to_float(float x) {
  return x;
}
inline float to_float(bf16 x) {
  uint32_t u = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline bf16 to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t((u >> 16) | 0x40)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return bf16{uint16_t(u >> 16)};
}
float to_float(f16 x);
f16 to_f16(float f);

// Converts n elements between a storage dtype and fp32.
void convert_to_f32(const void* src, DType src_type, float* dst, size_t n);
void convert_from_f32(const float* src, void* dst, DType dst_type, size_t n);

}  // namespace dattn
