// Multi-rank tests (1-4 ranks) of the MPI Communicator: point-to-point, every collective,
// sub-groups, and the per-operation byte counters, which must equal what communicator.h
// documents for each operation.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "collective/mpi_communicator.h"
#include "src/base/error.h"
#include "tests/mpi_support.h"

namespace dattn {
namespace {

class Collectives : public testing::Test {
 protected:
  void SetUp() override { comm = std::make_unique<MpiCommunicator>(MPI_COMM_WORLD); }
  void TearDown() override { comm.reset(); }
  int rank() const { return comm->rank(); }
  int size() const { return comm->size(); }
  const ByteCounters::Entry* entry(const Communicator& c, const std::string& op) const {
    auto it = c.counters().ops.find(op);
    return it == c.counters().ops.end() ? nullptr : &it->second;
  }
  std::unique_ptr<MpiCommunicator> comm;
};

TEST_F(Collectives, RankSizeBackend) {
  int r = -1, p = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  MPI_Comm_size(MPI_COMM_WORLD, &p);
  EXPECT_EQ(rank(), r);
  EXPECT_EQ(size(), p);
  EXPECT_EQ(comm->backend(), "mpi");
  EXPECT_NE(comm->comm(), MPI_COMM_WORLD);  // a private duplicate
  int cmp = 0;
  MPI_Comm_compare(comm->comm(), MPI_COMM_WORLD, &cmp);
  EXPECT_EQ(cmp, MPI_CONGRUENT);
  EXPECT_EQ(&comm->control(), comm.get());  // host buffers: its own control communicator
  EXPECT_EQ(comm->counters().total_bytes(), 0u);
}

TEST_F(Collectives, IsendIrecvRingExchange) {
  const int P = size(), me = rank(), next = (me + 1) % P, prev = (me - 1 + P) % P;
  const size_t n = 1000;
  std::vector<int32_t> send(n), recv(n, -1), send2(n / 2), recv2(n / 2, -1);
  for (size_t i = 0; i < n; ++i)
    send[i] = int32_t(me * 100000 + int(i));
  for (size_t i = 0; i < n / 2; ++i)
    send2[i] = int32_t(-me - int(i));
  std::vector<RequestPtr> reqs;
  // Two messages on different tags to the same peer, posted receive-first and send-first.
  reqs.push_back(comm->irecv(recv.data(), n * 4, prev, 7));
  reqs.push_back(comm->isend(send2.data(), n / 2 * 4, next, 8));
  reqs.push_back(comm->isend(send.data(), n * 4, next, 7));
  reqs.push_back(comm->irecv(recv2.data(), n / 2 * 4, prev, 8));
  comm->wait_all(reqs);
  EXPECT_TRUE(reqs.empty());
  for (size_t i = 0; i < n; ++i)
    ASSERT_EQ(recv[i], int32_t(prev * 100000 + int(i))) << i;
  for (size_t i = 0; i < n / 2; ++i)
    ASSERT_EQ(recv2[i], int32_t(-prev - int(i))) << i;
  const auto* e = entry(*comm, "send");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->bytes, n * 4 + n / 2 * 4);
  EXPECT_EQ(e->calls, 2u);
  EXPECT_EQ(comm->counters().total_bytes(), n * 4 + n / 2 * 4);  // irecv counts nothing

