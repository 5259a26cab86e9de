// The fused kernel paths (statistics and rewrite in one parallel region, or one channel at a time
// by all threads) reorder work, never arithmetic: their outputs must be bit-identical to the
// separate passes (ComputeStats then Apply, BackwardReduce then BackwardApply) on the same
// coefficients, for shapes that take each path.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "fbn/fbn.h"
#include "kernels/batch_norm_kernels.h"
#include "kernels/kernel_table.h"
#include "test_util.h"

namespace fbn_test {
namespace {

using fbn::DataType;
using fbn::Shape;
using fbn::kernels::Geometry;

bool SameDoubles(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

// The store tests' runs: the regular-store strips first (the reference), then a streaming call
// for each level the rows may come from.
constexpr std::pair<fbn::kernels::RowRead, bool> kStoreRuns[] = {
    {fbn::kernels::RowRead::kL3, false},     {fbn::kernels::RowRead::kL2, true},
    {fbn::kernels::RowRead::kL3, true},      {fbn::kernels::RowRead::kDram, true},
    {fbn::kernels::RowRead::kFlushed, true}, {fbn::kernels::RowRead::kFlushed, false}};

// An output buffer `offset` bytes past a 64-byte boundary (0: aligned, so that streaming stores
// do run), filled with 0x7f.
class AlignedOutput {
 public:
  explicit AlignedOutput(size_t bytes, size_t offset = 0)
      : bytes_(bytes),
        offset_(offset),
        p_(std::aligned_alloc(64, (bytes + offset + 63) / 64 * 64), &std::free) {
    std::memset(data(), 0x7f, bytes_);
  }
  void* data() { return static_cast<unsigned char*>(p_.get()) + offset_; }
  std::vector<unsigned char> Bytes() const {
    const auto* p = static_cast<const unsigned char*>(p_.get()) + offset_;
    return std::vector<unsigned char>(p, p + bytes_);
  }

 private:
  size_t bytes_, offset_;
  std::unique_ptr<void, decltype(&std::free)> p_;
};

struct PathCase {
  const char* name;
  Geometry g;
};

// Channels-first channels of 1.08M elements: over one task (2 MB) for every dtype, so forward
// (x) and backward (x and dy) take the channel-at-a-time path; small channels the per-task fused
// path; channels-last short rows the channel-group path; long rows the separate passes.
// Channels-first training gradients of several images with planes up to 2 KB sum in image order,
// as do float and double statistics of such tensors from 13 MB (14 MB here: image ranges and
// channel groups, a group ending in a tail; its 3.2 KB double planes take the fused tasks); the
// fused tasks keep one image, longer planes and the smaller tensors' statistics.
const PathCase kCases[] = {
    {"nchw_split_channels", {false, 2, 3, 540000}},
    {"nchw_fused_tasks", {false, 16, 37, 49}},
    {"nchw_fused_tasks_one_image", {false, 1, 37, 49}},
    {"nchw_fused_tasks_long_planes", {false, 3, 7, 2100}},
    {"nchw_image_order", {false, 2, 4401, 400}},
    {"nhwc_channel_groups", {true, 1, 2051, 49}},
    {"nhwc_rows", {true, 8, 40, 1500}},
    // Channels-first small planes run as channels-last copies (2x2, 3x3), or as the same memory
    // (1x1); 300x64x2x2 is over the general copy limit but within the 2x2 one. (Channels-last
    // tensors of at most 256 rows and 128 channels or more are the exception to this test: their
    // fused reductions take channel groups over all rows, the separate ones row ranges.)
    {"nchw_small_planes", {false, 3, 37, 4}},
    {"nchw_3x3_planes", {false, 2, 19, 9}},
    {"nchw_1x1_planes", {false, 9, 37, 1}},
    {"nchw_many_2x2_planes", {false, 300, 64, 4}},
    // Channels-last rows of 3 channels run as channels-first copies, of 1 as the same memory.
    {"nhwc_3_channels", {true, 4, 3, 500}},
    {"nhwc_1_channel", {true, 4, 1, 500}},
};

class KernelPathsTest : public ::testing::TestWithParam<std::tuple<DataType, int>> {};

TEST_P(KernelPathsTest, FusedPathsMatchSeparatePasses) {
  const auto [t, k] = GetParam();
  const Geometry& g = kCases[k].g;
  const DataType acc = StatsType(t);
  std::mt19937 rng(5);
  const Shape xs{g.elements()}, cs{g.c};
  const HostTensor x = RandomTensor(t, xs, -2.0, 3.0, &rng);
  const HostTensor dy = RandomTensor(t, xs, -1.0, 1.0, &rng);
  const HostTensor scale = RandomTensor(acc, cs, 0.5, 1.5, &rng);
  const HostTensor offset = RandomTensor(acc, cs, -0.5, 0.5, &rng);
  const HostTensor k1 = RandomTensor(acc, cs, 0.5, 1.5, &rng);
  const size_t C = static_cast<size_t>(g.c);
  std::vector<double> inv(C);
  for (size_t c = 0; c < C; ++c) inv[c] = 0.5 + 0.01 * static_cast<double>(c % 50);

  // Forward training against ComputeStats + Apply with the coefficients it computed.
  std::vector<double> mean(C), var(C), mean2(C), var2(C);
  HostTensor k_mean(acc, cs), k_a(acc, cs), k_b(acc, cs), y(t, xs), y2(t, xs);
  fbn::kernels::ForwardTraining(t, g, x.data(), scale.data(), offset.data(), 1e-3, mean.data(),
                                var.data(), k_mean.data(), k_a.data(), k_b.data(), y.data());
  fbn::kernels::ComputeStats(t, g, x.data(), mean2.data(), var2.data());
  EXPECT_TRUE(SameDoubles(mean, mean2)) << "mean";
  EXPECT_TRUE(SameDoubles(var, var2)) << "variance";
  fbn::kernels::Apply(t, g, x.data(), k_mean.data(), k_a.data(), k_b.data(), y2.data());
  EXPECT_TRUE(y.BytesEqual(y2)) << "y";

  // Backward training against BackwardReduce + BackwardApply.
  std::vector<double> s_dy(C), s_dyxc(C), s_dy2(C), s_dyxc2(C);
  HostTensor k2(acc, cs), k0(acc, cs), dx(t, xs), dx2(t, xs);
  fbn::kernels::BackwardTraining(t, g, dy.data(), x.data(), k_mean.data(), inv.data(), k1.data(),
                                 k2.data(), k0.data(), s_dy.data(), s_dyxc.data(), dx.data());
  fbn::kernels::BackwardReduce(t, g, dy.data(), x.data(), k_mean.data(), s_dy2.data(),
                               s_dyxc2.data());
  EXPECT_TRUE(SameDoubles(s_dy, s_dy2)) << "sum dy";
  EXPECT_TRUE(SameDoubles(s_dyxc, s_dyxc2)) << "sum dy(x - m)";
  fbn::kernels::BackwardApply(t, g, dy.data(), x.data(), k_mean.data(), k1.data(), k2.data(),
                              k0.data(), dx2.data());
  EXPECT_TRUE(dx.BytesEqual(dx2)) << "dx";
}

// Per image, the (rows x cols) planes transposed: NCHW <-> NHWC for rows = C, cols = S.
HostTensor TransposeImages(const HostTensor& t, int64_t images, int64_t rows, int64_t cols) {
  HostTensor out(t.dtype(), t.shape());
  for (int64_t n = 0; n < images; ++n) {
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j) {
        out.Set((n * cols + j) * rows + i, t.Get((n * rows + i) * cols + j));
      }
    }
  }
  return out;
}

// Tensors whose inner dimension is short (channels-first planes of 1-15 elements, channels-last
// rows of 1-15 channels) run the other layout's kernels on transposed copies (or, for a dimension
// of 1, on the same memory): every output must be that of the other layout's call on transposed
// tensors, bit for bit. A wrong copy or stride shows here.
class SwappedLayoutTest : public ::testing::TestWithParam<std::tuple<DataType, int>> {};

const Geometry kShortInner[] = {
    {false, 1, 64, 4},  {false, 3, 37, 4},   {false, 2, 19, 9}, {false, 5, 20, 15},
    {false, 9, 37, 1},  {false, 2, 1030, 2}, {true, 2, 3, 64},  {true, 8, 1, 100},
    {true, 1, 4, 1000}, {true, 3, 4, 40},
};

TEST_P(SwappedLayoutTest, MatchOtherLayoutOfTransposedTensors) {
  const auto [t, k] = GetParam();
  const Geometry& g = kShortInner[k];
  Geometry other = g;
  other.channels_last = !g.channels_last;
  // Per image, g's layout is a rows x cols matrix (C x S channels-first).
  const int64_t rows = g.channels_last ? g.s : g.c, cols = g.channels_last ? g.c : g.s;
  const DataType acc = StatsType(t);
  std::mt19937 rng(11);
  const Shape xs{g.elements()}, cs{g.c};
  const HostTensor x = RandomTensor(t, xs, -2.0, 3.0, &rng);
  const HostTensor dy = RandomTensor(t, xs, -1.0, 1.0, &rng);
  const HostTensor xt = TransposeImages(x, g.n, rows, cols);
  const HostTensor dyt = TransposeImages(dy, g.n, rows, cols);
  const HostTensor scale = RandomTensor(acc, cs, 0.5, 1.5, &rng);
  const HostTensor offset = RandomTensor(acc, cs, -0.5, 0.5, &rng);
  const HostTensor k1 = RandomTensor(acc, cs, 0.5, 1.5, &rng);
  const size_t C = static_cast<size_t>(g.c);
  std::vector<double> inv(C, 0.75);
  const auto back = [&](const HostTensor& v) { return TransposeImages(v, g.n, cols, rows); };

  std::vector<double> mean(C), var(C), mean2(C), var2(C);
  HostTensor km(acc, cs), ka(acc, cs), kb(acc, cs), y(t, xs);
  HostTensor km2(acc, cs), ka2(acc, cs), kb2(acc, cs), y2(t, xs);
  fbn::kernels::ForwardTraining(t, g, x.data(), scale.data(), offset.data(), 1e-3, mean.data(),
                                var.data(), km.data(), ka.data(), kb.data(), y.data());
  fbn::kernels::ForwardTraining(t, other, xt.data(), scale.data(), offset.data(), 1e-3,
                                mean2.data(), var2.data(), km2.data(), ka2.data(), kb2.data(),
                                y2.data());
  EXPECT_TRUE(SameDoubles(mean, mean2)) << "mean";
  EXPECT_TRUE(SameDoubles(var, var2)) << "variance";
  EXPECT_TRUE(y.BytesEqual(back(y2))) << "training y";
  fbn::kernels::Apply(t, g, x.data(), km.data(), ka.data(), kb.data(), y.data());
  fbn::kernels::Apply(t, other, xt.data(), km.data(), ka.data(), kb.data(), y2.data());
  EXPECT_TRUE(y.BytesEqual(back(y2))) << "inference y";

  std::vector<double> s_dy(C), s_dyxc(C), s_dy2(C), s_dyxc2(C);
  HostTensor k2(acc, cs), k0(acc, cs), dx(t, xs), k2b(acc, cs), k0b(acc, cs), dx2(t, xs);
  fbn::kernels::BackwardTraining(t, g, dy.data(), x.data(), km.data(), inv.data(), k1.data(),
                                 k2.data(), k0.data(), s_dy.data(), s_dyxc.data(), dx.data());
  fbn::kernels::BackwardTraining(t, other, dyt.data(), xt.data(), km.data(), inv.data(), k1.data(),
                                 k2b.data(), k0b.data(), s_dy2.data(), s_dyxc2.data(), dx2.data());
  EXPECT_TRUE(SameDoubles(s_dy, s_dy2)) << "training sum dy";
  EXPECT_TRUE(SameDoubles(s_dyxc, s_dyxc2)) << "training sum dy(x - m)";
  EXPECT_TRUE(dx.BytesEqual(back(dx2))) << "training dx";
  fbn::kernels::FrozenBackward(t, g, dy.data(), x.data(), km.data(), k1.data(), dx.data(),
                               s_dy.data(), s_dyxc.data());
  fbn::kernels::FrozenBackward(t, other, dyt.data(), xt.data(), km.data(), k1.data(), dx2.data(),
                               s_dy2.data(), s_dyxc2.data());
  EXPECT_TRUE(SameDoubles(s_dy, s_dy2)) << "frozen sum dy";
  EXPECT_TRUE(SameDoubles(s_dyxc, s_dyxc2)) << "frozen sum dy(x - m)";
  EXPECT_TRUE(dx.BytesEqual(back(dx2))) << "frozen dx";
}

// Channels-last reductions adapt to where their rows come from (RowRead): statistics of rows of
// 4 KB multiples read from DRAM take short blocks, and rows from beyond L2 wider strips (AVX-512).
// Every hint must give each channel's mean and centred sum of squares to within float rounding of
// a float64 two-pass reference, also for a mean far from zero and a partial last block; hints that
// change only the strip width or the prefetching must give the same bits.
TEST(RowStatsTest, EveryReadHintMatchesFloat64Reference) {
  using fbn::kernels::RowRead;
  for (DataType t : {DataType::kFloat32, DataType::kBFloat16}) {
    const int64_t C = t == DataType::kFloat32 ? 1024 : 2048;  // 4 KB rows
    const int64_t rows = 203;
    std::mt19937 rng(9);
    const HostTensor x = RandomTensor(t, Shape{rows * C}, 99.0, 101.0, &rng);
    std::vector<double> ref_mean(C, 0.0), ref_m2(C, 0.0);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < C; ++c) ref_mean[c] += x.Get(r * C + c);
    }
    for (int64_t c = 0; c < C; ++c) ref_mean[c] /= static_cast<double>(rows);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < C; ++c) {
        const double d = x.Get(r * C + c) - ref_mean[c];
        ref_m2[c] += d * d;
      }
    }
    const auto& entry = fbn::kernels::ActiveKernels().entries[static_cast<int>(t)];
    std::vector<std::vector<double>> results;
    for (RowRead read :
         {RowRead::kL2, RowRead::kL3, RowRead::kDram, RowRead::kPrefetch, RowRead::kFlushed}) {
      SCOPED_TRACE(DTypeTag(t) + " read hint " + std::to_string(static_cast<int>(read)));
      std::vector<double> mean(C), m2(C), tmp(3 * C);
      entry.stats_rows(x.data(), C, 0, C, 0, rows, mean.data(), m2.data(), tmp.data(), read);
      results.push_back(mean);
      results.push_back(m2);
      int bad = 0;
      for (int64_t c = 0; c < C; ++c) {
        const bool ok = std::abs(mean[c] - ref_mean[c]) <= 2e-5 &&
                        std::abs(m2[c] - ref_m2[c]) <= 1e-4 * ref_m2[c];
        if (!ok && ++bad <= 3) {
          ADD_FAILURE() << "channel " << c << ": mean " << mean[c] << " vs " << ref_mean[c]
                        << ", M2 " << m2[c] << " vs " << ref_m2[c];
        }
      }
      EXPECT_EQ(bad, 0);
    }
    // Strip widths (kL2 and kL3), prefetching (kDram and kPrefetch) and a first pass in row order
    // (float kFlushed) change no bits.
    EXPECT_TRUE(SameDoubles(results[0], results[2]) && SameDoubles(results[1], results[3]))
        << DTypeTag(t) << ": kL2 and kL3 statistics differ";
    EXPECT_TRUE(SameDoubles(results[4], results[6]) && SameDoubles(results[5], results[7]))
        << DTypeTag(t) << ": kDram and kPrefetch statistics differ";
    EXPECT_TRUE(SameDoubles(results[0], results[8]) && SameDoubles(results[1], results[9]))
        << DTypeTag(t) << ": kL2 and kFlushed statistics differ";
  }
}

