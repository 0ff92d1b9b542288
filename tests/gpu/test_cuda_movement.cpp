// kernels/movement on the GPU: every movement::cuda operation on device memory against
// movement::host (the same Thrust source, OMP backend) on the same inputs. Copies must match bit
// for bit; the merge and the decode weighing within a few ulp (nvcc contracts a * b + c into an
// FMA and the device expf/logf differ from glibc's by an ulp or two), with -inf and NaN exactly
// where the host has them.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/movement/movement.h"
#include "src/base/cuda_check.h"
#include "tests/test_reference.h"

namespace dattn {
namespace {

using test::random_bytes;

// ---------------------------------------------------------------- helpers

// A device copy of a host vector, copied back by host().
template <class T>
class DeviceVector {
 public:
  explicit DeviceVector(const std::vector<T>& h) : n_(h.size()) {
    DATTN_CUDA_CHECK(cudaMalloc(&p_, std::max<size_t>(n_, 1) * sizeof(T)));
    if (n_) DATTN_CUDA_CHECK(cudaMemcpy(p_, h.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  ~DeviceVector() { cudaFree(p_); }
  DeviceVector(const DeviceVector&) = delete;
  DeviceVector& operator=(const DeviceVector&) = delete;
  T* get() const { return static_cast<T*>(p_); }
  std::vector<T> host() const {
    DATTN_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<T> h(n_);
    if (n_) DATTN_CUDA_CHECK(cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }

 private:
  void* p_ = nullptr;
  size_t n_;
};

// Equal within `ulps` float steps, with -inf, +inf and NaN only where the other side has them.
void expect_close(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(want[i]) || std::isinf(want[i])) {
      if (std::isnan(want[i]))
        EXPECT_TRUE(std::isnan(got[i])) << what << "[" << i << "]";
      else
        EXPECT_EQ(got[i], want[i]) << what << "[" << i << "]";
      continue;
    }
    const float tol = 4e-6f * std::max(1.f, std::fabs(want[i]));
    EXPECT_NEAR(got[i], want[i], tol) << what << "[" << i << "]";
  }
}

// ---------------------------------------------------------------- row copies

TEST(CudaMovement, GatherScatterPackUnpackMatchHost) {
  cudaStream_t stream;
  DATTN_CUDA_CHECK(cudaStreamCreate(&stream));
  for (size_t rb : {size_t(1), size_t(3), size_t(6), size_t(12), size_t(16), size_t(100),
                    size_t(2048), size_t(2050)}) {
    for (int64_t n : {0, 1, 33, 1000}) {
      const int64_t src_rows = 2 * n + 1;
      const auto src = random_bytes(size_t(src_rows) * rb + 1, uint32_t(rb + size_t(n)));
      std::vector<int64_t> idx(static_cast<size_t>(src_rows));
      std::iota(idx.begin(), idx.end(), 0);
      std::shuffle(idx.begin(), idx.end(), std::mt19937(uint32_t(n)));
      idx.resize(size_t(n));
      DeviceVector<unsigned char> d_src(src);
      DeviceVector<int64_t> d_idx(idx);
      for (size_t shift : {size_t(0), size_t(1)}) {  // aligned and misaligned rows
        std::vector<unsigned char> want(size_t(n) * rb + 1, 0xAB);
        DeviceVector<unsigned char> d_got(want);
        movement::host::gather_rows(want.data() + shift, src.data() + shift, idx.data(), n, rb);
        movement::cuda::gather_rows(d_got.get() + shift, d_src.get() + shift, d_idx.get(), n, rb,
                                    stream);
        EXPECT_EQ(d_got.host(), want) << "gather rb=" << rb << " n=" << n << " shift=" << shift;

        std::vector<unsigned char> swant(size_t(src_rows) * rb + 1, 0xCD);
        DeviceVector<unsigned char> d_sgot(swant);
        movement::host::scatter_rows(swant.data() + shift, src.data(), idx.data(), n, rb);
        movement::cuda::scatter_rows(d_sgot.get() + shift, d_src.get(), d_idx.get(), n, rb, stream);
        EXPECT_EQ(d_sgot.host(), swant) << "scatter rb=" << rb << " n=" << n;
      }
      // The first n rows of src as an [outer = 3, inner] strided block with a gap between rows.
      const int64_t inner = n / 3;
      const size_t inner_stride = rb + 4, outer_stride = size_t(inner) * inner_stride + 8;
      if (size_t(3) * outer_stride <= src.size()) {
        std::vector<unsigned char> pwant(size_t(3 * inner) * rb, 0x11);
        DeviceVector<unsigned char> d_pgot(pwant);
        movement::host::pack_rows(pwant.data(), src.data(), 3, inner, outer_stride, inner_stride,
                                  rb);
        movement::cuda::pack_rows(d_pgot.get(), d_src.get(), 3, inner, outer_stride, inner_stride,
                                  rb, stream);
        EXPECT_EQ(d_pgot.host(), pwant) << "pack rb=" << rb << " n=" << n;

        std::vector<unsigned char> uwant = src;
        DeviceVector<unsigned char> d_ugot(uwant);
        movement::host::unpack_rows(uwant.data(), pwant.data(), 3, inner, outer_stride,
                                    inner_stride, rb);
        DeviceVector<unsigned char> d_buf(pwant);
        movement::cuda::unpack_rows(d_ugot.get(), d_buf.get(), 3, inner, outer_stride, inner_stride,
                                    rb, stream);
        EXPECT_EQ(d_ugot.host(), uwant) << "unpack rb=" << rb << " n=" << n;
      }
    }
  }
  DATTN_CUDA_CHECK(cudaStreamDestroy(stream));
}

// ---------------------------------------------------------------- partials

TEST(CudaMovement, MergeClearWeighSinksMatchHost) {
  const int64_t B = 2, S = 67, H = 5, Dv = 72;
  const size_t n_out = size_t(B * S * H * Dv), n_lse = size_t(B * H * S);
  std::mt19937 gen(5);
  std::uniform_real_distribution<float> val(-3.f, 3.f), lse(-80.f, 80.f);
  std::vector<float> out_a(n_out), out_b(n_out), lse_a(n_lse), lse_b(n_lse);
  for (auto* v : {&out_a, &out_b})
    for (float& x : *v)
      x = val(gen);
  for (auto* v : {&lse_a, &lse_b})
    for (float& x : *v)
      x = lse(gen);
  for (size_t l = 0; l < n_lse; ++l) {  // empty sides, with NaN in their out (row = l here is
    switch (gen() % 5) {                // not the bshd row, which does not matter for the test)
      case 0:
        lse_a[l] = -INFINITY;
        break;
      case 1:
        lse_b[l] = -INFINITY;
        out_b[l * size_t(Dv)] = NAN;
        break;
      case 2:
        lse_a[l] = lse_b[l] = -INFINITY;
        break;
      default:
        break;
    }
  }

  // merge_partials
  std::vector<float> ho = out_a, hl = lse_a;
  movement::host::merge_partials(ho.data(), hl.data(), out_b.data(), lse_b.data(), B, S, H, Dv);
  DeviceVector<float> d_oa(out_a), d_la(lse_a), d_ob(out_b), d_lb(lse_b);
  movement::cuda::merge_partials(d_oa.get(), d_la.get(), d_ob.get(), d_lb.get(), B, S, H, Dv,
                                 nullptr);
  expect_close(d_oa.host(), ho, "merge out");
  expect_close(d_la.host(), hl, "merge lse");

  // weigh_partial and unweigh_partial, m = max of the two sides
  std::vector<float> m(n_lse);
  for (size_t l = 0; l < n_lse; ++l)
    m[l] = std::fmax(lse_a[l], lse_b[l]);
  const size_t n_packed = size_t(B * S * H * (Dv + 1));
  std::vector<float> hp(n_packed);
  movement::host::weigh_partial(hp.data(), out_a.data(), lse_a.data(), m.data(), B, S, H, Dv);
  DeviceVector<float> d_m(m), d_oa2(out_a), d_la2(lse_a), d_p{std::vector<float>(n_packed)};
  movement::cuda::weigh_partial(d_p.get(), d_oa2.get(), d_la2.get(), d_m.get(), B, S, H, Dv,
                                nullptr);
  expect_close(d_p.host(), hp, "weigh");
  std::vector<float> uo(n_out), ul(n_lse);
  movement::host::unweigh_partial(uo.data(), ul.data(), hp.data(), m.data(), B, S, H, Dv);
  DeviceVector<float> d_hp(hp), d_uo(uo), d_ul(ul);
  movement::cuda::unweigh_partial(d_uo.get(), d_ul.get(), d_hp.get(), d_m.get(), B, S, H, Dv,
                                  nullptr);
  expect_close(d_uo.host(), uo, "unweigh out");
  expect_close(d_ul.host(), ul, "unweigh lse");

  // add_sinks, sinks from far below to far above lse
  const std::vector<float> sinks = {-200.f, -3.f, 0.5f, 40.f, 150.f};
  std::vector<float> so = out_a, sl = lse_a;
  movement::host::add_sinks(so.data(), sl.data(), sinks.data(), B, S, H, Dv);
  DeviceVector<float> d_so(out_a), d_sl(lse_a), d_s(sinks);
  movement::cuda::add_sinks(d_so.get(), d_sl.get(), d_s.get(), B, S, H, Dv, nullptr);
  expect_close(d_so.host(), so, "add_sinks out");
  expect_close(d_sl.host(), sl, "add_sinks lse");

  // add_floats, out of place and in place (out = a): exactly the host's sums
  std::vector<float> sum(n_out);
  movement::host::add_floats(sum.data(), out_a.data(), out_b.data(), int64_t(n_out));
  DeviceVector<float> d_sa(out_a), d_sb(out_b), d_sum{std::vector<float>(n_out)};
  movement::cuda::add_floats(d_sum.get(), d_sa.get(), d_sb.get(), int64_t(n_out), nullptr);
  movement::cuda::add_floats(d_sa.get(), d_sa.get(), d_sb.get(), int64_t(n_out), nullptr);
  for (size_t i = 0; i < n_out; ++i)
    ASSERT_EQ(sum[i], out_a[i] + out_b[i]) << "add_floats host, element " << i;
  EXPECT_EQ(d_sum.host(), sum) << "add_floats";
  EXPECT_EQ(d_sa.host(), sum) << "add_floats in place";

  // widen_16, every 16-bit pattern: the host's values, bit for bit
  std::vector<uint16_t> bits(65536);
  for (size_t i = 0; i < bits.size(); ++i)
    bits[i] = uint16_t(i);
  DeviceVector<uint16_t> d_bits(bits);
  for (bool bf16 : {true, false}) {
    std::vector<float> wide(bits.size());
    movement::host::widen_16(wide.data(), bits.data(), int64_t(bits.size()), bf16);
    DeviceVector<float> d_wide{std::vector<float>(bits.size())};
    movement::cuda::widen_16(d_wide.get(), d_bits.get(), int64_t(bits.size()), bf16, nullptr);
    const std::vector<float> got = d_wide.host();
    EXPECT_EQ(std::memcmp(got.data(), wide.data(), wide.size() * 4), 0)
        << "widen_16 " << (bf16 ? "bf16" : "fp16");
  }

  // clear_partial
  movement::cuda::clear_partial(d_oa.get(), int64_t(n_out), d_la.get(), int64_t(n_lse), nullptr);
  for (float x : d_oa.host())
    ASSERT_EQ(x, 0.f);
  for (float x : d_la.host())
    ASSERT_EQ(x, -INFINITY);
}

}  // namespace
}  // namespace dattn