  // wait on a null request is a no-op.
  RequestPtr none;
  comm->wait(none);
}

TEST_F(Collectives, Sendrecv) {
  const int P = size(), me = rank(), next = (me + 1) % P, prev = (me - 1 + P) % P;
  std::vector<double> send(33, double(me) + 0.5), recv(33, -1);
  comm->sendrecv(send.data(), 33 * 8, next, recv.data(), 33 * 8, prev, 3);
  for (double x : recv)
    ASSERT_EQ(x, double(prev) + 0.5);
  EXPECT_EQ(comm->counters().bytes("send"), 33u * 8);
  // Opposite direction, different sizes per direction: a rank sends me+1 bytes to prev.
  std::vector<char> s2(size_t(me + 1), char('a' + me)), r2(size_t(next + 1), 0);
  comm->sendrecv(s2.data(), s2.size(), prev, r2.data(), r2.size(), next, 4);
  for (char c : r2)
    ASSERT_EQ(c, char('a' + next));
  EXPECT_EQ(comm->counters().bytes("send"), 33u * 8 + size_t(me + 1));
  EXPECT_EQ(entry(*comm, "send")->calls, 2u);
}

TEST_F(Collectives, AllreduceF32) {
  const int P = size(), me = rank();
  const size_t n = 17;
  std::vector<float> send(n), recv(n);
  for (size_t i = 0; i < n; ++i)
    send[i] = float(me + 1) * float(i + 1);
  comm->allreduce(send.data(), recv.data(), n, DType::f32, ReduceOp::sum);
  const float tri = float(P * (P + 1) / 2);
  for (size_t i = 0; i < n; ++i)
    ASSERT_EQ(recv[i], tri * float(i + 1)) << i;
  comm->allreduce(send.data(), recv.data(), n, DType::f32, ReduceOp::max);
  for (size_t i = 0; i < n; ++i)
    ASSERT_EQ(recv[i], float(P) * float(i + 1)) << i;
  comm->allreduce(send.data(), recv.data(), n, DType::f32, ReduceOp::min);
  for (size_t i = 0; i < n; ++i)
    ASSERT_EQ(recv[i], float(i + 1)) << i;
  // In place; -inf (an empty lse) survives a max with -inf.
  std::vector<float> x = {float(me), -INFINITY, me == 0 ? 5.f : -INFINITY};
  comm->allreduce(x.data(), x.data(), 3, DType::f32, ReduceOp::max);
  EXPECT_EQ(x[0], float(P - 1));
  EXPECT_EQ(x[1], -INFINITY);
  EXPECT_EQ(x[2], 5.f);
  EXPECT_EQ(comm->counters().bytes("allreduce"), 3 * n * 4 + 3 * 4);
  EXPECT_EQ(entry(*comm, "allreduce")->calls, 4u);
}

// A 16-bit reduction either works (exact for these small integers) or is refused with a
// dattn::Error naming the dtype on every rank (the MPI backend reduces fp32 partials only);
// either way no rank is left in the collective.
TEST_F(Collectives, AllreduceBf16SumOrRefused) {
  const int P = size(), me = rank();
  std::vector<bf16> x(8);
  for (size_t i = 0; i < x.size(); ++i)
    x[i] = to_bf16(float(me + 1) + float(i));
  try {
    comm->allreduce(x.data(), x.data(), x.size(), DType::bf16, ReduceOp::sum);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("dtype"), std::string::npos) << e.what();
    EXPECT_EQ(comm->counters().bytes("allreduce"), 0u);
    // The ranks are still in step.
    uint64_t one = 1, n = 0;
    comm->allreduce_u64(&one, &n, 1, ReduceOp::sum);
    EXPECT_EQ(n, uint64_t(P));
    return;
  }
  for (size_t i = 0; i < x.size(); ++i)
    EXPECT_EQ(to_float(x[i]), float(P * (P + 1) / 2) + float(P) * float(i)) << i;
  EXPECT_EQ(comm->counters().bytes("allreduce"), 8u * 2);
}