// Rows that are not 4 KB multiples take the same blocks for every hint, so every hint, whether
// its first pass takes strips or rows in order (RowMean), gives the same bits: for every dtype,
// whole rows and a channel range that starts and ends off a vector (masked strips, scalar tail).
TEST(RowStatsTest, StatisticsSameForEveryReadHint) {
  using fbn::kernels::RowRead;
  const RowRead reads[] = {RowRead::kL2, RowRead::kL3, RowRead::kDram, RowRead::kPrefetch,
                           RowRead::kFlushed};
  for (DataType t :
       {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16, DataType::kBFloat16}) {
    const int64_t C = 200, rows = 150;  // blocks of 64, 64 and 22 rows
    std::mt19937 rng(17);
    const HostTensor x = RandomTensor(t, Shape{rows * C}, -3.0, 5.0, &rng);
    const auto& entry = fbn::kernels::ActiveKernels().entries[static_cast<int>(t)];
    for (const auto& [c0, c1] : {std::pair<int64_t, int64_t>{0, C}, {5, C - 3}}) {
      std::vector<double> ref_mean, ref_m2;
      for (RowRead read : reads) {
        SCOPED_TRACE(DTypeTag(t) + " channels [" + std::to_string(c0) + ", " + std::to_string(c1) +
                     ") read hint " + std::to_string(static_cast<int>(read)));
        std::vector<double> mean(C, -1.0), m2(C, -1.0), tmp(3 * C);
        entry.stats_rows(x.data(), C, c0, c1, 0, rows, mean.data(), m2.data(), tmp.data(), read);
        for (int64_t c = c0; c < c1; c += 37) {
          double sum = 0.0, sq = 0.0;
          for (int64_t r = 0; r < rows; ++r) sum += x.Get(r * C + c);
          const double m = sum / static_cast<double>(rows);
          for (int64_t r = 0; r < rows; ++r) sq += (x.Get(r * C + c) - m) * (x.Get(r * C + c) - m);
          EXPECT_NEAR(mean[c], m, 1e-5) << "channel " << c;
          EXPECT_NEAR(m2[c], sq, 1e-5 * sq) << "channel " << c;
        }
        const std::vector<double> range_mean(mean.begin() + c0, mean.begin() + c1);
        const std::vector<double> range_m2(m2.begin() + c0, m2.begin() + c1);
        if (ref_mean.empty()) {
          ref_mean = range_mean;
          ref_m2 = range_m2;
        } else {
          EXPECT_TRUE(SameDoubles(ref_mean, range_mean) && SameDoubles(ref_m2, range_m2))
              << "statistics differ from kL2's";
        }
      }
    }
  }
}

