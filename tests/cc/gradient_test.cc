// FusedBatchNormGrad against central finite differences of FusedBatchNorm, in float64: the
// gradient op must be the derivative of the forward op (training: through the batch statistics;
// inference: with the given statistics fixed), for every layout.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "fbn/fbn.h"
#include "test_util.h"

namespace fbn_test {
namespace {

using fbn::DataType;
using fbn::OpVersion;
using fbn::Shape;
using fbn::TensorFormat;

// A comparatively large epsilon and a small spread of x make epsilon matter in the derivative.
constexpr float kEpsilon = 0.01f;
// Central differences: truncation error ~h²·|f'''| and cancellation ~1e-16·|L|/h; h = 1e-5 keeps
// both near 1e-10 for these O(1) values, far inside the tolerance.
constexpr double kStep = 1e-5;
constexpr double kTolerance = 1e-6;

using Param = std::tuple<TensorFormat, int64_t, bool>;  // format, C, is_training

class FiniteDifferenceTest : public ::testing::TestWithParam<Param> {};

// L = Σ w·y for the forward op at (x, scale, offset).
double Loss(const ForwardIO& base, const HostTensor& x, const HostTensor& scale,
            const HostTensor& offset, const HostTensor& w, const fbn::FusedBatchNormAttrs& attrs) {
  ForwardIO io = base;
  io.x = x;
  io.scale = scale;
  io.offset = offset;
  const fbn::Status s = fbn::FusedBatchNorm(OpVersion::kV3, io.Inputs(), attrs, io.Outputs());
  EXPECT_TRUE(s.ok()) << s.ToString();
  double loss = 0;
  for (int64_t i = 0; i < w.size(); ++i) loss += w.Get(i) * io.y.Get(i);
  return loss;
}

// dL/dv[i] by central differences, where v is one of x, scale, offset of `io`.
double Numeric(const ForwardIO& io, int which, int64_t i, const HostTensor& w,
               const fbn::FusedBatchNormAttrs& attrs) {
  HostTensor plus[3] = {io.x, io.scale, io.offset};
  HostTensor minus[3] = {io.x, io.scale, io.offset};
  const double v = plus[which].Get(i);
  plus[which].Set(i, v + kStep);
  minus[which].Set(i, v - kStep);
  return (Loss(io, plus[0], plus[1], plus[2], w, attrs) -
          Loss(io, minus[0], minus[1], minus[2], w, attrs)) /
         (2 * kStep);
}

TEST_P(FiniteDifferenceTest, GradientMatchesForward) {
  const auto [format, C, training] = GetParam();
  const std::vector<int64_t> spatial =
      Is5D(format) ? std::vector<int64_t>{2, 1, 3} : std::vector<int64_t>{3, 2};
  const Shape xs = MakeShape(format, 2, C, spatial);
  std::mt19937 rng(static_cast<uint32_t>(31 * static_cast<int>(format) + C + (training ? 7 : 0)));
  const RefLayout l = LayoutOf(xs, format);

  ForwardIO io;
  io.x = HostTensor(DataType::kFloat64, xs);
  {
    std::uniform_real_distribution<double> centre(-1, 1), u(-0.3, 0.3);
    std::vector<double> cen(C);
    for (double& c : cen) c = centre(rng);
    for (int64_t i = 0; i < io.x.size(); ++i) io.x.Set(i, cen[l.ChannelOf(i)] + u(rng));
  }
  io.scale = RandomTensor(DataType::kFloat64, Shape{C}, -2, 2, &rng);
  io.offset = RandomTensor(DataType::kFloat64, Shape{C}, -1, 1, &rng);
  io.mean = RandomTensor(DataType::kFloat64, Shape{C}, -1, 1, &rng);
  io.variance = RandomTensor(DataType::kFloat64, Shape{C}, 0.02, 0.1, &rng);
  fbn::FusedBatchNormAttrs attrs;
  attrs.epsilon = kEpsilon;
  attrs.data_format = format;
  attrs.is_training = training;
  ASSERT_NO_FATAL_FAILURE(io.AllocateOutputs(OpVersion::kV3, attrs));
  ASSERT_TRUE(fbn::FusedBatchNorm(OpVersion::kV3, io.Inputs(), attrs, io.Outputs()).ok());
  const HostTensor w = RandomTensor(DataType::kFloat64, xs, -1, 1, &rng);

  // The gradient op gets what TensorFlow's gradient function passes: the forward's reserve
  // spaces in training, the population statistics (forward inputs 3, 4) in inference.
  GradIO g;
  g.dy = w;
  g.x = io.x;
  g.scale = io.scale;
  g.rs1 = training ? io.rs1 : io.mean;
  g.rs2 = training ? io.rs2 : io.variance;
  g.rs3 = io.rs3;
  fbn::FusedBatchNormGradAttrs gattrs;
  gattrs.epsilon = kEpsilon;
  gattrs.data_format = format;
  gattrs.is_training = training;
  ASSERT_NO_FATAL_FAILURE(g.AllocateOutputs(OpVersion::kV3, gattrs));
  const fbn::Status s = fbn::FusedBatchNormGrad(OpVersion::kV3, g.Inputs(), gattrs, g.Outputs());
  ASSERT_TRUE(s.ok()) << s.ToString();

  const HostTensor* analytic[3] = {&g.dx, &g.dscale, &g.doffset};
  const char* names[3] = {"dx", "dscale", "doffset"};
  for (int which = 0; which < 3; ++which) {
    for (int64_t i = 0; i < analytic[which]->size(); ++i) {
      const double want = Numeric(io, which, i, w, attrs);
      const double got = analytic[which]->Get(i);
      EXPECT_NEAR(got, want, kTolerance * (1 + std::fabs(want))) << names[which] << "[" << i << "]";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, FiniteDifferenceTest,
    ::testing::Combine(::testing::Values(TensorFormat::kNHWC, TensorFormat::kNCHW,
                                         TensorFormat::kNDHWC, TensorFormat::kNCDHW),
                       ::testing::Values(int64_t{1}, int64_t{3}), ::testing::Bool()),
    [](const ::testing::TestParamInfo<Param>& p) {
      return FormatTag(std::get<0>(p.param)) + "_C" + std::to_string(std::get<1>(p.param)) +
             (std::get<2>(p.param) ? "_training" : "_inference");
    });

// With scale 1, offset 0 and eps 0, y is x standardized per channel, so L = Σy²/2 = n·C/2 whatever
// x is, and the training dx for dy = y must vanish. A gradient that ignored the batch statistics'
// dependence on x would give dx = y instead.
TEST(FiniteDifference, TrainingGradientOfNormalizedOutputVanishes) {
  for (TensorFormat format : {TensorFormat::kNHWC, TensorFormat::kNCHW}) {
    SCOPED_TRACE(FormatTag(format));
    const int64_t C = 4;
    const Shape xs = MakeShape(format, 3, C, {4, 5});
    std::mt19937 rng(77);
    ForwardIO io;
    io.x = RandomTensor(DataType::kFloat64, xs, -3, 3, &rng);
    io.scale = HostTensor(DataType::kFloat64, Shape{C});
    io.offset = HostTensor(DataType::kFloat64, Shape{C});
    for (int64_t c = 0; c < C; ++c) io.scale.Set(c, 1.0);
    io.mean = io.variance = HostTensor(DataType::kFloat64, Shape{0});
    fbn::FusedBatchNormAttrs attrs;
    attrs.epsilon = 0.0f;
    attrs.data_format = format;
    ASSERT_NO_FATAL_FAILURE(io.AllocateOutputs(OpVersion::kV3, attrs));
    ASSERT_TRUE(fbn::FusedBatchNorm(OpVersion::kV3, io.Inputs(), attrs, io.Outputs()).ok());
    // dL/dscale = Σ y·x̂ = Σ x̂² = n per channel.
    GradIO g;
    g.dy = io.y;
    g.x = io.x;
    g.scale = io.scale;
    g.rs1 = io.rs1;
    g.rs2 = io.rs2;
    g.rs3 = io.rs3;
    fbn::FusedBatchNormGradAttrs gattrs;
    gattrs.epsilon = 0.0f;
    gattrs.data_format = format;
    ASSERT_NO_FATAL_FAILURE(g.AllocateOutputs(OpVersion::kV3, gattrs));
    ASSERT_TRUE(fbn::FusedBatchNormGrad(OpVersion::kV3, g.Inputs(), gattrs, g.Outputs()).ok());
    for (int64_t i = 0; i < g.dx.size(); ++i) EXPECT_NEAR(g.dx.Get(i), 0.0, 1e-12) << i;
    const double n = static_cast<double>(xs.num_elements() / C);
    for (int64_t c = 0; c < C; ++c) EXPECT_NEAR(g.dscale.Get(c), n, 1e-10 * n) << c;
  }
}

}  // namespace
}  // namespace fbn_test