TEST_F(Collectives, AllreduceU64) {
  const int P = size(), me = rank();
  const uint64_t big = uint64_t(1) << 40;
  std::vector<uint64_t> send = {uint64_t(me), big + uint64_t(me), ~uint64_t(0) - uint64_t(me)};
  std::vector<uint64_t> recv(3);
  comm->allreduce_u64(send.data(), recv.data(), 3, ReduceOp::sum);
  EXPECT_EQ(recv[0], uint64_t(P * (P - 1) / 2));
  EXPECT_EQ(recv[1], uint64_t(P) * big + uint64_t(P * (P - 1) / 2));
  comm->allreduce_u64(send.data(), recv.data(), 3, ReduceOp::max);
  EXPECT_EQ(recv[0], uint64_t(P - 1));
  EXPECT_EQ(recv[2], ~uint64_t(0));  // unsigned: no sign trouble near 2^64
  comm->allreduce_u64(send.data(), recv.data(), 3, ReduceOp::min);
  EXPECT_EQ(recv[0], 0u);
  EXPECT_EQ(recv[2], ~uint64_t(0) - uint64_t(P - 1));
  comm->allreduce_u64(send.data(), send.data(), 3, ReduceOp::max);  // in place
  EXPECT_EQ(send[1], big + uint64_t(P - 1));
  EXPECT_EQ(comm->counters().bytes("control"), 4u * 3 * 8);  // control data, not "allreduce"
  EXPECT_EQ(comm->counters().bytes("allreduce"), 0u);
}

TEST_F(Collectives, Reduce) {
  const int P = size(), me = rank();
  for (int root = 0; root < P; ++root) {
    std::vector<float> send(5, float(me + 1)), recv(5, -7.f);
    comm->reduce(send.data(), recv.data(), 5, DType::f32, ReduceOp::sum, root);
    if (me == root) {
      for (float x : recv)
        ASSERT_EQ(x, float(P * (P + 1) / 2));
    }
  }
  std::vector<float> mx(2, float(me)), out(2);
  comm->reduce(mx.data(), out.data(), 2, DType::f32, ReduceOp::max, P - 1);
  if (me == P - 1) {
    EXPECT_EQ(out[0], float(P - 1));
  }
  // Counted on every rank, the root's own contribution included.
  EXPECT_EQ(comm->counters().bytes("reduce"), uint64_t(P) * 5 * 4 + 2 * 4);
  EXPECT_EQ(entry(*comm, "reduce")->calls, uint64_t(P) + 1);
}

TEST_F(Collectives, Allgather) {
  const int P = size(), me = rank();
  const size_t n = 10;
  std::vector<int16_t> send(n), recv(n * size_t(P), -1);
  for (size_t i = 0; i < n; ++i)
    send[i] = int16_t(me * 100 + int(i));
  comm->allgather(send.data(), recv.data(), n * 2);
  for (int r = 0; r < P; ++r)
    for (size_t i = 0; i < n; ++i)
      ASSERT_EQ(recv[size_t(r) * n + i], int16_t(r * 100 + int(i)));
  EXPECT_EQ(comm->counters().bytes("allgather"), n * 2);
}

TEST_F(Collectives, AllgathervDifferentSizes) {
  const int P = size(), me = rank();
  // Rank r contributes 3 * r bytes (rank 0 none), valued r.
  std::vector<size_t> sizes(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r)
    sizes[size_t(r)] = size_t(3 * r);
  const size_t total = std::accumulate(sizes.begin(), sizes.end(), size_t(0));
  std::vector<uint8_t> send(sizes[size_t(me)], uint8_t(me)), recv(std::max<size_t>(total, 1), 255);
  comm->allgatherv(send.data(), send.size(), recv.data(), sizes);
  size_t off = 0;
  for (int r = 0; r < P; ++r)
    for (size_t i = 0; i < sizes[size_t(r)]; ++i)
      ASSERT_EQ(recv[off++], uint8_t(r));
  EXPECT_EQ(comm->counters().bytes("allgather"), sizes[size_t(me)]);
  EXPECT_EQ(entry(*comm, "allgather")->calls, 1u);
}