// Random inputs of a channels-last gradient reduction: rows x C of x and dy, and a mean and k1
// per channel, drawn in that order from one generator.
struct GradientInputs {
  GradientInputs(DataType t, int64_t rows, int64_t C, unsigned seed)
      : rng(seed),
        x(RandomTensor(t, Shape{rows * C}, -2.0, 3.0, &rng)),
        dy(RandomTensor(t, Shape{rows * C}, -1.0, 1.0, &rng)),
        mean(RandomTensor(StatsType(t), Shape{C}, -0.5, 0.5, &rng)),
        k1(RandomTensor(StatsType(t), Shape{C}, 0.5, 1.5, &rng)) {}
  std::mt19937 rng;
  HostTensor x, dy, mean, k1;
};

// The gradient sums take wider strips from beyond L2 too, and the sums alone of flushed rows
// over 128 channels a row-order sweep (bfloat16: in pairs where the range is whole pairs, 256):
// the same bits either way, with and without dx written in the same sweep (the frozen gradient).
TEST(RowStatsTest, GradientSumsSameForEveryReadHint) {
  using fbn::kernels::RowRead;
  for (DataType t : {DataType::kFloat32, DataType::kBFloat16}) {
    // 200: 12.5 vectors of float: wide, narrow and masked strips.
    for (const int64_t C : {200, 256, 64}) {
      SCOPED_TRACE("C " + std::to_string(C));
      const int64_t rows = 150;
      const GradientInputs in(t, rows, C, 13);
      const HostTensor &x = in.x, &dy = in.dy, &mean = in.mean, &k1 = in.k1;
      const auto& entry = fbn::kernels::ActiveKernels().entries[static_cast<int>(t)];
      for (bool frozen : {false, true}) {
        SCOPED_TRACE(DTypeTag(t) + (frozen ? " frozen" : " sums only"));
        // Rows [0, r1) of `rows`: the prefetching hints also fetch rows past r1 (the next task's).
        const int64_t r1 = rows - 70;
        const RowRead reads[] = {RowRead::kL2, RowRead::kL3, RowRead::kPrefetch, RowRead::kFlushed};
        std::vector<double> s_dy[4], s_dyxc[4];
        std::vector<HostTensor> dx;
        for (int i = 0; i < 4; ++i) {
          SCOPED_TRACE("read hint " + std::to_string(static_cast<int>(reads[i])));
          std::vector<double> tmp(2 * C);
          s_dy[i].resize(C);
          s_dyxc[i].resize(C);
          dx.emplace_back(t, Shape{rows * C});
          dx[i].FillBytes(0);
          entry.reduce_rows(dy.data(), x.data(), C, 0, C, 0, r1, rows, mean.data(), s_dy[i].data(),
                            s_dyxc[i].data(), frozen ? k1.data() : nullptr,
                            frozen ? dx[i].data() : nullptr, tmp.data(), false, reads[i]);
          if (i == 0) continue;
          EXPECT_TRUE(SameDoubles(s_dy[0], s_dy[i])) << "sum dy";
          EXPECT_TRUE(SameDoubles(s_dyxc[0], s_dyxc[i])) << "sum dy(x - m)";
          EXPECT_TRUE(dx[0].BytesEqual(dx[i])) << "dx";
        }
        // And the sums are the sums.
        for (int64_t c = 0; c < C; c += 37) {
          double ref = 0;
          for (int64_t r = 0; r < r1; ++r) ref += dy.Get(r * C + c);
          EXPECT_NEAR(s_dy[0][c], ref, 1e-4) << "channel " << c;
        }
      }
    }
  }
}

