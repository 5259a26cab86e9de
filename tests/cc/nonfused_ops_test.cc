// The non-fused ops behind the layer's general path: fbn::Moments (tf.nn.moments) and
// fbn::BatchNormalization (tf.nn.batch_normalization), against the float64 reference.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "fbn/fbn.h"
#include "reference.h"
#include "test_util.h"

namespace fbn_test {
namespace {

using fbn::DataType;
using fbn::Shape;
using fbn::Status;
using fbn::StatusCode;
using fbn::TensorSpec;

constexpr DataType kAllDtypes[] = {DataType::kFloat16, DataType::kBFloat16, DataType::kFloat32,
                                   DataType::kFloat64};

::testing::AssertionResult IsInvalidArgument(const Status& s, const std::string& message) {
  if (s.code() != StatusCode::kInvalidArgument || s.message() != message) {
    return ::testing::AssertionFailure()
           << "got " << s.ToString() << "\nwant InvalidArgument: " << message;
  }
  return ::testing::AssertionSuccess();
}

std::vector<double> Abs(std::vector<double> v) {
  for (double& e : v) e = std::fabs(e);
  return v;
}

// Moments accumulate in float for 16-bit x and in double otherwise, then round once to x's dtype
// (see fbn/ops.h); their terms are positive (variance) or bounded by max|x| (mean).
double MomentsRel(DataType t) { return t == DataType::kFloat64 ? 1e-12 : 1e-6; }

struct MomentsCase {
  std::vector<int64_t> dims;
  std::vector<int> axes;
  bool keepdims;
  std::vector<int64_t> want_dims;
};

void CheckMoments(DataType t, const MomentsCase& c, uint32_t seed) {
  SCOPED_TRACE(DTypeTag(t) + " " +
               Shape(c.dims.data(), static_cast<int>(c.dims.size())).DebugString() +
               (c.keepdims ? " keepdims" : ""));
  std::mt19937 rng(seed);
  const Shape xs(c.dims.data(), static_cast<int>(c.dims.size()));
  // Data away from zero, so the variance is small against the mean: a one-pass formula would
  // not pass.
  const HostTensor x = RandomTensor(t, xs, 7.0, 9.0, &rng);
  TensorSpec spec;
  Status s = fbn::MomentsOutputSpec(x.cview(), c.axes.data(), static_cast<int>(c.axes.size()),
                                    c.keepdims, &spec);
  ASSERT_TRUE(s.ok()) << s.ToString();
  const Shape want(c.want_dims.data(), static_cast<int>(c.want_dims.size()));
  ASSERT_EQ(spec.shape, want) << spec.shape.DebugString();
  ASSERT_EQ(spec.dtype, t);
  HostTensor mean(t, spec.shape), var(t, spec.shape);
  s = fbn::Moments(x.cview(), c.axes.data(), static_cast<int>(c.axes.size()), c.keepdims,
                   mean.view(), var.view());
  ASSERT_TRUE(s.ok()) << s.ToString();

  std::vector<bool> reduced(c.dims.size(), false);
  for (int a : c.axes) reduced[a < 0 ? a + static_cast<int>(c.dims.size()) : a] = true;
  std::vector<double> ref_mean, ref_var;
  RefMoments(c.dims, x.ToVector(), reduced, &ref_mean, &ref_var);
  const double rel = MomentsRel(t);
  EXPECT_TRUE(AllNearRef(mean, ref_mean, Abs(ref_mean), rel));
  EXPECT_TRUE(AllNearRef(var, ref_var, Abs(ref_var), rel));
}

TEST(Moments, AxesAndKeepdims) {
  const std::vector<MomentsCase> cases = {
      // The layer's usual reductions: all but the channel axis, channels last or first.
      {{3, 5, 7, 6}, {0, 1, 2}, false, {6}},
      {{3, 5, 7, 6}, {0, 1, 2}, true, {1, 1, 1, 6}},
      {{3, 6, 5, 7}, {0, 2, 3}, false, {6}},
      {{3, 6, 5, 7}, {0, 2, 3}, true, {1, 6, 1, 1}},
      // Negative axes count from the end; order does not matter.
      {{4, 3, 5}, {-1, 0}, false, {3}},
      {{4, 3, 5}, {2, -3}, true, {1, 3, 1}},
      // One axis, all axes, no axes.
      {{4, 9}, {1}, false, {4}},
      {{2, 3, 4}, {0, 1, 2}, false, {}},
      {{2, 3, 4}, {0, 1, 2}, true, {1, 1, 1}},
      {{2, 3}, {}, false, {2, 3}},
      // Interleaved reduced and kept dims (odometer over non-adjacent axes), 5-D.
      {{2, 3, 2, 5, 3}, {0, 2, 4}, false, {3, 5}},
      {{2, 3, 2, 5, 3}, {1, 3}, true, {2, 1, 2, 1, 3}},
  };
  uint32_t seed = 1;
  for (DataType t : kAllDtypes) {
    for (const MomentsCase& c : cases) CheckMoments(t, c, seed++);
  }
}

TEST(Moments, Errors) {
  HostTensor x(DataType::kFloat32, Shape{2, 3, 4});
  TensorSpec spec;
  const int out_of_range[] = {3};
  EXPECT_TRUE(IsInvalidArgument(fbn::MomentsOutputSpec(x.cview(), out_of_range, 1, false, &spec),
                                "Invalid reduction dimension (3 for input with 3 dimension(s)"));
  const int too_negative[] = {-4};
  EXPECT_TRUE(IsInvalidArgument(fbn::MomentsOutputSpec(x.cview(), too_negative, 1, false, &spec),
                                "Invalid reduction dimension (-4 for input with 3 dimension(s)"));
  const int duplicate[] = {1, -2};
  EXPECT_TRUE(
      IsInvalidArgument(fbn::MomentsOutputSpec(x.cview(), duplicate, 2, false, &spec),
                        "Invalid reduction arguments: Axes contains duplicate dimension: 1"));

  // Output views must match the spec; nothing is written otherwise.
  const int axes[] = {0, 1};
  HostTensor mean(DataType::kFloat32, Shape{4}), bad_var(DataType::kFloat32, Shape{1, 4});
  mean.FillBytes(0x5A);
  const auto before = mean.RawBytes();
  EXPECT_TRUE(IsInvalidArgument(
      fbn::Moments(x.cview(), axes, 2, false, mean.view(), bad_var.view()),
      "output variance must have dtype float and shape [4], got dtype float and shape [1,4]"));
  EXPECT_EQ(mean.RawBytes(), before);
  HostTensor half_var(DataType::kFloat16, Shape{4});
  EXPECT_TRUE(IsInvalidArgument(
      fbn::Moments(x.cview(), axes, 2, false, mean.view(), half_var.view()),
      "output variance must have dtype float and shape [4], got dtype half and shape [4]"));
  EXPECT_EQ(mean.RawBytes(), before);
}

// ---------------------------------------------------------------------------------------------

HostTensor RandomParam(DataType t, const std::vector<int64_t>& dims, double lo, double hi,
                       std::mt19937* rng) {
  return RandomTensor(t, Shape(dims.data(), static_cast<int>(dims.size())), lo, hi, rng);
}

RefParam ToRef(const HostTensor& t) { return RefParam{DimsOf(t.shape()), t.ToVector()}; }

struct BroadcastCase {
  std::vector<int64_t> x, mean, var, offset, scale;  // empty offset/scale dims: not given
  bool has_offset, has_scale;
};

TEST(BatchNormalization, BroadcastsLikeNumPy) {
  const std::vector<BroadcastCase> cases = {
      // Per-channel vectors against channels-last x.
      {{2, 3, 5, 4}, {4}, {4}, {4}, {4}, true, true},
      // Channels-first: [C,1,1] parameters (the layer's _broadcast).
      {{2, 4, 3, 5}, {4, 1, 1}, {4, 1, 1}, {4, 1, 1}, {4, 1, 1}, true, true},
      // keepdims-style statistics with more dims, scalars, and a missing offset/scale.
      {{2, 4, 3, 5}, {1, 4, 1, 1}, {1, 4, 1, 1}, {}, {4, 1, 1}, false, true},
      {{3, 7}, {}, {}, {7}, {}, true, false},
      {{3, 7}, {3, 1}, {1, 7}, {}, {}, false, false},
      {{6}, {6}, {1}, {6}, {1}, true, true},
      {{2, 3, 2, 2, 5}, {5}, {5}, {5}, {5}, true, true},
  };
  uint32_t seed = 100;
  for (DataType t : kAllDtypes) {
    for (const BroadcastCase& c : cases) {
      SCOPED_TRACE(DTypeTag(t) + " x " +
                   Shape(c.x.data(), static_cast<int>(c.x.size())).DebugString());
      std::mt19937 rng(seed++);
      const HostTensor x = RandomParam(t, c.x, -3, 3, &rng);
      const HostTensor mean = RandomParam(t, c.mean, -1, 1, &rng);
      const HostTensor var = RandomParam(t, c.var, 0.2, 2, &rng);
      const HostTensor offset = RandomParam(t, c.offset, -1, 1, &rng);
      const HostTensor scale = RandomParam(t, c.scale, -2, 2, &rng);
      fbn::ConstTensorView off = offset.cview(), sc = scale.cview();
      if (!c.has_offset) off = {nullptr, t, Shape{}};
      if (!c.has_scale) sc = {nullptr, t, Shape{}};
      HostTensor y(t, x.shape());
      const Status s =
          fbn::BatchNormalization(x.cview(), mean.cview(), var.cview(), off, sc, 0.001f, y.view());
      ASSERT_TRUE(s.ok()) << s.ToString();
      const RefParam ro = ToRef(offset), rs = ToRef(scale);
      const std::vector<double> ref = RefBatchNormalization(
          c.x, x.ToVector(), ToRef(mean), ToRef(var), c.has_offset ? &ro : nullptr,
          c.has_scale ? &rs : nullptr, static_cast<double>(0.001f));
      // The terms' magnitudes: (|x| + |mean|)·|scale|/sqrt(var + eps) + |offset|, the same
      // formula on absolute values with the mean's sign flipped.
      auto abs_ref = [](const RefParam& p, double sign) {
        RefParam a = p;
        for (double& v : a.values) v = sign * std::fabs(v);
        return a;
      };
      const RefParam ao = abs_ref(ro, 1), as = abs_ref(rs, 1);
      const std::vector<double> bound = RefBatchNormalization(
          c.x, Abs(x.ToVector()), abs_ref(ToRef(mean), -1), ToRef(var),
          c.has_offset ? &ao : nullptr, c.has_scale ? &as : nullptr, static_cast<double>(0.001f));
      // fbn computes in double and rounds once to x's dtype (16-bit via float: the double
      // rounding adds at most half a float ulp, inside rel).
      const double rel = t == DataType::kFloat64 ? 1e-14 : 1e-7;
      EXPECT_TRUE(AllNearRef(y, ref, bound, rel));
    }
  }
}

TEST(BatchNormalization, Errors) {
  HostTensor x(DataType::kFloat32, Shape{2, 3, 4}), y(DataType::kFloat32, Shape{2, 3, 4});
  HostTensor v4(DataType::kFloat32, Shape{4}), v5(DataType::kFloat32, Shape{5});
  HostTensor big(DataType::kFloat32, Shape{1, 2, 3, 4}), d4(DataType::kFloat64, Shape{4});
  const fbn::ConstTensorView none{nullptr, DataType::kFloat32, Shape{}};
  y.FillBytes(0x3C);
  const auto before = y.RawBytes();
  EXPECT_TRUE(IsInvalidArgument(
      fbn::BatchNormalization(x.cview(), v5.cview(), v4.cview(), none, none, 0.001f, y.view()),
      "Incompatible shapes: [2,3,4] vs. [5]"));
  EXPECT_TRUE(IsInvalidArgument(
      fbn::BatchNormalization(x.cview(), v4.cview(), big.cview(), none, none, 0.001f, y.view()),
      "Incompatible shapes: [2,3,4] vs. [1,2,3,4]"));
  EXPECT_TRUE(IsInvalidArgument(fbn::BatchNormalization(x.cview(), v4.cview(), v4.cview(),
                                                        v5.cview(), none, 0.001f, y.view()),
                                "Incompatible shapes: [2,3,4] vs. [5]"));
  EXPECT_TRUE(IsInvalidArgument(fbn::BatchNormalization(x.cview(), v4.cview(), v4.cview(), none,
                                                        d4.cview(), 0.001f, y.view()),
                                "scale must have the dtype of x (float), got double"));
  HostTensor y_bad(DataType::kFloat32, Shape{2, 3, 5});
  EXPECT_TRUE(IsInvalidArgument(
      fbn::BatchNormalization(x.cview(), v4.cview(), v4.cview(), none, none, 0.001f, y_bad.view()),
      "output y must have dtype float and shape [2,3,4], got dtype float and shape [2,3,5]"));
  EXPECT_EQ(y.RawBytes(), before);
}

// Moments then BatchNormalization is the layer's general path; it must agree with the fused op.
TEST(BatchNormalization, MomentsPathMatchesFusedTraining) {
  std::mt19937 rng(9);
  const Shape xs{4, 5, 3, 6};
  const HostTensor x = RandomTensor(DataType::kFloat64, xs, -2, 5, &rng);
  const HostTensor scale = RandomTensor(DataType::kFloat64, Shape{6}, 0.5, 2, &rng);
  const HostTensor offset = RandomTensor(DataType::kFloat64, Shape{6}, -1, 1, &rng);
  const int axes[] = {0, 1, 2};
  HostTensor mean(DataType::kFloat64, Shape{6}), var(DataType::kFloat64, Shape{6});
  ASSERT_TRUE(fbn::Moments(x.cview(), axes, 3, false, mean.view(), var.view()).ok());
  HostTensor y(DataType::kFloat64, xs);
  ASSERT_TRUE(fbn::BatchNormalization(x.cview(), mean.cview(), var.cview(), offset.cview(),
                                      scale.cview(), 0.001f, y.view())
                  .ok());
  ForwardIO io;
  io.x = x;
  io.scale = scale;
  io.offset = offset;
  io.mean = io.variance = HostTensor(DataType::kFloat64, Shape{0});
  fbn::FusedBatchNormAttrs attrs;
  attrs.epsilon = 0.001f;
  ASSERT_NO_FATAL_FAILURE(io.AllocateOutputs(fbn::OpVersion::kV3, attrs));
  ASSERT_TRUE(fbn::FusedBatchNorm(fbn::OpVersion::kV3, io.Inputs(), attrs, io.Outputs()).ok());
  for (int64_t i = 0; i < y.size(); ++i) ASSERT_NEAR(y.Get(i), io.y.Get(i), 1e-12) << i;
  for (int c = 0; c < 6; ++c) {
    EXPECT_NEAR(mean.Get(c), io.rs1.Get(c), 1e-12);
    EXPECT_NEAR(var.Get(c), io.rs2.Get(c), 1e-12);
  }
}

}  // namespace
}  // namespace fbn_test
