// dtype names and the fp16 <-> fp32 conversions (bit-exact, round to nearest even).
#include "src/base/dtype.h"

#include <cpuid.h>
#include <immintrin.h>

#include "src/base/error.h"

namespace dattn {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32:
      return "fp32";
    case DType::bf16:
      return "bf16";
    case DType::f16:
      return "fp16";
  }
  return "?";
}

DType parse_dtype(const std::string& name) {
  if (name == "fp32" || name == "f32" || name == "float32" || name == "float") return DType::f32;
  if (name == "bf16" || name == "bfloat16") return DType::bf16;
  if (name == "fp16" || name == "f16" || name == "float16" || name == "half") return DType::f16;
  DATTN_THROW("invalid dtype = '", name, "': expected fp32, bf16 or fp16");
}

float to_float(f16 x) {
  uint32_t sign = uint32_t(x.bits & 0x8000u) << 16;
  uint32_t exp = (x.bits >> 10) & 0x1fu;
  uint32_t man = x.bits & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);  // inf / NaN
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);  // normal: rebias 15 -> 127
  } else if (man == 0) {
    u = sign;  // signed zero
  } else {     // subnormal: normalise
    int e = -1;
    do {
      ++e;
      man <<= 1;
    } while ((man & 0x400u) == 0);
    u = sign | (uint32_t(112 - e) << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

f16 to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return f16{uint16_t(sign | 0x7e00u)};   // NaN
  if (a >= 0x477ff000u) return f16{uint16_t(sign | 0x7c00u)};  // overflow (rounds to inf)
  if (a < 0x38800000u) {                                       // subnormal or zero in fp16
    if (a < 0x33000000u) return f16{sign};                     // below half the smallest
    uint32_t man = (a & 0x7fffffu) | 0x800000u;
    int shift = 126 - int(a >> 23);  // 14 .. 24
    uint32_t half = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return f16{uint16_t(sign | half)};
  }
  uint32_t h = ((a >> 13) - (112u << 10));  // rebias exponent, keep 10 mantissa bits
  uint32_t rem = a & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return f16{uint16_t(sign | h)};
}

#if defined(__x86_64__)
namespace {
// fp16 -> fp32 with the F16C instruction, 8 values at a time (the bit-exact scalar conversion
// above is several times slower and dominated fp16 decode). Returns how many it converted.
__attribute__((target("f16c,avx"))) size_t f16_to_f32_f16c(const f16* src, float* dst, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  return i;
}
// F16C from CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports does not know "f16c".
bool cpu_has_f16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0;
}
const bool kHaveF16c = cpu_has_f16c() && __builtin_cpu_supports("avx");
}  // namespace
#endif

void convert_to_f32(const void* src, DType src_type, float* dst, size_t n) {
  switch (src_type) {
    case DType::f32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::bf16: {
      auto* s = static_cast<const bf16*>(src);
      for (size_t i = 0; i < n; ++i)
        dst[i] = to_float(s[i]);
      return;
    }
    case DType::f16: {
      auto* s = static_cast<const f16*>(src);
      size_t i = 0;
#if defined(__x86_64__)
      if (kHaveF16c) i = f16_to_f32_f16c(s, dst, n);  // 8 at a time; the tail below
#endif
      for (; i < n; ++i)
        dst[i] = to_float(s[i]);
      return;
    }
  }
}

void convert_from_f32(const float* src, void* dst, DType dst_type, size_t n) {
  switch (dst_type) {
    case DType::f32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::bf16: {
      auto* d = static_cast<bf16*>(dst);
      for (size_t i = 0; i < n; ++i)
        d[i] = to_bf16(src[i]);
      return;
    }
    case DType::f16: {
      auto* d = static_cast<f16*>(dst);
      for (size_t i = 0; i < n; ++i)
        d[i] = to_f16(src[i]);
      return;
    }
  }
}

}  // namespace dattn