// The frozen gradient's streamed dx: row-order sweeps (kL2, and kDram over 128 channels: C 256
// and 2048; bfloat16 sweeps pairs there, two rows at a time for 2048, with an odd last row)
// and strips (kL3, kFlushed, and kDram on narrow rows: C 80 and 48;
// bfloat16 streams there only in whole aligned pairs, 256 channels, else stores regularly) give the
// bits of the regular-store strips. dx is 64-byte aligned, so the streaming stores do run.
TEST(RowStatsTest, FrozenGradientStreamedSameAsStored) {
  for (DataType t : {DataType::kFloat32, DataType::kBFloat16}) {
    for (int64_t C : {256, 80, 48, 2048}) {
      SCOPED_TRACE(DTypeTag(t) + " C " + std::to_string(C));
      const int64_t rows = 151;
      const GradientInputs in(t, rows, C, 17);
      const HostTensor &x = in.x, &dy = in.dy, &mean = in.mean, &k1 = in.k1;
      const auto& entry = fbn::kernels::ActiveKernels().entries[static_cast<int>(t)];
      const size_t bytes = static_cast<size_t>(rows * C) * fbn::DataTypeSize(t);
      std::vector<unsigned char> want;
      std::vector<double> want_dy, want_dyxc;
      int run = 0;
      for (const auto& [read, stream] : kStoreRuns) {
        SCOPED_TRACE("run " + std::to_string(run++));
        AlignedOutput dx(bytes);
        std::vector<double> tmp(2 * C), s_dy(C), s_dyxc(C);
        entry.reduce_rows(dy.data(), x.data(), C, 0, C, 0, rows, rows, mean.data(), s_dy.data(),
                          s_dyxc.data(), k1.data(), dx.data(), tmp.data(), stream, read);
        if (want.empty()) {
          want = dx.Bytes();
          want_dy = s_dy;
          want_dyxc = s_dyxc;
          continue;
        }
        EXPECT_TRUE(dx.Bytes() == want) << "dx";
        EXPECT_TRUE(SameDoubles(s_dy, want_dy)) << "sum dy";
        EXPECT_TRUE(SameDoubles(s_dyxc, want_dyxc)) << "sum dy(x - m)";
      }
    }
  }
}

