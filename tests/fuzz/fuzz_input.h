// Reads a libFuzzer input as a stream of typed values. Exhausted input reads as zeros, so every
// input decodes to something. Sizes come in classes (small, medium, near the int64 limits,
// negative), so that a few bytes reach the edges where arithmetic overflows.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

namespace dattn::fuzz {

class Input {
 public:
  Input(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  bool empty() const { return pos_ >= size_; }
  uint8_t byte() { return pos_ < size_ ? data_[pos_++] : 0; }
  template <typename T>
  T raw() {
    T v{};
    const size_t n = std::min(sizeof(T), size_ - std::min(pos_, size_));
    std::memcpy(&v, data_ + pos_, n);
    pos_ += n;
    return v;
  }

  // A length or position: small (0..63), medium (0..65535), a raw int64, near INT64_MAX,
  // negative, or near INT32_MAX.
  int64_t size() {
    constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
    const uint8_t c = byte();
    switch (c % 8) {
      case 0:
      case 1:
      case 2:
        return c / 8;
      case 3:
        return raw<uint16_t>();
      case 4:
        return raw<int64_t>();
      case 5:
        return kMax - raw<uint8_t>();
      case 6:
        return -int64_t(raw<uint8_t>());
      default:
        return int64_t(std::numeric_limits<int32_t>::max()) - raw<uint8_t>() + raw<uint8_t>();
    }
  }
  // A value in [lo, hi].
  int64_t range(int64_t lo, int64_t hi) {
    const uint64_t span = uint64_t(hi) - uint64_t(lo) + 1;
    const uint64_t v = raw<uint32_t>();
    return span == 0 ? int64_t(v) : lo + int64_t(v % span);
  }
  // Up to max_len bytes as a string (its length first).
  std::string text(size_t max_len) {
    const size_t n = std::min<size_t>(byte() % (max_len + 1), size_ - std::min(pos_, size_));
    std::string s(reinterpret_cast<const char*>(data_ + pos_), n);
    pos_ += n;
    return s;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

}  // namespace dattn::fuzz
