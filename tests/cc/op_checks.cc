#include "op_checks.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>

namespace fbn_test {

using fbn::DataType;
using fbn::OpVersion;
using fbn::Shape;
using fbn::Status;
using fbn::TensorFormat;

HostTensor RandomX(DataType dtype, const Shape& shape, TensorFormat f, std::mt19937* rng) {
  const RefLayout l = LayoutOf(shape, f);
  const int64_t C = l.Channels();
  std::uniform_real_distribution<double> centre(-3.0, 3.0), spread(0.25, 2.0), u(-1.0, 1.0);
  std::vector<double> cen(C), spr(C);
  for (int64_t c = 0; c < C; ++c) {
    cen[c] = centre(*rng);
    spr[c] = spread(*rng);
  }
  HostTensor t(dtype, shape);
  for (int64_t i = 0; i < t.size(); ++i) {
    const int64_t c = l.ChannelOf(i);
    t.Set(i, cen[c] + spr[c] * u(*rng));
  }
  return t;
}

std::vector<double> MaxAbsPerChannel(const RefLayout& l, const std::vector<double>& x) {
  std::vector<double> m(static_cast<size_t>(l.Channels()), 0.0);
  for (int64_t i = 0; i < l.Elements(); ++i) {
    m[l.ChannelOf(i)] = std::max(m[l.ChannelOf(i)], std::fabs(x[i]));
  }
  return m;
}

std::vector<double> Abs(std::vector<double> v) {
  for (double& e : v) e = std::fabs(e);
  return v;
}

std::vector<double> YBound(const RefLayout& l, const std::vector<double>& x,
                           const std::vector<double>& scale, const std::vector<double>& offset,
                           const std::vector<double>& var) {
  const auto maxabs = MaxAbsPerChannel(l, x);
  std::vector<double> b(x.size());
  for (int64_t i = 0; i < l.Elements(); ++i) {
    const int64_t c = l.ChannelOf(i);
    const double a = std::fabs(scale[c]) / std::sqrt(var[c] + static_cast<double>(kEpsilon));
    b[i] = a * (std::fabs(x[i]) + maxabs[c]) + std::fabs(offset[c]);
  }
  return b;
}

void CheckForwardTraining(DataType dtype, TensorFormat format, const Shape& xs, uint32_t seed) {
  std::mt19937 rng(seed);
  const RefLayout l = LayoutOf(xs, format);
  const int64_t C = l.Channels();
  const DataType u = StatsType(dtype);
  const double rel = RelTolerance(u);
  for (const float factor : {1.0f, 0.6f}) {
    SCOPED_TRACE("exponential_avg_factor " + std::to_string(factor));
    ForwardIO io;
    io.x = RandomX(dtype, xs, format, &rng);
    io.scale = RandomTensor(u, Shape{C}, -1.5, 1.5, &rng);
    io.offset = RandomTensor(u, Shape{C}, -1, 1, &rng);
    // With factor 1 the running statistics are unused and usually empty (TensorFlow's usage).
    const Shape stats = factor == 1.0f ? Shape{0} : Shape{C};
    io.mean = RandomTensor(u, stats, -1, 1, &rng);
    io.variance = RandomTensor(u, stats, 0.5, 2, &rng);
    fbn::FusedBatchNormAttrs attrs;
    attrs.epsilon = kEpsilon;
    attrs.exponential_avg_factor = factor;
    attrs.data_format = format;
    ASSERT_NO_FATAL_FAILURE(io.AllocateOutputs(OpVersion::kV3, attrs));
    const Status s = fbn::FusedBatchNorm(OpVersion::kV3, io.Inputs(), attrs, io.Outputs());
    ASSERT_TRUE(s.ok()) << s.ToString();

    const auto x = io.x.ToVector(), scale = io.scale.ToVector(), offset = io.offset.ToVector();
    const auto old_mean = io.mean.ToVector(), old_var = io.variance.ToVector();
    const RefForward ref = RefBatchNormTraining(l, x, scale, offset, old_mean, old_var, kEpsilon,
                                                static_cast<double>(factor));
    EXPECT_TRUE(AllNearRef(io.y, ref.y, YBound(l, x, scale, offset, ref.saved_variance), rel));
    // A float mean is accurate to a few ulps of max|x|, a variance to a few ulps of itself;
    // blending adds the old value's term.
    const auto maxabs = MaxAbsPerChannel(l, x);
    std::vector<double> mean_bound(C), var_bound(C);
    for (int64_t c = 0; c < C; ++c) {
      const double f = static_cast<double>(factor);
      mean_bound[c] = factor == 1.0f ? maxabs[c] : (1 - f) * std::fabs(old_mean[c]) + f * maxabs[c];
      var_bound[c] = std::fabs(ref.batch_variance[c]);
    }
    EXPECT_TRUE(AllNearRef(io.batch_mean, ref.batch_mean, mean_bound, rel));
    EXPECT_TRUE(AllNearRef(io.batch_variance, ref.batch_variance, var_bound, rel));
    EXPECT_TRUE(AllNearRef(io.rs1, ref.saved_mean, maxabs, rel));
    EXPECT_TRUE(AllNearRef(io.rs2, ref.saved_variance, Abs(ref.saved_variance), rel));
    EXPECT_EQ(io.rs3.Get(0), 0.0);
  }
}

void CheckForwardInference(DataType dtype, TensorFormat format, const Shape& xs, uint32_t seed) {
  std::mt19937 rng(seed);
  const RefLayout l = LayoutOf(xs, format);
  const int64_t C = l.Channels();
  const DataType u = StatsType(dtype);
  ForwardIO io;
  io.x = RandomX(dtype, xs, format, &rng);
  io.scale = RandomTensor(u, Shape{C}, -1.5, 1.5, &rng);
  io.offset = RandomTensor(u, Shape{C}, -1, 1, &rng);
  io.mean = RandomTensor(u, Shape{C}, -3, 3, &rng);
  io.variance = RandomTensor(u, Shape{C}, 0.1, 3, &rng);
  fbn::FusedBatchNormAttrs attrs;
  attrs.epsilon = kEpsilon;
  attrs.exponential_avg_factor = 0.6f;  // ignored in inference
  attrs.data_format = format;
  attrs.is_training = false;
  ASSERT_NO_FATAL_FAILURE(io.AllocateOutputs(OpVersion::kV3, attrs));
  const Status s = fbn::FusedBatchNorm(OpVersion::kV3, io.Inputs(), attrs, io.Outputs());
  ASSERT_TRUE(s.ok()) << s.ToString();
  const auto x = io.x.ToVector(), scale = io.scale.ToVector(), offset = io.offset.ToVector();
  const auto mean = io.mean.ToVector(), var = io.variance.ToVector();
  const RefForward ref = RefBatchNormInference(l, x, scale, offset, mean, var, kEpsilon);
  // Here the mean is given exactly, so |a|·(|x| + |mean|) + |b| bounds the terms.
  std::vector<double> bound(x.size());
  for (int64_t i = 0; i < l.Elements(); ++i) {
    const int64_t c = l.ChannelOf(i);
    const double a = std::fabs(scale[c]) / std::sqrt(var[c] + static_cast<double>(kEpsilon));
    bound[i] = a * (std::fabs(x[i]) + std::fabs(mean[c])) + std::fabs(offset[c]);
  }
  EXPECT_TRUE(AllNearRef(io.y, ref.y, bound, RelTolerance(u)));
  // Inference echoes the given statistics.
  EXPECT_TRUE(io.batch_mean.BytesEqual(io.mean));
  EXPECT_TRUE(io.batch_variance.BytesEqual(io.variance));
  EXPECT_EQ(io.rs3.Get(0), 0.0);
}

void CheckGrad(DataType dtype, TensorFormat format, const Shape& xs, bool training, uint32_t seed) {
  std::mt19937 rng(seed);
  const RefLayout l = LayoutOf(xs, format);
  const int64_t C = l.Channels();
  const DataType u = StatsType(dtype);
  GradIO io;
  io.dy = RandomTensor(dtype, xs, -1, 1, &rng);
  io.x = RandomX(dtype, xs, format, &rng);
  io.scale = RandomTensor(u, Shape{C}, -1.5, 1.5, &rng);
  io.rs3 = HostTensor(u, Shape{});
  const auto x = io.x.ToVector();
  if (training) {
    // The forward pass's saved statistics: batch mean and biased variance of x.
    const RefForward f = RefBatchNormTraining(l, x, std::vector<double>(C, 1.0),
                                              std::vector<double>(C, 0.0), {}, {}, kEpsilon, 1.0);
    io.rs1 = HostTensor(u, Shape{C});
    io.rs1.FromVector(f.saved_mean);
    io.rs2 = HostTensor(u, Shape{C});
    io.rs2.FromVector(f.saved_variance);
  } else {
    io.rs1 = RandomTensor(u, Shape{C}, -3, 3, &rng);
    io.rs2 = RandomTensor(u, Shape{C}, 0.1, 3, &rng);
  }
  // Channels-first with is_training=false is an fbn extension (TensorFlow's CPU kernel rejects
  // it); fbn computes the same formulas.
  fbn::FusedBatchNormGradAttrs attrs;
  attrs.epsilon = kEpsilon;
  attrs.data_format = format;
  attrs.is_training = training;
  ASSERT_NO_FATAL_FAILURE(io.AllocateOutputs(OpVersion::kV3, attrs));
  const Status s = fbn::FusedBatchNormGrad(OpVersion::kV3, io.Inputs(), attrs, io.Outputs());
  ASSERT_TRUE(s.ok()) << s.ToString();
  const auto dy = io.dy.ToVector(), scale = io.scale.ToVector();
  const auto mean = io.rs1.ToVector(), var = io.rs2.ToVector();
  const RefGrad ref = training ? RefBatchNormGradTraining(l, dy, x, scale, mean, var, kEpsilon)
                               : RefBatchNormGradInference(l, dy, x, scale, mean, var, kEpsilon);
  const double rel = RelTolerance(u);
  EXPECT_TRUE(AllNearRef(io.dx, ref.dx, ref.dx_bound, rel));
  EXPECT_TRUE(AllNearRef(io.dscale, ref.dscale, ref.dscale_bound, rel));
  EXPECT_TRUE(AllNearRef(io.doffset, ref.doffset, ref.doffset_bound, rel));
}

}  // namespace fbn_test