// The channels-last apply, streamed or not, from every level: row order (kL2, kDram), bfloat16
// strips from L3 (whole aligned pairs streamed, 256 channels; else regular stores), the same
// bits as the regular-store strips.
TEST(RowStatsTest, ApplyStreamedSameAsStored) {
  for (DataType t : {DataType::kFloat32, DataType::kBFloat16}) {
    // 1024: float rows of 4 KB are stored in row order and streamed in strips.
    for (int64_t C : {256, 80, 48, 1024}) {
      SCOPED_TRACE(DTypeTag(t) + " C " + std::to_string(C));
      const int64_t rows = 150;
      std::mt19937 rng(19);
      const HostTensor x = RandomTensor(t, Shape{rows * C}, -2.0, 3.0, &rng);
      const HostTensor mean = RandomTensor(StatsType(t), Shape{C}, -0.5, 0.5, &rng);
      const HostTensor a = RandomTensor(StatsType(t), Shape{C}, 0.5, 1.5, &rng);
      const HostTensor b = RandomTensor(StatsType(t), Shape{C}, -1.0, 1.0, &rng);
      const auto& entry = fbn::kernels::ActiveKernels().entries[static_cast<int>(t)];
      const size_t bytes = static_cast<size_t>(rows * C) * fbn::DataTypeSize(t);
      std::vector<unsigned char> want;
      int run = 0;
      for (const auto& [read, stream] : kStoreRuns) {
        SCOPED_TRACE("run " + std::to_string(run++));
        AlignedOutput y(bytes);
        entry.apply_rows(x.data(), C, 0, C, 0, rows, mean.data(), a.data(), b.data(), y.data(),
                         stream, read);
        if (want.empty()) {
          want = y.Bytes();
          continue;
        }
        EXPECT_TRUE(y.Bytes() == want) << "y";
      }
    }
  }
}

