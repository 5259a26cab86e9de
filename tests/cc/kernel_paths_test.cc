// The fused kernel paths (statistics and rewrite in one parallel region, or one channel at a time
// by all threads) reorder work, never arithmetic: their outputs must be bit-identical to the
// separate passes (ComputeStats then Apply, BackwardReduce then BackwardApply) on the same
// coefficients, for shapes that take each path.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "fbn/fbn.h"
#include "kernels/batch_norm_kernels.h"
#include "test_util.h"

namespace fbn_test {
namespace {

using fbn::DataType;
using fbn::Shape;
using fbn::kernels::Geometry;

bool SameDoubles(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

struct PathCase {
  const char* name;
  Geometry g;
};

// Channels-first channels of 1.08M elements: over one task (2 MB) for every dtype, so forward
// (x) and backward (x and dy) take the channel-at-a-time path; small channels the per-task fused
// path; channels-last short rows the channel-group path; long rows the separate passes.
const PathCase kCases[] = {
    {"nchw_split_channels", {false, 2, 3, 540000}},
    {"nchw_fused_tasks", {false, 16, 37, 49}},
    {"nhwc_channel_groups", {true, 1, 2051, 49}},
    {"nhwc_rows", {true, 8, 40, 1500}},
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