// Gather at the first and the last rank: the root receives block r from rank r (its own block
// included); "gather" counts bytes_per_rank on every other rank and nothing on the root.
TEST_F(Collectives, GatherAtFirstAndLastRank) {
  const int P = size(), me = rank();
  const size_t n = 7;  // int32 per rank
  uint64_t expect_bytes = 0;
  for (int root : {0, P - 1}) {
    std::vector<int32_t> send(n), recv(n * size_t(P), -1);
    for (size_t i = 0; i < n; ++i)
      send[i] = me * 1000 + root * 100 + int(i);
    comm->gather(send.data(), recv.data(), n * 4, root);
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
  // Nothing else counted.
  EXPECT_EQ(comm->counters().total_bytes(), expect_bytes);
  // Zero bytes per rank: legal, counted as nothing.
  int32_t none_sent = 0, none_received = 0;
  comm->gather(&none_sent, &none_received, 0, 0);
  EXPECT_EQ(comm->counters().bytes("gather"), expect_bytes);
}

TEST_F(Collectives, Broadcast) {
  const int P = size(), me = rank();
  for (int root = 0; root < P; ++root) {
    std::vector<int32_t> buf(21, me == root ? 1000 + root : -1);
    comm->broadcast(buf.data(), buf.size() * 4, root);
    for (int32_t x : buf)
      ASSERT_EQ(x, 1000 + root);
  }
  // Bytes on the root only: each rank was root once.
  EXPECT_EQ(comm->counters().bytes("broadcast"), 21u * 4);
  EXPECT_EQ(entry(*comm, "broadcast")->calls, uint64_t(P));
}

TEST_F(Collectives, Alltoall) {
  const int P = size(), me = rank();
  const size_t per = 6;  // int32 per block
  std::vector<int32_t> send(per * size_t(P)), recv(per * size_t(P), -1);
  for (int r = 0; r < P; ++r)
    for (size_t i = 0; i < per; ++i)
      send[size_t(r) * per + i] = me * 1000 + r * 10 + int(i);
  comm->alltoall(send.data(), recv.data(), per * 4);
  for (int r = 0; r < P; ++r)
    for (size_t i = 0; i < per; ++i)
      ASSERT_EQ(recv[size_t(r) * per + i], r * 1000 + me * 10 + int(i)) << "from " << r;
  EXPECT_EQ(comm->counters().bytes("alltoall"), uint64_t(P - 1) * per * 4);
}

// Variable sizes per pair, zeros included: rank i sends rank j size(i, j) bytes valued from
// (i, j, index). "alltoall" counts the bytes sent to the other ranks only.
TEST_F(Collectives, AlltoallvDifferentSizesPerPair) {
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
  std::vector<uint8_t> send(std::max<size_t>(send_total, 1)), recv(recv_total + 1, 0xee);
  size_t off = 0;
  for (int r = 0; r < P; ++r)
    for (size_t i = 0; i < send_sizes[size_t(r)]; ++i)
      send[off++] = value(me, r, i);
  comm->alltoallv(send.data(), send_sizes, recv.data(), recv_sizes);
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
}

// Only the block to itself, or nothing at all: no bytes counted, and the own block arrives.
TEST_F(Collectives, AlltoallvSelfOnlyAndEmpty) {
  const int P = size(), me = rank();
  std::vector<size_t> sizes(static_cast<size_t>(P), 0);
  sizes[size_t(me)] = 12;
  std::vector<uint8_t> send(12), recv(12, 0);
  for (size_t i = 0; i < 12; ++i)
    send[i] = uint8_t(me + int(i));
  comm->alltoallv(send.data(), sizes, recv.data(), sizes);
  EXPECT_EQ(recv, send);
  EXPECT_EQ(comm->counters().bytes("alltoall"), 0u);
  std::vector<size_t> zeros(static_cast<size_t>(P), 0);
  uint8_t dummy_s = 1, dummy_r = 2;
  comm->alltoallv(&dummy_s, zeros, &dummy_r, zeros);
  EXPECT_EQ(dummy_r, 2);
  EXPECT_EQ(comm->counters().bytes("alltoall"), 0u);
  // And the ranks are still in step: a uniform exchange of one int each.
  std::vector<size_t> four(static_cast<size_t>(P), 4);
  std::vector<int32_t> s(static_cast<size_t>(P), me), r(static_cast<size_t>(P), -1);
  comm->alltoallv(s.data(), four, r.data(), four);
  for (int i = 0; i < P; ++i)
    EXPECT_EQ(r[size_t(i)], i);
  EXPECT_EQ(comm->counters().bytes("alltoall"), uint64_t(P - 1) * 4);
}

TEST_F(Collectives, BarrierMovesNoCountedBytes) {
  comm->barrier();
  comm->barrier();
  EXPECT_EQ(comm->counters().total_bytes(), 0u);
}

TEST_F(Collectives, ResetCounters) {
  float x = 1.f;
  comm->allreduce(&x, &x, 1, DType::f32, ReduceOp::sum);
  EXPECT_EQ(comm->counters().total_bytes(), 4u);
  comm->reset_counters();
  EXPECT_EQ(comm->counters().total_bytes(), 0u);
  EXPECT_TRUE(comm->counters().ops.empty());
}

TEST_F(Collectives, SplitEvenOdd) {
  const int P = size(), me = rank();
  // Even and odd ranks; key reverses the order inside each group.
  auto sub = comm->split(me % 2, -me);
  // My group ordered by key (-rank): ranks of my parity, highest first.
  std::vector<int> group;
  for (int r = P - 1; r >= 0; --r)
    if (r % 2 == me % 2) group.push_back(r);
  ASSERT_EQ(sub->size(), int(group.size()));
  const int my_index = int(std::find(group.begin(), group.end(), me) - group.begin());
  EXPECT_EQ(sub->rank(), my_index);
  EXPECT_EQ(sub->backend(), "mpi");
  uint64_t v = uint64_t(me), s = 0;
  sub->allreduce_u64(&v, &s, 1, ReduceOp::sum);
  uint64_t expect = 0;
  for (int r = me % 2; r < P; r += 2)
    expect += uint64_t(r);
  EXPECT_EQ(s, expect);
  EXPECT_EQ(sub->counters().bytes("control"), 8u);  // allreduce_u64 is control data
  // The sub-group's traffic is its own: the parent counted nothing (the split itself moves
  // no counted payload).
  EXPECT_EQ(comm->counters().bytes("control"), 0u);
  // Point-to-point inside the sub-group, by sub-group ranks.
  const int sp = sub->size(), sr = sub->rank();
  int out = me, in = -1;
  sub->sendrecv(&out, 4, (sr + 1) % sp, &in, 4, (sr - 1 + sp) % sp, 9);
  const int pred = group[size_t((my_index - 1 + sp) % sp)];
  EXPECT_EQ(in, pred);
}

TEST_F(Collectives, SplitNode) {
  // The ranks that share this rank's hostname: all of them on one machine, a host's on the test
  // cluster (tests/multinode).
  const std::vector<int> host = test::same_host_ranks();
  auto node = comm->split_node();
  ASSERT_EQ(node->size(), int(host.size()));
  EXPECT_EQ(host[size_t(node->rank())], rank());  // in world order
  uint64_t mine = uint64_t(rank()), sum = 0;
  node->allreduce_u64(&mine, &sum, 1, ReduceOp::sum);
  uint64_t expect = 0;
  for (int r : host)
    expect += uint64_t(r);
  EXPECT_EQ(sum, expect);
}

TEST_F(Collectives, BadPeerThrowsInsteadOfAborting) {
  int x = 0;
  const int P = size();
  try {
    auto r = comm->isend(&x, 4, P + 3, 1);
    comm->wait(r);
    ADD_FAILURE() << "isend to rank " << P + 3 << " of " << P << " did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("MPI"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace dattn