// Outputs that start past a cache line (std::vector and NumPy place large buffers 16 bytes past
// one) stream from their first aligned element with the rows' channel phase shifted
// (StreamShiftedRows): the apply, the backward apply and the frozen gradient's dx give the bits of
// the aligned regular-store strips, for rows of one vector (48), of several (256, 512) and wider
// than a page (2048, tiled), a row range that starts and ends inside the buffer (its first and
// last elements written one by one), and elements outside the range left untouched. bfloat16
// streams whole pairs shifted (StreamShiftedPairs), odd element offsets included.
TEST(RowStatsTest, MisalignedOutputsStreamedSameAsAligned) {
  for (DataType t : {DataType::kFloat32, DataType::kFloat64, DataType::kBFloat16}) {
    const size_t es = fbn::DataTypeSize(t);
    for (int64_t C : {48, 256, 512, 2048}) {
      const int64_t rows = 37, r0 = 3, r1 = 35;
      std::mt19937 rng(23);
      const HostTensor x = RandomTensor(t, Shape{rows * C}, -2.0, 3.0, &rng);
      const HostTensor dy = RandomTensor(t, Shape{rows * C}, -1.0, 1.0, &rng);
      HostTensor k[4];
      for (HostTensor& v : k) v = RandomTensor(StatsType(t), Shape{C}, -0.5, 1.5, &rng);
      const auto& entry = fbn::kernels::ActiveKernels().entries[static_cast<int>(t)];
      const size_t bytes = static_cast<size_t>(rows * C) * es;
      // kind 0: apply, 1: backward apply, 2: frozen gradient (sums and dx).
      for (int kind = 0; kind < 3; ++kind) {
        std::vector<unsigned char> want;
        std::vector<double> want_sums;
        for (size_t offset : {size_t{0}, es, 2 * es, size_t{16}, 64 - es}) {
          for (bool stream : {false, true}) {
            SCOPED_TRACE(DTypeTag(t) + " C " + std::to_string(C) + " kind " + std::to_string(kind) +
                         " offset " + std::to_string(offset) + (stream ? " streamed" : " stored"));
            AlignedOutput out(bytes, offset);
            std::vector<double> sums(2 * C), tmp(2 * C);
            const auto read = fbn::kernels::RowRead::kDram;
            if (kind == 0) {
              entry.apply_rows(x.data(), C, 0, C, r0, r1, k[0].data(), k[1].data(), k[2].data(),
                               out.data(), stream, read);
            } else if (kind == 1) {
              entry.backward_apply_rows(dy.data(), x.data(), C, 0, C, r0, r1, k[0].data(),
                                        k[1].data(), k[2].data(), k[3].data(), out.data(), stream);
            } else {
              entry.reduce_rows(dy.data(), x.data(), C, 0, C, r0, r1, rows, k[0].data(),
                                sums.data(), sums.data() + C, k[1].data(), out.data(), tmp.data(),
                                stream, read);
            }
            if (want.empty()) {
              want = out.Bytes();
              want_sums = sums;
              continue;
            }
            EXPECT_TRUE(out.Bytes() == want);
            EXPECT_TRUE(SameDoubles(sums, want_sums));
          }
        }
      }
    }
  }
}

