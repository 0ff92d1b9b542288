// Multi-rank tests (1-2 ranks, one GPU each) of the NCCL Communicator, mirroring the MPI backend's
// (tests/test_collectives.cpp) on device buffers: every operation's results and its exact byte
// counters, sub-groups, and, with no GPU (DATTN_NCCL_TEST_NO_GPU=1), a clean Error on every rank.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "collective/nccl_communicator.h"
#include "src/base/cuda_check.h"
#include "src/base/error.h"
#include "tests/gpu/one_gpu_per_rank.h"

namespace dattn {
namespace {

// The no-GPU mode (ctest nccl_nogpu_np2: CUDA_VISIBLE_DEVICES=-1 hides every device): only
// NcclNoGpu runs, and the GPU check below does not skip the run.
bool no_gpu_mode() {
  const char* v = std::getenv("DATTN_NCCL_TEST_NO_GPU");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

// One GPU per rank, or every rank skips together (tests/gpu/one_gpu_per_rank.h); not checked in
// the no-GPU mode.
testing::Environment* const one_gpu_per_rank =
    testing::AddGlobalTestEnvironment(new test::OneGpuPerRank(no_gpu_mode));

// ---------------------------------------------------------------- device buffers

template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) {
    DATTN_CUDA_CHECK(cudaMalloc(&p_, std::max<size_t>(n, 1) * sizeof(T)));
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { put(host); }
  ~DeviceBuffer() { cudaFree(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return static_cast<T*>(p_); }
  size_t bytes() const { return n_ * sizeof(T); }
  void put(const std::vector<T>& host) {
    ASSERT_EQ(host.size(), n_);
    DATTN_CUDA_CHECK(cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> host() const {
    std::vector<T> out(n_);
    DATTN_CUDA_CHECK(cudaMemcpy(out.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return out;
  }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

template <typename T>
std::vector<T> filled(size_t n, T v) {
  return std::vector<T>(n, v);
}

// ---------------------------------------------------------------- the collectives

class NcclCollectives : public testing::Test {
 protected:
  void SetUp() override {
    if (no_gpu_mode()) GTEST_SKIP() << "no-GPU mode: only NcclNoGpu runs";
    comm = NcclCommunicator::from_mpi(MPI_COMM_WORLD);
  }
  void TearDown() override { comm.reset(); }
  int rank() const { return comm->rank(); }
  int size() const { return comm->size(); }
  const ByteCounters::Entry* entry(const Communicator& c, const std::string& op) const {
    auto it = c.counters().ops.find(op);
    return it == c.counters().ops.end() ? nullptr : &it->second;
  }
  std::unique_ptr<NcclCommunicator> comm;
};

TEST_F(NcclCollectives, RankSizeBackend) {
  int r = -1, p = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  MPI_Comm_size(MPI_COMM_WORLD, &p);
  EXPECT_EQ(rank(), r);
  EXPECT_EQ(size(), p);
  EXPECT_EQ(comm->backend(), "nccl");
  EXPECT_NE(comm->stream(), nullptr);  // owned, not the legacy default stream
  int n = -1, me = -1;
  ASSERT_EQ(ncclCommCount(comm->nccl_comm(), &n), ncclSuccess);
  ASSERT_EQ(ncclCommUserRank(comm->nccl_comm(), &me), ncclSuccess);
  EXPECT_EQ(n, p);
  EXPECT_EQ(me, r);
  int cmp = 0;
  MPI_Comm_compare(comm->control_comm(), MPI_COMM_WORLD, &cmp);
  EXPECT_EQ(cmp, MPI_CONGRUENT);                // a private duplicate for the control path
  EXPECT_EQ(comm->control().backend(), "mpi");  // host control data (agree_on_validation)
  EXPECT_EQ(comm->control().rank(), r);
  EXPECT_EQ(comm->counters().total_bytes(), 0u);
}

// Two messages per direction. Tags are only ordering within a batch: here the receives are posted
// tag 7 then 8 and the sends tag 8 then 7, and tag order within the batch pairs them right.
TEST_F(NcclCollectives, IsendIrecvRingExchange) {
  const int P = size(), me = rank(), next = (me + 1) % P, prev = (me - 1 + P) % P;
  const size_t n = 1000;
  std::vector<int32_t> send(n), send2(n / 2);
  for (size_t i = 0; i < n; ++i)
    send[i] = int32_t(me * 100000 + int(i));
  for (size_t i = 0; i < n / 2; ++i)
    send2[i] = int32_t(-me - int(i));
  DeviceBuffer<int32_t> d_send(send), d_send2(send2), d_recv(filled<int32_t>(n, -1)),
      d_recv2(filled<int32_t>(n / 2, -1));
  std::vector<RequestPtr> reqs;
  reqs.push_back(comm->irecv(d_recv.get(), n * 4, prev, 7));
  reqs.push_back(comm->isend(d_send2.get(), n / 2 * 4, next, 8));
  reqs.push_back(comm->isend(d_send.get(), n * 4, next, 7));
  reqs.push_back(comm->irecv(d_recv2.get(), n / 2 * 4, prev, 8));
  comm->wait_all(reqs);
  EXPECT_TRUE(reqs.empty());
  const auto recv = d_recv.host(), recv2 = d_recv2.host();
  for (size_t i = 0; i < n; ++i)
    ASSERT_EQ(recv[i], int32_t(prev * 100000 + int(i))) << i;
  for (size_t i = 0; i < n / 2; ++i)
    ASSERT_EQ(recv2[i], int32_t(-prev - int(i))) << i;
  const auto* e = entry(*comm, "send");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->bytes, n * 4 + n / 2 * 4);
  EXPECT_EQ(e->calls, 2u);
  EXPECT_EQ(comm->counters().total_bytes(), n * 4 + n / 2 * 4);  // irecv counts nothing

  // One wait (on any request) issues and completes the whole batch.
  DeviceBuffer<int32_t> d_one(filled<int32_t>(1, -1)), d_mine(filled<int32_t>(1, me));
  RequestPtr r = comm->irecv(d_one.get(), 4, prev, 0);
  RequestPtr s = comm->isend(d_mine.get(), 4, next, 0);
  comm->wait(s);
  comm->wait(r);
  EXPECT_EQ(d_one.host()[0], prev);
  RequestPtr none;
  comm->wait(none);  // a null request is a no-op
}

TEST_F(NcclCollectives, Sendrecv) {
  const int P = size(), me = rank(), next = (me + 1) % P, prev = (me - 1 + P) % P;
  DeviceBuffer<double> send(filled(33, double(me) + 0.5)), recv(filled(33, -1.0));
  comm->sendrecv(send.get(), 33 * 8, next, recv.get(), 33 * 8, prev, 3);
  for (double x : recv.host())
    ASSERT_EQ(x, double(prev) + 0.5);
  EXPECT_EQ(comm->counters().bytes("send"), 33u * 8);
  // Opposite direction, different sizes per direction: a rank sends me+1 bytes to prev.
  DeviceBuffer<char> s2(filled(size_t(me + 1), char('a' + me))), r2(filled(size_t(next + 1), '\0'));
  comm->sendrecv(s2.get(), s2.bytes(), prev, r2.get(), r2.bytes(), next, 4);
  for (char c : r2.host())
    ASSERT_EQ(c, char('a' + next));
  EXPECT_EQ(comm->counters().bytes("send"), 33u * 8 + size_t(me + 1));
  EXPECT_EQ(entry(*comm, "send")->calls, 2u);
}

TEST_F(NcclCollectives, AllreduceF32) {
  const int P = size(), me = rank();
  const size_t n = 17;
  std::vector<float> send(n);
  for (size_t i = 0; i < n; ++i)
    send[i] = float(me + 1) * float(i + 1);
  DeviceBuffer<float> d_send(send), d_recv(n);
  comm->allreduce(d_send.get(), d_recv.get(), n, DType::f32, ReduceOp::sum);
  const float tri = float(P * (P + 1) / 2);
  auto recv = d_recv.host();
  for (size_t i = 0; i < n; ++i)
    ASSERT_EQ(recv[i], tri * float(i + 1)) << i;
  comm->allreduce(d_send.get(), d_recv.get(), n, DType::f32, ReduceOp::max);
  recv = d_recv.host();
  for (size_t i = 0; i < n; ++i)
    ASSERT_EQ(recv[i], float(P) * float(i + 1)) << i;
  comm->allreduce(d_send.get(), d_recv.get(), n, DType::f32, ReduceOp::min);
  recv = d_recv.host();
  for (size_t i = 0; i < n; ++i)
    ASSERT_EQ(recv[i], float(i + 1)) << i;
  // In place; -inf (an empty lse) survives a max with -inf.
  DeviceBuffer<float> x(std::vector<float>{float(me), -INFINITY, me == 0 ? 5.f : -INFINITY});
  comm->allreduce(x.get(), x.get(), 3, DType::f32, ReduceOp::max);
  const auto xh = x.host();
  EXPECT_EQ(xh[0], float(P - 1));
  EXPECT_EQ(xh[1], -INFINITY);
  EXPECT_EQ(xh[2], 5.f);
  EXPECT_EQ(comm->counters().bytes("allreduce"), 3 * n * 4 + 3 * 4);
  EXPECT_EQ(entry(*comm, "allreduce")->calls, 4u);
}

// bf16 and f16 sums are exact for these small integers; max and min as well. Counted as
// count * 2 bytes.
template <typename T, typename To, typename From>
void check_allreduce16(NcclCommunicator& comm, DType dtype, To to, From from) {
  const int P = comm.size(), me = comm.rank();
  std::vector<T> x(8);
  for (size_t i = 0; i < x.size(); ++i)
    x[i] = to(float(me + 1) + float(i));
  DeviceBuffer<T> d(x), out(x.size());
  comm.allreduce(d.get(), d.get(), x.size(), dtype, ReduceOp::sum);  // in place
  auto h = d.host();
  for (size_t i = 0; i < h.size(); ++i)
    EXPECT_EQ(from(h[i]), float(P * (P + 1) / 2) + float(P) * float(i)) << dtype_name(dtype) << i;
  d.put(x);
  comm.allreduce(d.get(), out.get(), x.size(), dtype, ReduceOp::max);
  h = out.host();
  for (size_t i = 0; i < h.size(); ++i)
    EXPECT_EQ(from(h[i]), float(P) + float(i)) << dtype_name(dtype) << i;
  comm.allreduce(d.get(), out.get(), x.size(), dtype, ReduceOp::min);
  h = out.host();
  for (size_t i = 0; i < h.size(); ++i)
    EXPECT_EQ(from(h[i]), 1.f + float(i)) << dtype_name(dtype) << i;
}

TEST_F(NcclCollectives, AllreduceBf16AndF16) {
  check_allreduce16<bf16>(
      *comm, DType::bf16, [](float f) { return to_bf16(f); }, [](bf16 v) { return to_float(v); });
  EXPECT_EQ(comm->counters().bytes("allreduce"), 3u * 8 * 2);
  check_allreduce16<f16>(
      *comm, DType::f16, [](float f) { return to_f16(f); }, [](f16 v) { return to_float(v); });
  EXPECT_EQ(comm->counters().bytes("allreduce"), 6u * 8 * 2);
  EXPECT_EQ(entry(*comm, "allreduce")->calls, 6u);
}

// Control data: host memory over the MPI side channel, counted as "control".
TEST_F(NcclCollectives, AllreduceU64OnHostMemory) {
  const int P = size(), me = rank();
  const uint64_t big = uint64_t(1) << 40;
  std::vector<uint64_t> send = {uint64_t(me), big + uint64_t(me), ~uint64_t(0) - uint64_t(me)};
  std::vector<uint64_t> recv(3);
  comm->allreduce_u64(send.data(), recv.data(), 3, ReduceOp::sum);
  EXPECT_EQ(recv[0], uint64_t(P * (P - 1) / 2));
  EXPECT_EQ(recv[1], uint64_t(P) * big + uint64_t(P * (P - 1) / 2));
  comm->allreduce_u64(send.data(), recv.data(), 3, ReduceOp::max);
  EXPECT_EQ(recv[2], ~uint64_t(0));
  comm->allreduce_u64(send.data(), send.data(), 3, ReduceOp::min);  // in place
  EXPECT_EQ(send[0], 0u);
  EXPECT_EQ(comm->counters().bytes("control"), 3u * 3 * 8);
  EXPECT_EQ(comm->counters().data_bytes(), 0u);
}

TEST_F(NcclCollectives, Reduce) {
  const int P = size(), me = rank();
  for (int root = 0; root < P; ++root) {
    DeviceBuffer<float> send(filled(5, float(me + 1))), recv(filled(5, -7.f));
    comm->reduce(send.get(), recv.get(), 5, DType::f32, ReduceOp::sum, root);
    if (me == root) {
      for (float x : recv.host())
        ASSERT_EQ(x, float(P * (P + 1) / 2));
    }
  }
  DeviceBuffer<float> mx(filled(2, float(me))), out(2);
  comm->reduce(mx.get(), out.get(), 2, DType::f32, ReduceOp::max, P - 1);
  if (me == P - 1) {
    EXPECT_EQ(out.host()[0], float(P - 1));
  }
  // In place at the root.
  DeviceBuffer<float> ip(filled(3, 1.f));
  comm->reduce(ip.get(), ip.get(), 3, DType::f32, ReduceOp::sum, 0);
  if (me == 0) {
    EXPECT_EQ(ip.host()[2], float(P));
  }
  EXPECT_EQ(comm->counters().bytes("reduce"), uint64_t(P) * 5 * 4 + 2 * 4 + 3 * 4);
  EXPECT_EQ(entry(*comm, "reduce")->calls, uint64_t(P) + 2);
}

TEST_F(NcclCollectives, Allgather) {
  const int P = size(), me = rank();
  const size_t n = 10;
  std::vector<int16_t> send(n);
  for (size_t i = 0; i < n; ++i)
    send[i] = int16_t(me * 100 + int(i));
  DeviceBuffer<int16_t> d_send(send), d_recv(filled<int16_t>(n * size_t(P), -1));
  comm->allgather(d_send.get(), d_recv.get(), n * 2);
  const auto recv = d_recv.host();
  for (int r = 0; r < P; ++r)
    for (size_t i = 0; i < n; ++i)
      ASSERT_EQ(recv[size_t(r) * n + i], int16_t(r * 100 + int(i)));
  EXPECT_EQ(comm->counters().bytes("allgather"), n * 2);
}

TEST_F(NcclCollectives, AllgathervDifferentSizes) {
  const int P = size(), me = rank();
  // Rank r contributes 3 * r + 1 bytes valued r, except that rank 0 contributes none.
  std::vector<size_t> sizes(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r)
    sizes[size_t(r)] = r == 0 ? 0 : size_t(3 * r + 1);
  const size_t total = std::accumulate(sizes.begin(), sizes.end(), size_t(0));
  DeviceBuffer<uint8_t> send(filled(sizes[size_t(me)], uint8_t(me))),
      recv(filled<uint8_t>(total + 1, 255));
  comm->allgatherv(send.get(), sizes[size_t(me)], recv.get(), sizes);
  const auto h = recv.host();
  size_t off = 0;
  for (int r = 0; r < P; ++r)
    for (size_t i = 0; i < sizes[size_t(r)]; ++i)
      ASSERT_EQ(h[off++], uint8_t(r));
  EXPECT_EQ(h[total], 255) << "wrote past the gathered bytes";
  EXPECT_EQ(comm->counters().bytes("allgather"), sizes[size_t(me)]);
  EXPECT_EQ(entry(*comm, "allgather")->calls, 1u);
}

TEST_F(NcclCollectives, GatherAtFirstAndLastRank) {
  const int P = size(), me = rank();
  const size_t n = 7;  // int32 per rank
  uint64_t expect_bytes = 0;
  for (int root : {0, P - 1}) {
    std::vector<int32_t> send(n);
    for (size_t i = 0; i < n; ++i)
      send[i] = me * 1000 + root * 100 + int(i);
    DeviceBuffer<int32_t> d_send(send), d_recv(filled<int32_t>(n * size_t(P), -1));
    comm->gather(d_send.get(), d_recv.get(), n * 4, root);
    const auto recv = d_recv.host();
    if (me == root) {
      for (int r = 0; r < P; ++r)
        for (size_t i = 0; i < n; ++i)
          ASSERT_EQ(recv[size_t(r) * n + i], r * 1000 + root * 100 + int(i))
              << "root " << root << ", from rank " << r;
    } else {
      for (int32_t x : recv)
        ASSERT_EQ(x, -1) << "a non-root's receive buffer was written (root " << root << ")";
    }
    expect_bytes += me == root ? 0 : n * 4;
    EXPECT_EQ(comm->counters().bytes("gather"), expect_bytes) << "after root " << root;
  }
  EXPECT_EQ(entry(*comm, "gather")->calls, 2u);
  EXPECT_EQ(comm->counters().total_bytes(), expect_bytes);
  comm->gather(nullptr, nullptr, 0, 0);  // zero bytes per rank: legal, counted as nothing
  EXPECT_EQ(comm->counters().bytes("gather"), expect_bytes);
}

TEST_F(NcclCollectives, Broadcast) {
  const int P = size(), me = rank();
  for (int root = 0; root < P; ++root) {
    DeviceBuffer<int32_t> buf(filled(21, me == root ? 1000 + root : -1));
    comm->broadcast(buf.get(), buf.bytes(), root);
    for (int32_t x : buf.host())
      ASSERT_EQ(x, 1000 + root);
  }
  EXPECT_EQ(comm->counters().bytes("broadcast"), 21u * 4);  // each rank was root once
  EXPECT_EQ(entry(*comm, "broadcast")->calls, uint64_t(P));
}

TEST_F(NcclCollectives, Alltoall) {
  const int P = size(), me = rank();
  const size_t per = 6;  // int32 per block
  std::vector<int32_t> send(per * size_t(P));
  for (int r = 0; r < P; ++r)
    for (size_t i = 0; i < per; ++i)
      send[size_t(r) * per + i] = me * 1000 + r * 10 + int(i);
  DeviceBuffer<int32_t> d_send(send), d_recv(filled<int32_t>(per * size_t(P), -1));
  comm->alltoall(d_send.get(), d_recv.get(), per * 4);
  const auto recv = d_recv.host();
  for (int r = 0; r < P; ++r)
    for (size_t i = 0; i < per; ++i)
      ASSERT_EQ(recv[size_t(r) * per + i], r * 1000 + me * 10 + int(i)) << "from " << r;
  EXPECT_EQ(comm->counters().bytes("alltoall"), uint64_t(P - 1) * per * 4);
}

// Uneven sizes per pair, zeros included; "alltoall" counts the bytes sent to the other ranks.
TEST_F(NcclCollectives, AlltoallvDifferentSizesPerPair) {
  const int P = size(), me = rank();
  auto pair_size = [](int from, int to) { return size_t(((from * 3 + to * 5 + 1) % 4) * 7); };
  auto value = [](int from, int to, size_t i) { return uint8_t(from * 61 + to * 13 + int(i)); };
  std::vector<size_t> send_sizes(static_cast<size_t>(P)), recv_sizes(static_cast<size_t>(P));
  size_t send_total = 0, recv_total = 0, to_others = 0;
  for (int r = 0; r < P; ++r) {
    send_sizes[size_t(r)] = pair_size(me, r);
    recv_sizes[size_t(r)] = pair_size(r, me);
    send_total += send_sizes[size_t(r)];
    recv_total += recv_sizes[size_t(r)];
    if (r != me) to_others += send_sizes[size_t(r)];
  }
  std::vector<uint8_t> send(send_total);
  size_t off = 0;
  for (int r = 0; r < P; ++r)
    for (size_t i = 0; i < send_sizes[size_t(r)]; ++i)
      send[off++] = value(me, r, i);
  DeviceBuffer<uint8_t> d_send(send), d_recv(filled<uint8_t>(recv_total + 1, 0xee));
  comm->alltoallv(d_send.get(), send_sizes, d_recv.get(), recv_sizes);
  const auto recv = d_recv.host();
  off = 0;
  for (int r = 0; r < P; ++r)
    for (size_t i = 0; i < recv_sizes[size_t(r)]; ++i)
      ASSERT_EQ(recv[off++], value(r, me, i)) << "from " << r << " byte " << i;
  EXPECT_EQ(recv[recv_total], 0xee) << "wrote past the received bytes";
  const auto* e = entry(*comm, "alltoall");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->bytes, to_others);
  EXPECT_EQ(e->calls, 1u);
  EXPECT_EQ(comm->counters().total_bytes(), to_others);

  // Only the block to itself: nothing counted, the own block arrives.
  std::vector<size_t> self_only(static_cast<size_t>(P), 0);
  self_only[size_t(me)] = 12;
  std::vector<uint8_t> mine(12);
  for (size_t i = 0; i < 12; ++i)
    mine[i] = uint8_t(me + int(i));
  DeviceBuffer<uint8_t> s(mine), r(12);
  comm->alltoallv(s.get(), self_only, r.get(), self_only);
  EXPECT_EQ(r.host(), mine);
  EXPECT_EQ(comm->counters().bytes("alltoall"), to_others);
}

TEST_F(NcclCollectives, BarrierAndResetCounters) {
  comm->barrier();
  comm->barrier();
  EXPECT_EQ(comm->counters().total_bytes(), 0u);
  DeviceBuffer<float> x(filled(1, 1.f));
  comm->allreduce(x.get(), x.get(), 1, DType::f32, ReduceOp::sum);
  EXPECT_EQ(comm->counters().total_bytes(), 4u);
  comm->reset_counters();
  EXPECT_TRUE(comm->counters().ops.empty());
}

TEST_F(NcclCollectives, SplitEvenOdd) {
  const int P = size(), me = rank();
  auto sub = comm->split(me % 2, -me);  // key reverses the order inside each group
  std::vector<int> group;
  for (int r = P - 1; r >= 0; --r)
    if (r % 2 == me % 2) group.push_back(r);
  ASSERT_EQ(sub->size(), int(group.size()));
  const int my_index = int(std::find(group.begin(), group.end(), me) - group.begin());
  EXPECT_EQ(sub->rank(), my_index);
  EXPECT_EQ(sub->backend(), "nccl");
  // A device allreduce inside the sub-group.
  DeviceBuffer<float> v(filled(4, float(me)));
  sub->allreduce(v.get(), v.get(), 4, DType::f32, ReduceOp::sum);
  float expect = 0;
  for (int r = me % 2; r < P; r += 2)
    expect += float(r);
  EXPECT_EQ(v.host()[3], expect);
  EXPECT_EQ(sub->counters().bytes("allreduce"), 16u);
  EXPECT_EQ(comm->counters().total_bytes(), 0u);  // the parent counted nothing
  // Point-to-point inside the sub-group, by sub-group ranks.
  const int sp = sub->size(), sr = sub->rank();
  DeviceBuffer<int> out(filled(1, me)), in(filled(1, -1));
  sub->sendrecv(out.get(), 4, (sr + 1) % sp, in.get(), 4, (sr - 1 + sp) % sp, 9);
  EXPECT_EQ(in.host()[0], group[size_t((my_index - 1 + sp) % sp)]);
  // The parent still works after the split.
  DeviceBuffer<float> one(filled(1, 1.f));
  comm->allreduce(one.get(), one.get(), 1, DType::f32, ReduceOp::sum);
  EXPECT_EQ(one.host()[0], float(P));
}

TEST_F(NcclCollectives, SplitNode) {
  auto node = comm->split_node();  // every rank of these tests runs on this one machine
  EXPECT_EQ(node->size(), size());
  EXPECT_EQ(node->rank(), rank());
  EXPECT_EQ(node->backend(), "nccl");
  DeviceBuffer<float> x(filled(2, 1.f));
  node->allreduce(x.get(), x.get(), 2, DType::f32, ReduceOp::sum);
  EXPECT_EQ(x.host()[1], float(size()));
  uint64_t one = 1, n = 0;
  node->allreduce_u64(&one, &n, 1, ReduceOp::sum);
  EXPECT_EQ(n, uint64_t(size()));
}

TEST_F(NcclCollectives, BadPeerThrowsAtPosting) {
  int x = 0;
  const int P = size();
  try {
    auto r = comm->isend(&x, 4, P + 3, 1);
    ADD_FAILURE() << "isend to rank " << P + 3 << " of " << P << " did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("isend peer"), std::string::npos) << e.what();
  }
  // Nothing was queued: the ranks are still in step.
  DeviceBuffer<float> one(filled(1, 1.f));
  comm->allreduce(one.get(), one.get(), 1, DType::f32, ReduceOp::sum);
  EXPECT_EQ(one.host()[0], float(P));
}

// ---------------------------------------------------------------- without a GPU
// Every rank gets a dattn::Error naming the CUDA failure: no hang, no crash, and the ranks are
// still in step afterwards (the failure was agreed over MPI, not left to a collective).
TEST(NcclNoGpu, FromMpiThrowsOnEveryRank) {
  if (!no_gpu_mode()) GTEST_SKIP() << "runs with DATTN_NCCL_TEST_NO_GPU=1 (ctest nccl_nogpu_np2)";
  int threw = 0;
  try {
    auto comm = NcclCommunicator::from_mpi(MPI_COMM_WORLD, 30);
    ADD_FAILURE() << "from_mpi succeeded without a visible GPU";
  } catch (const Error& e) {
    threw = 1;
    const std::string what = e.what();
    if (e.message().find("another rank") == std::string::npos) {
      std::printf("[rank %d] from_mpi without a GPU: %s\n", error_rank(), what.c_str());
      std::fflush(stdout);
    }
    EXPECT_TRUE(what.find("CUDA call failed") != std::string::npos ||
                what.find("NCCL call failed") != std::string::npos)
        << what;
  }
  int size = 0, all = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Allreduce(&threw, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  EXPECT_EQ(all, size);
}

}  // namespace
}  // namespace dattn