// The image-order channels-first kernels (memory order, a block per plane): statistics and
// gradient sums of a channel range over an image range within float rounding of a float64
// two-pass reference, for a mean far from zero, planes read four channels at a time (7x7) and
// one at a time, and a range that ends in a tail; channels outside the range untouched.
TEST(ImageOrderTest, StatisticsAndSumsMatchFloat64Reference) {
  for (DataType t :
       {DataType::kFloat32, DataType::kBFloat16, DataType::kFloat16, DataType::kFloat64}) {
    for (int64_t S : {49, 196, 1225}) {
      SCOPED_TRACE(DTypeTag(t) + " S " + std::to_string(S));
      const int64_t C = 11, images = 5, c0 = 2, c1 = C, n0 = 1, n1 = images;
      const int64_t E = images * C * S;
      std::mt19937 rng(31);
      const HostTensor x = RandomTensor(t, Shape{E}, 99.0, 101.0, &rng);
      const HostTensor dy = RandomTensor(t, Shape{E}, -1.0, 1.0, &rng);
      std::vector<double> ref_mean(C, 0.0), ref_m2(C, 0.0), ref_dy(C, 0.0), ref_dyxc(C, 0.0);
      std::vector<double> abs_dy(C, 0.0), abs_dyxc(C, 0.0);
      const double count = static_cast<double>((n1 - n0) * S);
      const auto at = [&](int64_t n, int64_t c, int64_t i) { return (n * C + c) * S + i; };
      for (int64_t c = c0; c < c1; ++c) {
        for (int64_t n = n0; n < n1; ++n) {
          for (int64_t i = 0; i < S; ++i) ref_mean[c] += x.Get(at(n, c, i));
        }
        ref_mean[c] /= count;
      }
      // The sums take the mean in the accumulation type, as the kernels get it.
      HostTensor mean(StatsType(t), Shape{C});
      for (int64_t c = 0; c < C; ++c) mean.Set(c, ref_mean[c]);
      for (int64_t c = c0; c < c1; ++c) {
        for (int64_t n = n0; n < n1; ++n) {
          for (int64_t i = 0; i < S; ++i) {
            const double d = x.Get(at(n, c, i)) - ref_mean[c];
            const double g = dy.Get(at(n, c, i));
            const double xc = x.Get(at(n, c, i)) - mean.Get(c);
            ref_m2[c] += d * d;
            ref_dy[c] += g;
            ref_dyxc[c] += g * xc;
            abs_dy[c] += std::abs(g);
            abs_dyxc[c] += std::abs(g * xc);
          }
        }
      }
      const auto& entry = fbn::kernels::ActiveKernels().entries[static_cast<int>(t)];
      constexpr double kUntouched = -7.0;
      std::vector<double> m(C, kUntouched), m2(C, kUntouched), sdy(C, kUntouched),
          sdyxc(C, kUntouched);
      entry.stats_images(x.data(), C, S, c0, c1, n0, n1, m.data(), m2.data());
      entry.reduce_images(dy.data(), x.data(), C, S, c0, c1, n0, n1, mean.data(), sdy.data(),
                          sdyxc.data(), nullptr, nullptr, false);
      int bad = 0;
      for (int64_t c = 0; c < C; ++c) {
        if (c < c0) {
          EXPECT_TRUE(m[c] == kUntouched && m2[c] == kUntouched && sdy[c] == kUntouched &&
                      sdyxc[c] == kUntouched)
              << "channel " << c << " outside the range was written";
          continue;
        }
        const bool ok = std::abs(m[c] - ref_mean[c]) <= 2e-5 &&
                        std::abs(m2[c] - ref_m2[c]) <= 1e-4 * ref_m2[c] &&
                        std::abs(sdy[c] - ref_dy[c]) <= 1e-5 * abs_dy[c] &&
                        std::abs(sdyxc[c] - ref_dyxc[c]) <= 1e-5 * abs_dyxc[c];
        if (!ok && ++bad <= 3) {
          ADD_FAILURE() << "channel " << c << ": mean " << m[c] << " vs " << ref_mean[c] << ", M2 "
                        << m2[c] << " vs " << ref_m2[c] << ", sum dy " << sdy[c] << " vs "
                        << ref_dy[c] << ", sum dy(x - m) " << sdyxc[c] << " vs " << ref_dyxc[c];
        }
      }
      EXPECT_EQ(bad, 0);
    }
  }
}

// The channels-first elementwise passes, streamed over ranges that start and end mid-plane and
// mid-vector: across plane boundaries where planes are not whole vectors (17 .. 289 elements),
// plane by plane otherwise (64, and 4099, over the crossing limit). The same bits as one
// regular-store call over the whole tensor.
TEST(FlatPassesTest, StreamedSameAsStored) {
  for (DataType t :
       {DataType::kFloat32, DataType::kBFloat16, DataType::kFloat16, DataType::kFloat64}) {
    for (int64_t S : {17, 49, 50, 64, 196, 289, 4099}) {
      SCOPED_TRACE(DTypeTag(t) + " S " + std::to_string(S));
      const int64_t C = 7, E = 3 * C * S;
      std::mt19937 rng(23);
      const HostTensor x = RandomTensor(t, Shape{E}, -2.0, 3.0, &rng);
      const HostTensor dy = RandomTensor(t, Shape{E}, -1.0, 1.0, &rng);
      std::vector<HostTensor> k;
      for (int i = 0; i < 4; ++i)
        k.push_back(RandomTensor(StatsType(t), Shape{C}, -1.5, 1.5, &rng));
      const auto& entry = fbn::kernels::ActiveKernels().entries[static_cast<int>(t)];
      const size_t bytes = static_cast<size_t>(E) * fbn::DataTypeSize(t);
      const auto forward = [&](AlignedOutput& y, int64_t f0, int64_t f1, bool stream) {
        entry.apply_flat(x.data(), C, S, f0, f1, k[0].data(), k[1].data(), k[2].data(), y.data(),
                         stream);
      };
      const auto backward = [&](AlignedOutput& dx, int64_t f0, int64_t f1, bool stream) {
        entry.backward_apply_flat(dy.data(), x.data(), C, S, f0, f1, k[0].data(), k[1].data(),
                                  k[2].data(), k[3].data(), dx.data(), stream);
      };
      const std::vector<std::vector<int64_t>> splits = {
          {0, E}, {0, 13, S + 1, 2 * C * S - 5, E - 3, E}, {0, E / 2 + 7, E}};
      for (int pass = 0; pass < 2; ++pass) {
        SCOPED_TRACE(pass == 0 ? "forward" : "backward");
        const auto run = [&](AlignedOutput& out, int64_t f0, int64_t f1, bool stream) {
          pass == 0 ? forward(out, f0, f1, stream) : backward(out, f0, f1, stream);
        };
        AlignedOutput stored(bytes);
        run(stored, 0, E, false);
        for (size_t i = 0; i < splits.size(); ++i) {
          SCOPED_TRACE("split " + std::to_string(i));
          AlignedOutput streamed(bytes);
          for (size_t r = 0; r + 1 < splits[i].size(); ++r) {
            run(streamed, splits[i][r], splits[i][r + 1], true);
          }
          EXPECT_TRUE(streamed.Bytes() == stored.Bytes());
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, SwappedLayoutTest,
    ::testing::Combine(::testing::Values(DataType::kFloat32, DataType::kBFloat16,
                                         DataType::kFloat16, DataType::kFloat64),
                       ::testing::Range(0, static_cast<int>(std::size(kShortInner)))),
    [](const ::testing::TestParamInfo<std::tuple<DataType, int>>& p) {
      const Geometry& g = kShortInner[std::get<1>(p.param)];
      return DTypeTag(std::get<0>(p.param)) + (g.channels_last ? "_nhwc_" : "_nchw_") +
             std::to_string(g.n) + "x" + std::to_string(g.c) + "x" + std::to_string(g.s);
    });

INSTANTIATE_TEST_SUITE_P(
    All, KernelPathsTest,
    ::testing::Combine(::testing::Values(DataType::kFloat32, DataType::kBFloat16,
                                         DataType::kFloat16, DataType::kFloat64),
                       ::testing::Range(0, static_cast<int>(std::size(kCases)))),
    [](const ::testing::TestParamInfo<std::tuple<DataType, int>>& p) {
      return DTypeTag(std::get<0>(p.param)) + "_" + kCases[std::get<1>(p.param)].name;
    });

}  // namespace
}  // namespace fbn_test
