// FusedBatchNorm / FusedBatchNormGrad (V1-V3): TensorFlow's kernel tests with their golden values,
// the shape specs, every validation error with TensorFlow's text, edge cases, and a sweep over
// dtypes x layouts x shapes against the float64 reference.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "fbn/fbn.h"
#include "op_checks.h"
#include "reference.h"
#include "test_util.h"

namespace fbn_test {
namespace {

using fbn::DataType;
using fbn::FusedBatchNormAttrs;
using fbn::FusedBatchNormGradAttrs;
using fbn::OpVersion;
using fbn::Shape;
using fbn::Status;
using fbn::StatusCode;
using fbn::TensorFormat;
using fbn::TensorSpec;

constexpr OpVersion kAllVersions[] = {OpVersion::kV1, OpVersion::kV2, OpVersion::kV3};
constexpr DataType kAllDtypes[] = {DataType::kFloat16, DataType::kBFloat16, DataType::kFloat32,
                                   DataType::kFloat64};
constexpr TensorFormat kAllFormats[] = {TensorFormat::kNHWC, TensorFormat::kNCHW,
                                        TensorFormat::kNDHWC, TensorFormat::kNCDHW};

HostTensor Vec(DataType dtype, const std::vector<double>& values) {
  HostTensor t(dtype, Shape{static_cast<int64_t>(values.size())});
  t.FromVector(values);
  return t;
}

HostTensor Filled(DataType dtype, const Shape& shape, double value) {
  HostTensor t(dtype, shape);
  for (int64_t i = 0; i < t.size(); ++i) t.Set(i, value);
  return t;
}

// Transposes between channels-last and channels-first: [N, spatial..., C] <-> [N, C, spatial...].
HostTensor ToChannelsFirst(const HostTensor& t) {
  const Shape& s = t.shape();
  const int rank = s.rank();
  std::vector<int64_t> dims{s.dim(0), s.dim(rank - 1)};
  int64_t inner = 1;
  for (int i = 1; i < rank - 1; ++i) {
    dims.push_back(s.dim(i));
    inner *= s.dim(i);
  }
  HostTensor out(t.dtype(), Shape(dims.data(), rank));
  const int64_t N = s.dim(0), C = s.dim(rank - 1);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t i = 0; i < inner; ++i) {
      for (int64_t c = 0; c < C; ++c) {
        out.Set((n * C + c) * inner + i, t.Get((n * inner + i) * C + c));
      }
    }
  }
  return out;
}

TensorFormat ChannelsFirstOf(TensorFormat f) {
  return f == TensorFormat::kNHWC ? TensorFormat::kNCHW : TensorFormat::kNCDHW;
}

::testing::AssertionResult IsInvalidArgument(const Status& s, const std::string& message) {
  if (s.code() != StatusCode::kInvalidArgument) {
    return ::testing::AssertionFailure() << "want InvalidArgument, got " << s.ToString();
  }
  if (s.message() != message) {
    return ::testing::AssertionFailure()
           << "message\n  got:  " << s.message() << "\n  want: " << message;
  }
  return ::testing::AssertionSuccess();
}

FusedBatchNormAttrs Attrs(bool training, float factor = 1.0f,
                          TensorFormat format = TensorFormat::kNHWC, float epsilon = kEpsilon) {
  FusedBatchNormAttrs a;
  a.epsilon = epsilon;
  a.exponential_avg_factor = factor;
  a.data_format = format;
  a.is_training = training;
  return a;
}

FusedBatchNormGradAttrs GradAttrs(bool training, TensorFormat format = TensorFormat::kNHWC,
                                  float epsilon = kEpsilon) {
  FusedBatchNormGradAttrs a;
  a.epsilon = epsilon;
  a.data_format = format;
  a.is_training = training;
  return a;
}

// ---------------------------------------------------------------------------------------------
// TensorFlow's fused_batch_norm_op_test.cc (spec/tf-tests.md §B): x of shape [1,1,6,2] whose two
// channels hold the same six values; the golden values are TensorFlow's, checked to its 0.01.

constexpr double kGoldenTol = 0.01;

HostTensor TwoChannels(const std::vector<double>& per_channel) {
  HostTensor t(DataType::kFloat32, Shape{1, 1, 6, 2});
  for (int i = 0; i < 6; ++i) {
    t.Set(2 * i, per_channel[i]);
    t.Set(2 * i + 1, per_channel[i]);
  }
  return t;
}

void ExpectTwoChannels(const HostTensor& t, const std::vector<double>& want) {
  ASSERT_EQ(t.size(), 12);
  for (int i = 0; i < 6; ++i) {
    EXPECT_NEAR(t.Get(2 * i), want[i], kGoldenTol) << "element " << i;
    EXPECT_NEAR(t.Get(2 * i + 1), want[i], kGoldenTol) << "element " << i;
  }
}

void ExpectVec(const HostTensor& t, const std::vector<double>& want, double tol) {
  ASSERT_EQ(t.size(), static_cast<int64_t>(want.size()));
  for (int64_t i = 0; i < t.size(); ++i) EXPECT_NEAR(t.Get(i), want[i], tol) << "element " << i;
}

const std::vector<double> kGoldenX = {5, 7, 9, 11, 13, 15};
const std::vector<double> kGoldenY = {-3.86, -1.51, 0.83, 3.17, 5.51, 7.86};

ForwardIO GoldenForwardInputs(const std::vector<double>& mean, const std::vector<double>& var) {
  ForwardIO io;
  io.x = TwoChannels(kGoldenX);
  io.scale = Vec(DataType::kFloat32, {4, 4});
  io.offset = Vec(DataType::kFloat32, {2, 2});
  io.mean = Vec(DataType::kFloat32, mean);
  io.variance = Vec(DataType::kFloat32, var);
  return io;
}

class GoldenTest : public ::testing::TestWithParam<OpVersion> {};

TEST_P(GoldenTest, Training) {
  const OpVersion v = GetParam();
  ForwardIO io = GoldenForwardInputs({}, {});
  const auto attrs = Attrs(true);
  ASSERT_NO_FATAL_FAILURE(io.AllocateOutputs(v, attrs));
  const Status s = fbn::FusedBatchNorm(v, io.Inputs(), attrs, io.Outputs());
  ASSERT_TRUE(s.ok()) << s.ToString();
  ExpectTwoChannels(io.y, kGoldenY);
  ExpectVec(io.batch_mean, {10, 10}, kGoldenTol);
  ExpectVec(io.batch_variance, {14, 14}, kGoldenTol);  // unbiased: 70 / 5
  // The gradient's inputs: batch mean and the biased variance (70 / 6).
  ExpectVec(io.rs1, {10, 10}, 1e-6);
  ExpectVec(io.rs2, {70.0 / 6, 70.0 / 6}, 1e-5);
  if (v == OpVersion::kV3) {
    ASSERT_EQ(io.rs3.shape(), Shape{});
    EXPECT_EQ(io.rs3.Get(0), 0.0);
  }
}

TEST_P(GoldenTest, TrainingRunningMean) {
  const OpVersion v = GetParam();
  ForwardIO io = GoldenForwardInputs({6, 6}, {16, 16});
  const auto attrs = Attrs(true, 0.5f);
  ASSERT_NO_FATAL_FAILURE(io.AllocateOutputs(v, attrs));
  const Status s = fbn::FusedBatchNorm(v, io.Inputs(), attrs, io.Outputs());
  ASSERT_TRUE(s.ok()) << s.ToString();
  ExpectTwoChannels(io.y, kGoldenY);
  ExpectVec(io.batch_mean, {8, 8}, kGoldenTol);
  ExpectVec(io.batch_variance, {15, 15}, kGoldenTol);
}

TEST_P(GoldenTest, Inference) {
  const OpVersion v = GetParam();
  ForwardIO io = GoldenForwardInputs({10, 10}, {11.67, 11.67});
  const auto attrs = Attrs(false);
  ASSERT_NO_FATAL_FAILURE(io.AllocateOutputs(v, attrs));
  const Status s = fbn::FusedBatchNorm(v, io.Inputs(), attrs, io.Outputs());
  ASSERT_TRUE(s.ok()) << s.ToString();
  ExpectTwoChannels(io.y, kGoldenY);
  // Inference echoes the given statistics.
  EXPECT_TRUE(io.batch_mean.BytesEqual(io.mean));
  EXPECT_TRUE(io.batch_variance.BytesEqual(io.variance));
}

TEST_P(GoldenTest, InferenceIgnoreAvgFactor) {
  const OpVersion v = GetParam();
  ForwardIO io = GoldenForwardInputs({10, 10}, {11.67, 11.67});
  const auto attrs = Attrs(false, 0.5f);
  ASSERT_NO_FATAL_FAILURE(io.AllocateOutputs(v, attrs));
  const Status s = fbn::FusedBatchNorm(v, io.Inputs(), attrs, io.Outputs());
  ASSERT_TRUE(s.ok()) << s.ToString();
  ExpectTwoChannels(io.y, kGoldenY);
  EXPECT_TRUE(io.batch_mean.BytesEqual(io.mean));
  EXPECT_TRUE(io.batch_variance.BytesEqual(io.variance));
}

TEST_P(GoldenTest, EmptyInput) {
  const OpVersion v = GetParam();
  ForwardIO io;
  io.x = HostTensor(DataType::kFloat32, Shape{1, 1, 0, 0});
  io.scale = io.offset = io.mean = io.variance = HostTensor(DataType::kFloat32, Shape{0});
  const auto attrs = Attrs(true);
  ASSERT_NO_FATAL_FAILURE(io.AllocateOutputs(v, attrs));
  EXPECT_EQ(io.y.shape(), (Shape{1, 1, 0, 0}));
  EXPECT_EQ(io.batch_mean.shape(), Shape{0});
  const Status s = fbn::FusedBatchNorm(v, io.Inputs(), attrs, io.Outputs());
  ASSERT_TRUE(s.ok()) << s.ToString();
}

TEST_P(GoldenTest, GradSimple) {
  const OpVersion v = GetParam();
  GradIO io;
  io.dy = TwoChannels({2, 9, -4, 5, 8, 7});
  io.x = TwoChannels({1, 7, 4, -3, -11, 13});
  io.scale = Vec(DataType::kFloat32, {4, 4});
  io.rs1 = Vec(DataType::kFloat32, {1.833, 1.833});
  io.rs2 = Vec(DataType::kFloat32, {57.472, 57.472});
  io.rs3 = HostTensor(DataType::kFloat32, Shape{});
  const auto attrs = GradAttrs(true);
  ASSERT_NO_FATAL_FAILURE(io.AllocateOutputs(v, attrs));
  const Status s = fbn::FusedBatchNormGrad(v, io.Inputs(), attrs, io.Outputs());
  ASSERT_TRUE(s.ok()) << s.ToString();
  ExpectTwoChannels(io.dx, {-1.34, 2.47, -4.44, 0.17, 1.60, 1.53});
  ExpectVec(io.dscale, {-1.6488, -1.6488}, kGoldenTol);
  ExpectVec(io.doffset, {27, 27}, kGoldenTol);
  EXPECT_EQ(io.rs_a.shape(), Shape{0});
  EXPECT_EQ(io.rs_b.shape(), Shape{0});
}

INSTANTIATE_TEST_SUITE_P(Versions, GoldenTest, ::testing::ValuesIn(kAllVersions),
                         [](const ::testing::TestParamInfo<OpVersion>& p) {
                           return std::string(fbn::FusedBatchNormOpName(p.param));
                         });

// ---------------------------------------------------------------------------------------------
// Output specs (spec/tf-tests.md §C, adapted: fbn's shapes are always known).

struct SpecResult {
  Status status;
  TensorSpec specs[fbn::kMaxOpOutputs];
  int n = 0;
};

SpecResult ForwardSpecs(OpVersion v, const Shape& x, const Shape& scale, const Shape& offset,
                        const Shape& mean, const Shape& var, const FusedBatchNormAttrs& attrs,
                        DataType t = DataType::kFloat32) {
  const DataType u = v == OpVersion::kV1 ? t : StatsType(t);
  // Views with no data: the specs need only shapes and types (a non-empty tensor would need
  // data, so give every tensor a dummy pointer).
  static double dummy[1];
  fbn::FusedBatchNormInputs in{
      {dummy, t, x}, {dummy, u, scale}, {dummy, u, offset}, {dummy, u, mean}, {dummy, u, var}};
  SpecResult r;
  r.status = fbn::FusedBatchNormOutputSpecs(v, in, attrs, r.specs, &r.n);
  return r;
}

SpecResult GradSpecs(OpVersion v, const Shape& dy, const Shape& x, const Shape& scale,
                     const Shape& rs1, const Shape& rs2, const FusedBatchNormGradAttrs& attrs,
                     DataType t = DataType::kFloat32) {
  const DataType u = v == OpVersion::kV1 ? t : StatsType(t);
  static double dummy[1];
  fbn::FusedBatchNormGradInputs in{{dummy, t, dy},  {dummy, t, x},   {dummy, u, scale},
                                   {dummy, u, rs1}, {dummy, u, rs2}, {dummy, u, Shape{}}};
  SpecResult r;
  r.status = fbn::FusedBatchNormGradOutputSpecs(v, in, attrs, r.specs, &r.n);
  return r;
}

TEST(FusedBatchNormSpecs, ChannelsLastAndFirst) {
  for (OpVersion v : kAllVersions) {
    SCOPED_TRACE(fbn::FusedBatchNormOpName(v));
    for (bool training : {true, false}) {
      const Shape stats = training ? Shape{0} : Shape{4};
      SpecResult r = ForwardSpecs(v, {1, 2, 3, 4}, {4}, {4}, stats, stats, Attrs(training));
      ASSERT_TRUE(r.status.ok()) << r.status.ToString();
      ASSERT_EQ(r.n, v == OpVersion::kV3 ? 6 : 5);
      EXPECT_EQ(r.specs[0].shape, (Shape{1, 2, 3, 4}));
      EXPECT_EQ(r.specs[0].dtype, DataType::kFloat32);
      for (int i = 1; i < 5; ++i) {
        EXPECT_EQ(r.specs[i].shape, Shape{4});
        EXPECT_EQ(r.specs[i].dtype, DataType::kFloat32);
      }
      if (v == OpVersion::kV3) {
        EXPECT_EQ(r.specs[5].shape, Shape{});  // a CPU scalar
      }

      r = ForwardSpecs(v, {1, 4, 2, 3}, {4}, {4}, stats, stats,
                       Attrs(training, 1.0f, TensorFormat::kNCHW));
      ASSERT_TRUE(r.status.ok()) << r.status.ToString();
      EXPECT_EQ(r.specs[0].shape, (Shape{1, 4, 2, 3}));
      for (int i = 1; i < 5; ++i) EXPECT_EQ(r.specs[i].shape, Shape{4});
    }
  }
}

TEST(FusedBatchNormSpecs, FiveDimensional) {
  SpecResult r = ForwardSpecs(OpVersion::kV3, {2, 3, 4, 5, 6}, {6}, {6}, {0}, {0},
                              Attrs(true, 1.0f, TensorFormat::kNDHWC));
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(r.specs[0].shape, (Shape{2, 3, 4, 5, 6}));
  EXPECT_EQ(r.specs[1].shape, Shape{6});
  r = ForwardSpecs(OpVersion::kV3, {2, 6, 3, 4, 5}, {6}, {6}, {6}, {6},
                   Attrs(false, 1.0f, TensorFormat::kNCDHW));
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(r.specs[4].shape, Shape{6});
  // The kernel does not tie the rank to the format name (tf-semantics §3): 5-D x with a 2-D
  // name and 4-D x with a 3-D name both work.
  r = ForwardSpecs(OpVersion::kV2, {2, 3, 4, 5, 6}, {6}, {6}, {0}, {0}, Attrs(true));
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  r = ForwardSpecs(OpVersion::kV3, {2, 3, 4, 6}, {6}, {6}, {0}, {0},
                   Attrs(true, 1.0f, TensorFormat::kNDHWC));
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
}

TEST(FusedBatchNormSpecs, StatsTypeFollowsX) {
  for (DataType t : kAllDtypes) {
    SpecResult r = ForwardSpecs(OpVersion::kV3, {1, 2, 3, 4}, {4}, {4}, {0}, {0}, Attrs(true), t);
    ASSERT_TRUE(r.status.ok()) << r.status.ToString();
    EXPECT_EQ(r.specs[0].dtype, t);
    for (int i = 1; i < 6; ++i) EXPECT_EQ(r.specs[i].dtype, StatsType(t));
  }
}

TEST(FusedBatchNormSpecs, TrainingWithFactorOneIgnoresMeanAndVarianceSize) {
  // Only their rank is checked (shape function step 3; kernel step 9).
  SpecResult r = ForwardSpecs(OpVersion::kV3, {1, 2, 3, 4}, {4}, {4}, {7}, {1}, Attrs(true));
  EXPECT_TRUE(r.status.ok()) << r.status.ToString();
}

TEST(FusedBatchNormSpecs, RankErrors) {
  for (bool training : {true, false}) {
    const auto a = Attrs(training);
    const Shape s3{1, 2, 3};
    EXPECT_TRUE(IsInvalidArgument(ForwardSpecs(OpVersion::kV1, s3, {4}, {4}, {4}, {4}, a).status,
                                  "input must be 4 or 5-dimensional[1,2,3]"));
    EXPECT_TRUE(
        IsInvalidArgument(ForwardSpecs(OpVersion::kV1, {1, 2, 3, 4}, s3, {4}, {4}, {4}, a).status,
                          "scale must be 1-dimensional[1,2,3]"));
    EXPECT_TRUE(
        IsInvalidArgument(ForwardSpecs(OpVersion::kV1, {1, 2, 3, 4}, {4}, s3, {4}, {4}, a).status,
                          "offset must be 1-dimensional[1,2,3]"));
    // The kernel checks the rank of mean and variance even in training.
    EXPECT_TRUE(
        IsInvalidArgument(ForwardSpecs(OpVersion::kV1, {1, 2, 3, 4}, {4}, {4}, s3, {4}, a).status,
                          "estimated_mean must be 1-dimensional[1,2,3]"));
    EXPECT_TRUE(
        IsInvalidArgument(ForwardSpecs(OpVersion::kV1, {1, 2, 3, 4}, {4}, {4}, {4}, s3, a).status,
                          "estimated_variance must be 1-dimensional[1,2,3]"));
  }
}

TEST(FusedBatchNormGradSpecs, Shapes) {
  for (OpVersion v : kAllVersions) {
    SCOPED_TRACE(fbn::FusedBatchNormGradOpName(v));
    for (bool training : {true, false}) {
      SpecResult r = GradSpecs(v, {1, 2, 3, 4}, {1, 2, 3, 4}, {4}, {4}, {4}, GradAttrs(training));
      ASSERT_TRUE(r.status.ok()) << r.status.ToString();
      ASSERT_EQ(r.n, 5);
      EXPECT_EQ(r.specs[0].shape, (Shape{1, 2, 3, 4}));
      EXPECT_EQ(r.specs[1].shape, Shape{4});
      EXPECT_EQ(r.specs[2].shape, Shape{4});
      EXPECT_EQ(r.specs[3].shape, Shape{0});
      EXPECT_EQ(r.specs[4].shape, Shape{0});
      r = GradSpecs(v, {1, 4, 2, 3}, {1, 4, 2, 3}, {4}, {4}, {4},
                    GradAttrs(training, TensorFormat::kNCHW));
      ASSERT_TRUE(r.status.ok()) << r.status.ToString();
      EXPECT_EQ(r.specs[0].shape, (Shape{1, 4, 2, 3}));
      EXPECT_EQ(r.specs[1].shape, Shape{4});
    }
  }
  SpecResult r = GradSpecs(OpVersion::kV3, {2, 6, 3, 4, 5}, {2, 6, 3, 4, 5}, {6}, {6}, {6},
                           GradAttrs(true, TensorFormat::kNCDHW), DataType::kBFloat16);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(r.specs[0].dtype, DataType::kBFloat16);
  EXPECT_EQ(r.specs[1].dtype, DataType::kFloat32);
  EXPECT_EQ(r.specs[1].shape, Shape{6});
}

TEST(FusedBatchNormGradSpecs, RankErrors) {
  const auto a = GradAttrs(true);
  const Shape x{1, 2, 3, 4}, s3{1, 2, 3};
  EXPECT_TRUE(IsInvalidArgument(GradSpecs(OpVersion::kV2, s3, x, {4}, {4}, {4}, a).status,
                                "input must be 4 or 5-dimensional[1,2,3]"));
  EXPECT_TRUE(IsInvalidArgument(GradSpecs(OpVersion::kV2, x, s3, {4}, {4}, {4}, a).status,
                                "input must be 4 or 5-dimensional[1,2,3]"));
  EXPECT_TRUE(IsInvalidArgument(GradSpecs(OpVersion::kV2, x, x, s3, {4}, {4}, a).status,
                                "scale must be 1-dimensional[1,2,3]"));
  EXPECT_TRUE(IsInvalidArgument(GradSpecs(OpVersion::kV2, x, x, {4}, s3, {4}, a).status,
                                "saved mean must be 1-dimensional[1,2,3]"));
  EXPECT_TRUE(IsInvalidArgument(GradSpecs(OpVersion::kV2, x, x, {4}, {4}, s3, a).status,
                                "saved variance must be 1-dimensional[1,2,3]"));
}

TEST(ParseDataFormat, AcceptsWhatEachVersionLists) {
  TensorFormat f = TensorFormat::kNHWC;
  for (OpVersion v : kAllVersions) {
    ASSERT_TRUE(fbn::ParseDataFormat("NCHW", v, &f).ok());
    EXPECT_EQ(f, TensorFormat::kNCHW);
    ASSERT_TRUE(fbn::ParseDataFormat("NHWC", v, &f).ok());
    EXPECT_EQ(f, TensorFormat::kNHWC);
  }
  ASSERT_TRUE(fbn::ParseDataFormat("NCDHW", OpVersion::kV3, &f).ok());
  EXPECT_EQ(f, TensorFormat::kNCDHW);
  ASSERT_TRUE(fbn::ParseDataFormat("NDHWC", OpVersion::kV3, &f).ok());
  EXPECT_EQ(f, TensorFormat::kNDHWC);
  EXPECT_TRUE(IsInvalidArgument(fbn::ParseDataFormat("NDHWC", OpVersion::kV2, &f),
                                "Value for attr 'data_format' of \"NDHWC\" is not in the list of "
                                "allowed values: \"NHWC\", \"NCHW\""));
  EXPECT_TRUE(IsInvalidArgument(fbn::ParseDataFormat("nhwc", OpVersion::kV3, &f),
                                "Value for attr 'data_format' of \"nhwc\" is not in the list of "
                                "allowed values: \"NHWC\", \"NCHW\", \"NDHWC\", \"NCDHW\""));
}

// ---------------------------------------------------------------------------------------------
// Validation errors: each case breaks one thing in a valid call and expects TensorFlow's text
// (tf-semantics §4.2, §5.1), the same error from the spec query, and no output touched.

constexpr unsigned char kSentinel = 0xA7;

struct ForwardErrorCase {
  const char* name;
  std::function<void(ForwardIO&, FusedBatchNormAttrs&, OpVersion&)> mutate;
  std::string message;
};

ForwardIO ValidForward() {
  ForwardIO io;
  io.x = Filled(DataType::kFloat32, Shape{2, 2, 2, 2}, 1.0);
  io.scale = io.offset = io.mean = io.variance = Filled(DataType::kFloat32, Shape{2}, 1.0);
  return io;
}

HostTensor F32(const Shape& s) { return Filled(DataType::kFloat32, s, 1.0); }

std::vector<ForwardErrorCase> ForwardErrorCases() {
  using IO = ForwardIO;
  using A = FusedBatchNormAttrs;
  using V = OpVersion;
  const std::string same = " must have the same number of elements as the channels of x, got ";
  return {
      // tf-semantics §4.2, in order.
      {"XRank3",
       [](IO& io, A&, V&) {
         io.x = F32({2, 2, 2});
       },
       "input must be 4 or 5-dimensional[2,2,2]"},
      {"XRank6",
       [](IO& io, A&, V&) {
         io.x = F32({1, 2, 2, 2, 2, 2});
       },
       "input must be 4 or 5-dimensional[1,2,2,2,2,2]"},
      {"ScaleRank2",
       [](IO& io, A&, V&) {
         io.scale = F32({2, 1});
       },
       "scale must be 1-dimensional[2,1]"},
      {"OffsetRank0", [](IO& io, A&, V&) { io.offset = F32({}); },
       "offset must be 1-dimensional[]"},
      {"MeanRank0InTraining", [](IO& io, A&, V&) { io.mean = F32({}); },
       "estimated_mean must be 1-dimensional[]"},
      {"VarianceRank2",
       [](IO& io, A&, V&) {
         io.variance = F32({1, 2});
       },
       "estimated_variance must be 1-dimensional[1,2]"},
      {"ScaleCount", [](IO& io, A&, V&) { io.scale = F32({3}); }, "scale" + same + "3 and 2"},
      {"OffsetCount", [](IO& io, A&, V&) { io.offset = F32({3}); }, "offset" + same + "3 and 2"},
      {"InferenceMeanCount",
       [](IO& io, A& a, V&) {
         a.is_training = false;
         io.mean = F32({0});
       },
       "When is_training=false, mean" + same + "0 and 2"},
      {"InferenceVarianceCount",
       [](IO& io, A& a, V&) {
         a.is_training = false;
         io.variance = F32({0});
       },
       "When is_training=false, variance" + same + "0 and 2"},
      {"FactorMeanCount",
       [](IO& io, A& a, V&) {
         a.exponential_avg_factor = 0.5f;
         io.mean = F32({0});
       },
       "When exponential_avg_factor != 1, mean" + same + "0 and 2"},
      {"FactorVarianceCount",
       [](IO& io, A& a, V&) {
         a.exponential_avg_factor = 0.5f;
         io.variance = F32({3});
       },
       "When exponential_avg_factor != 1, variance" + same + "3 and 2"},
      // The inference prefix wins when both conditions hold.
      {"InferenceAndFactor",
       [](IO& io, A& a, V&) {
         a.is_training = false;
         a.exponential_avg_factor = 0.5f;
         io.mean = F32({0});
       },
       "When is_training=false, mean" + same + "0 and 2"},
      // Order: rank checks come before counts, x before everything.
      {"XRankBeforeScaleRank",
       [](IO& io, A&, V&) {
         io.x = F32({2, 2, 2});
         io.scale = F32({2, 2});
       },
       "input must be 4 or 5-dimensional[2,2,2]"},
      {"RankBeforeCount",
       [](IO& io, A&, V&) {
         io.scale = F32({3});
         io.variance = F32({});
       },
       "estimated_variance must be 1-dimensional[]"},
      {"ScaleCountBeforeOffsetCount",
       [](IO& io, A&, V&) {
         io.scale = F32({3});
         io.offset = F32({5});
       },
       "scale" + same + "3 and 2"},
      // The channel dim follows the format.
      {"ChannelsFirstCount",
       [](IO& io, A& a, V&) {
         a.data_format = TensorFormat::kNCHW;
         io.x = F32({2, 3, 2, 2});
       },
       "scale" + same + "2 and 3"},
      {"FiveDimCount",
       [](IO& io, A& a, V&) {
         a.data_format = TensorFormat::kNDHWC;
         io.x = F32({2, 2, 2, 2, 3});
       },
       "scale" + same + "2 and 3"},
      // Registration-level checks (types, attribute lists) come first, as in TensorFlow.
      {"V1RejectsHalf",
       [](IO& io, A&, V& v) {
         v = V::kV1;
         io.x = Filled(DataType::kFloat16, {2, 2, 2, 2}, 1.0);
       },
       "Value for attr 'T' of half is not in the list of allowed values: float, double"},
      {"V2ScaleType",
       [](IO& io, A&, V& v) {
         v = V::kV2;
         io.scale = Filled(DataType::kFloat64, {2}, 1.0);
       },
       "Value for attr 'U' of double is not in the list of allowed values: float"},
      {"V2OffsetType",
       [](IO& io, A&, V& v) {
         v = V::kV2;
         io.offset = Filled(DataType::kFloat64, {2}, 1.0);
       },
       "cannot compute FusedBatchNormV2 as input #2(zero-based) was expected to be a float "
       "tensor but is a double tensor"},
      {"V1MeanType",
       [](IO& io, A&, V& v) {
         v = V::kV1;
         io.mean = Filled(DataType::kFloat16, {2}, 1.0);
       },
       "cannot compute FusedBatchNorm as input #3(zero-based) was expected to be a float tensor "
       "but is a half tensor"},
      {"V2FiveDimFormat",
       [](IO&, A& a, V& v) {
         v = V::kV2;
         a.data_format = TensorFormat::kNDHWC;
       },
       "Value for attr 'data_format' of \"NDHWC\" is not in the list of allowed values: "
       "\"NHWC\", \"NCHW\""},
      // fbn's own checks on the views.
      {"NegativeDim",
       [](IO& io, A&, V&) {
         io.x = HostTensor(DataType::kFloat32, {2, -1, 2, 2});
       },
       "x has a negative dimension: [2,-1,2,2]"},
  };
}

void PrintTo(const ForwardErrorCase& c, std::ostream* os) { *os << c.name; }

class ForwardErrorTest : public ::testing::TestWithParam<ForwardErrorCase> {};

TEST_P(ForwardErrorTest, ReportsTensorFlowTextAndWritesNothing) {
  const ForwardErrorCase& c = GetParam();
  ForwardIO io = ValidForward();
  FusedBatchNormAttrs attrs = Attrs(true);
  OpVersion version = OpVersion::kV3;
  ASSERT_NO_FATAL_FAILURE(io.AllocateOutputs(version, attrs));
  c.mutate(io, attrs, version);
  HostTensor* outs[] = {&io.y, &io.batch_mean, &io.batch_variance, &io.rs1, &io.rs2, &io.rs3};
  for (HostTensor* t : outs) t->FillBytes(kSentinel);
  std::vector<std::vector<unsigned char>> before;
  for (HostTensor* t : outs) before.push_back(t->RawBytes());

  TensorSpec specs[fbn::kMaxOpOutputs];
  int n = -1;
  EXPECT_TRUE(IsInvalidArgument(
      fbn::FusedBatchNormOutputSpecs(version, io.Inputs(), attrs, specs, &n), c.message));
  EXPECT_EQ(n, -1);
  EXPECT_TRUE(
      IsInvalidArgument(fbn::FusedBatchNorm(version, io.Inputs(), attrs, io.Outputs()), c.message));
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(outs[i]->RawBytes(), before[i]) << "output " << i << " was written";
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, ForwardErrorTest, ::testing::ValuesIn(ForwardErrorCases()),
                         [](const ::testing::TestParamInfo<ForwardErrorCase>& p) {
                           return std::string(p.param.name);
                         });

TEST(ForwardErrors, NullInputPointer) {
  ForwardIO io = ValidForward();
  const auto attrs = Attrs(true);
  ASSERT_NO_FATAL_FAILURE(io.AllocateOutputs(OpVersion::kV3, attrs));
  fbn::FusedBatchNormInputs in = io.Inputs();
  in.x.data = nullptr;
  EXPECT_TRUE(IsInvalidArgument(fbn::FusedBatchNorm(OpVersion::kV3, in, attrs, io.Outputs()),
                                "x has 16 elements but a null data pointer"));
  // An empty tensor may have a null pointer (mean/variance of shape [0] in training).
  in = io.Inputs();
  in.mean = {nullptr, DataType::kFloat32, Shape{0}};
  in.variance = {nullptr, DataType::kFloat32, Shape{0}};
  const Status s = fbn::FusedBatchNorm(OpVersion::kV3, in, attrs, io.Outputs());
  EXPECT_TRUE(s.ok()) << s.ToString();
}

// Output views that do not match the specs.
struct OutputErrorCase {
  const char* name;
  OpVersion version;
  std::function<void(fbn::FusedBatchNormOutputs&)> mutate;
  std::string message;
};

TEST(ForwardErrors, OutputViewMismatchWritesNothing) {
  const std::vector<OutputErrorCase> cases = {
      {"YDtype", OpVersion::kV3, [](auto& o) { o.y.dtype = DataType::kFloat16; },
       "output y must have dtype float and shape [2,2,2,2], got dtype half and shape "
       "[2,2,2,2]"},
      {"YShape", OpVersion::kV3,
       [](auto& o) {
         o.y.shape = Shape{2, 2, 4};
       },
       "output y must have dtype float and shape [2,2,2,2], got dtype float and shape [2,2,4]"},
      {"BatchVarianceShape", OpVersion::kV3, [](auto& o) { o.batch_variance.shape = Shape{3}; },
       "output batch_variance must have dtype float and shape [2], got dtype float and shape "
       "[3]"},
      // The last output is checked before anything is written.
      {"ReserveSpace3Shape", OpVersion::kV3, [](auto& o) { o.reserve_space_3.shape = Shape{1}; },
       "output reserve_space_3 must have dtype float and shape [], got dtype float and shape "
       "[1]"},
      {"ReserveSpace2Null", OpVersion::kV2, [](auto& o) { o.reserve_space_2.data = nullptr; },
       "output reserve_space_2 has a null data pointer"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    ForwardIO io = ValidForward();
    const auto attrs = Attrs(true);
    ASSERT_NO_FATAL_FAILURE(io.AllocateOutputs(OpVersion::kV3, attrs));
    HostTensor* outs[] = {&io.y, &io.batch_mean, &io.batch_variance, &io.rs1, &io.rs2, &io.rs3};
    for (HostTensor* t : outs) t->FillBytes(kSentinel);
    std::vector<std::vector<unsigned char>> before;
    for (HostTensor* t : outs) before.push_back(t->RawBytes());
    fbn::FusedBatchNormOutputs o = io.Outputs();
    c.mutate(o);
    EXPECT_TRUE(
        IsInvalidArgument(fbn::FusedBatchNorm(c.version, io.Inputs(), attrs, o), c.message));
    for (size_t i = 0; i < before.size(); ++i) {
      EXPECT_EQ(outs[i]->RawBytes(), before[i]) << "output " << i << " was written";
    }
  }
}

TEST(ForwardErrors, V1AndV2IgnoreReserveSpace3) {
  for (OpVersion v : {OpVersion::kV1, OpVersion::kV2}) {
    ForwardIO io = ValidForward();
    const auto attrs = Attrs(true);
    ASSERT_NO_FATAL_FAILURE(io.AllocateOutputs(v, attrs));
    fbn::FusedBatchNormOutputs o = io.Outputs();
    o.reserve_space_3 = {nullptr, DataType::kFloat64, Shape{9, 9}};
    const Status s = fbn::FusedBatchNorm(v, io.Inputs(), attrs, o);
    EXPECT_TRUE(s.ok()) << s.ToString();
  }
}

struct GradErrorCase {
  const char* name;
  std::function<void(GradIO&, FusedBatchNormGradAttrs&, OpVersion&)> mutate;
  std::string message;
};

GradIO ValidGrad() {
  GradIO io;
  io.dy = io.x = F32({2, 2, 2, 2});
  io.scale = io.rs1 = io.rs2 = F32({2});
  io.rs3 = F32({});
  return io;
}

std::vector<GradErrorCase> GradErrorCases() {
  using IO = GradIO;
  using A = FusedBatchNormGradAttrs;
  using V = OpVersion;
  const std::string same = " must have the same number of elements as the channels of x, got ";
  return {
      // tf-semantics §5.1, in order.
      {"DyRank3",
       [](IO& io, A&, V&) {
         io.dy = F32({2, 2, 2});
       },
       "input must be 4 or 5-dimensional[2,2,2]"},
      {"XRank6",
       [](IO& io, A&, V&) {
         io.x = F32({1, 2, 2, 2, 2, 2});
       },
       "input must be 4 or 5-dimensional[1,2,2,2,2,2]"},
      {"ScaleRank2",
       [](IO& io, A&, V&) {
         io.scale = F32({2, 1});
       },
       "scale must be 1-dimensional[2,1]"},
      {"SavedMeanRank0", [](IO& io, A&, V&) { io.rs1 = F32({}); },
       "saved mean must be 1-dimensional[]"},
      {"SavedVarianceRank2",
       [](IO& io, A&, V&) {
         io.rs2 = F32({1, 2});
       },
       "saved variance must be 1-dimensional[1,2]"},
      // testEagerShapeGradErrors (tf-tests §A).
      {"ShapeMismatch",
       [](IO& io, A&, V&) {
         io.dy = F32({2, 2, 2, 3});
       },
       "x and y_backprop must have same shape, but x has shape [2,2,2,2] and y_backprop has "
       "shape [2,2,2,3]"},
      {"ScaleCount", [](IO& io, A&, V&) { io.scale = F32({3}); }, "scale" + same + "3 and 2"},
      {"ReserveSpace1Count", [](IO& io, A&, V&) { io.rs1 = F32({3}); },
       "reserve_space_1" + same + "3 and 2"},
      {"ReserveSpace2Count", [](IO& io, A&, V&) { io.rs2 = F32({3}); },
       "reserve_space_2" + same + "3 and 2"},
      {"ShapeBeforeCounts",
       [](IO& io, A&, V&) {
         io.dy = F32({2, 2, 2, 3});
         io.scale = F32({5});
       },
       "x and y_backprop must have same shape, but x has shape [2,2,2,2] and y_backprop has "
       "shape [2,2,2,3]"},
      {"ChannelsFirst",
       [](IO& io, A& a, V&) {
         a.data_format = TensorFormat::kNCHW;
         io.dy = io.x = F32({2, 3, 2, 2});
       },
       "scale" + same + "2 and 3"},
      {"ChannelsFirstInference",
       [](IO& io, A& a, V&) {
         a.is_training = false;
         a.data_format = TensorFormat::kNCDHW;
         io.dy = io.x = F32({2, 3, 2, 2, 1});
       },
       "scale" + same + "2 and 3"},
      {"V1RejectsBFloat16",
       [](IO& io, A&, V& v) {
         v = V::kV1;
         io.dy = io.x = Filled(DataType::kBFloat16, {2, 2, 2, 2}, 1.0);
       },
       "Value for attr 'T' of bfloat16 is not in the list of allowed values: float, double"},
      {"XTypeDiffersFromDy",
       [](IO& io, A&, V&) {
         io.x = Filled(DataType::kFloat16, {2, 2, 2, 2}, 1.0);
       },
       "cannot compute FusedBatchNormGradV3 as input #1(zero-based) was expected to be a float "
       "tensor but is a half tensor"},
  };
}

void PrintTo(const GradErrorCase& c, std::ostream* os) { *os << c.name; }

class GradErrorTest : public ::testing::TestWithParam<GradErrorCase> {};

TEST_P(GradErrorTest, ReportsTensorFlowTextAndWritesNothing) {
  const GradErrorCase& c = GetParam();
  GradIO io = ValidGrad();
  FusedBatchNormGradAttrs attrs = GradAttrs(true);
  OpVersion version = OpVersion::kV3;
  ASSERT_NO_FATAL_FAILURE(io.AllocateOutputs(version, attrs));
  c.mutate(io, attrs, version);
  HostTensor* outs[] = {&io.dx, &io.dscale, &io.doffset};
  for (HostTensor* t : outs) t->FillBytes(kSentinel);
  std::vector<std::vector<unsigned char>> before;
  for (HostTensor* t : outs) before.push_back(t->RawBytes());
  TensorSpec specs[fbn::kMaxOpOutputs];
  int n = -1;
  EXPECT_TRUE(IsInvalidArgument(
      fbn::FusedBatchNormGradOutputSpecs(version, io.Inputs(), attrs, specs, &n), c.message));
  EXPECT_TRUE(IsInvalidArgument(fbn::FusedBatchNormGrad(version, io.Inputs(), attrs, io.Outputs()),
                                c.message));
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(outs[i]->RawBytes(), before[i]) << "output " << i << " was written";
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, GradErrorTest, ::testing::ValuesIn(GradErrorCases()),
                         [](const ::testing::TestParamInfo<GradErrorCase>& p) {
                           return std::string(p.param.name);
                         });

TEST(GradErrors, ReserveSpace3IsNotValidated) {
  GradIO io = ValidGrad();
  io.rs3 = F32({7, 3});
  const auto attrs = GradAttrs(true);
  ASSERT_NO_FATAL_FAILURE(io.AllocateOutputs(OpVersion::kV3, attrs));
  const Status s = fbn::FusedBatchNormGrad(OpVersion::kV3, io.Inputs(), attrs, io.Outputs());
  EXPECT_TRUE(s.ok()) << s.ToString();
}

TEST(GradErrors, OutputViewMismatchNamesTheOutput) {
  for (OpVersion v : kAllVersions) {
    GradIO io = ValidGrad();
    const auto attrs = GradAttrs(true);
    ASSERT_NO_FATAL_FAILURE(io.AllocateOutputs(v, attrs));
    io.dx.FillBytes(kSentinel);
    const auto before = io.dx.RawBytes();
    fbn::FusedBatchNormGradOutputs o = io.Outputs();
    o.reserve_space_b.shape = Shape{2};
    // The placeholders are reserve_space_3/4 for V1/V2 and reserve_space_4/5 for V3.
    const std::string name = v == OpVersion::kV3 ? "reserve_space_5" : "reserve_space_4";
    EXPECT_TRUE(IsInvalidArgument(fbn::FusedBatchNormGrad(v, io.Inputs(), attrs, o),
                                  "output " + name +
                                      " must have dtype float and shape [0], got dtype float and "
                                      "shape [2]"));
    EXPECT_EQ(io.dx.RawBytes(), before);
    o = io.Outputs();
    o.scale_backprop.dtype = DataType::kFloat64;
    EXPECT_TRUE(IsInvalidArgument(fbn::FusedBatchNormGrad(v, io.Inputs(), attrs, o),
                                  "output scale_backprop must have dtype float and shape [2], got "
                                  "dtype double and shape [2]"));
  }
}

// ---------------------------------------------------------------------------------------------
// Edge cases.

TEST(FusedBatchNormEdge, EmptyBatchGivesNaNStatistics) {
  const std::vector<std::pair<TensorFormat, Shape>> cases = {
      {TensorFormat::kNHWC, Shape{0, 3, 5, 6}},
      {TensorFormat::kNCHW, Shape{0, 6, 3, 5}},
      {TensorFormat::kNDHWC, Shape{2, 0, 3, 5, 6}},
      {TensorFormat::kNCDHW, Shape{2, 6, 3, 0, 5}}};
  for (const auto& [format, shape] : cases) {
    for (DataType t : kAllDtypes) {
      for (bool training : {true, false}) {
        for (float factor : {1.0f, 0.5f}) {
          SCOPED_TRACE(FormatTag(format) + " " + DTypeTag(t) + (training ? " training" : "") +
                       " factor " + std::to_string(factor));
          const DataType u = StatsType(t);
          ForwardIO io;
          io.x = HostTensor(t, shape);
          io.scale = io.offset = io.mean = io.variance = Filled(u, Shape{6}, 1.0);
          const auto attrs = Attrs(training, factor, format);
          ASSERT_NO_FATAL_FAILURE(io.AllocateOutputs(OpVersion::kV3, attrs));
          ASSERT_EQ(io.y.size(), 0);
          const Status s = fbn::FusedBatchNorm(OpVersion::kV3, io.Inputs(), attrs, io.Outputs());
          ASSERT_TRUE(s.ok()) << s.ToString();
          for (int c = 0; c < 6; ++c) {
            EXPECT_TRUE(std::isnan(io.batch_mean.Get(c)));
            EXPECT_TRUE(std::isnan(io.batch_variance.Get(c)));
          }
          EXPECT_EQ(io.rs3.Get(0), 0.0);
        }
      }
    }
  }
}

// TensorFlow sums plainly: a channel holding +Inf has mean +Inf, one holding both signs NaN; the
// variance and y of such a channel are NaN. Covers the channels-last rows, the channels-first
// fused per-channel path and the split (multi-task) channels-first path.
// Runs a V3 training forward of io.x (C channels; +inf in channel 0, -inf in channel 1, both in
// channel 2) and checks the batch means: inf, -inf, NaN.
void TrainWithInfinities(DataType u, int64_t C, TensorFormat format, ForwardIO& io) {
  io.scale = io.offset = io.mean = io.variance = Filled(u, Shape{C}, 1.0);
  const auto attrs = Attrs(true, 1.0f, format);
  ASSERT_NO_FATAL_FAILURE(io.AllocateOutputs(OpVersion::kV3, attrs));
  const Status s = fbn::FusedBatchNorm(OpVersion::kV3, io.Inputs(), attrs, io.Outputs());
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(io.batch_mean.Get(0), std::numeric_limits<double>::infinity());
  EXPECT_EQ(io.batch_mean.Get(1), -std::numeric_limits<double>::infinity());
  EXPECT_TRUE(std::isnan(io.batch_mean.Get(2)));
}

TEST(FusedBatchNormEdge, InfInXGivesInfMean) {
  const std::vector<std::pair<TensorFormat, Shape>> cases = {
      {TensorFormat::kNHWC, Shape{4, 9, 7, 3}},
      {TensorFormat::kNHWC, Shape{8, 64, 64, 3}},
      {TensorFormat::kNCHW, Shape{2, 3, 5, 7}},
      {TensorFormat::kNCHW, Shape{3, 3, 512, 512}},
      {TensorFormat::kNCDHW, Shape{2, 3, 2, 5, 7}}};
  for (const auto& [format, shape] : cases) {
    for (DataType t : kAllDtypes) {
      SCOPED_TRACE(FormatTag(format) + " " + DTypeTag(t));
      const DataType u = StatsType(t);
      ForwardIO io;
      io.x = Filled(t, shape, 0.5);
      const int64_t n = io.x.size();
      const bool last = ChannelsLast(format);
      // Element k of channel c: the k-th element of that channel in memory order.
      const int64_t spatial = last ? 1 : n / (shape.dim(0) * 3);
      auto index = [&](int64_t c, int64_t k) {
        return last ? k * 3 + c : ((k / spatial) * 3 + c) * spatial + k % spatial;
      };
      io.x.Set(index(0, n / 3 - 1), std::numeric_limits<double>::infinity());
      io.x.Set(index(1, n / 6), -std::numeric_limits<double>::infinity());
      io.x.Set(index(2, 0), std::numeric_limits<double>::infinity());
      io.x.Set(index(2, n / 3 - 1), -std::numeric_limits<double>::infinity());
      ASSERT_NO_FATAL_FAILURE(TrainWithInfinities(u, 3, format, io));
      EXPECT_EQ(io.rs1.Get(0), std::numeric_limits<double>::infinity());
      for (int c = 0; c < 3; ++c) EXPECT_TRUE(std::isnan(io.batch_variance.Get(c)));
      EXPECT_TRUE(std::isnan(io.y.Get(index(0, 1))));
    }
  }
}

// The same on a 2-4 MB channels-last tensor of wide rows (two-sweep statistics where the L3 is a
// victim cache): the merged mean and the deviations about it carry the infinities.
TEST(FusedBatchNormEdge, InfInWideRowsGivesInfMean) {
  const Shape shape{8, 16, 16, 256};
  for (DataType t : kAllDtypes) {
    SCOPED_TRACE(DTypeTag(t));
    const DataType u = StatsType(t);
    ForwardIO io;
    io.x = Filled(t, shape, 0.5);
    const int64_t rows = io.x.size() / 256;
    io.x.Set((rows - 1) * 256 + 0, std::numeric_limits<double>::infinity());
    io.x.Set(rows / 2 * 256 + 1, -std::numeric_limits<double>::infinity());
    io.x.Set(2, std::numeric_limits<double>::infinity());
    io.x.Set((rows - 1) * 256 + 2, -std::numeric_limits<double>::infinity());
    ASSERT_NO_FATAL_FAILURE(TrainWithInfinities(u, 256, TensorFormat::kNHWC, io));
    for (int c = 0; c < 3; ++c) EXPECT_TRUE(std::isnan(io.batch_variance.Get(c))) << c;
    EXPECT_EQ(io.batch_mean.Get(3), 0.5);
    EXPECT_EQ(io.batch_variance.Get(3), 0.0);
  }
}

TEST(FusedBatchNormEdge, ZeroChannels) {
  for (TensorFormat format : kAllFormats) {
    SCOPED_TRACE(FormatTag(format));
    const Shape x = MakeShape(
        format, 2, 0, Is5D(format) ? std::vector<int64_t>{3, 1, 2} : std::vector<int64_t>{3, 4});
    for (bool training : {true, false}) {
      ForwardIO io;
      io.x = HostTensor(DataType::kFloat32, x);
      io.scale = io.offset = io.mean = io.variance = HostTensor(DataType::kFloat32, Shape{0});
      const auto attrs = Attrs(training, 1.0f, format);
      ASSERT_NO_FATAL_FAILURE(io.AllocateOutputs(OpVersion::kV3, attrs));
      EXPECT_EQ(io.batch_mean.shape(), Shape{0});
      Status s = fbn::FusedBatchNorm(OpVersion::kV3, io.Inputs(), attrs, io.Outputs());
      EXPECT_TRUE(s.ok()) << s.ToString();
      GradIO g;
      g.dy = g.x = HostTensor(DataType::kFloat32, x);
      g.scale = g.rs1 = g.rs2 = HostTensor(DataType::kFloat32, Shape{0});
      g.rs3 = HostTensor(DataType::kFloat32, Shape{});
      const auto gattrs = GradAttrs(training, format);
      ASSERT_NO_FATAL_FAILURE(g.AllocateOutputs(OpVersion::kV3, gattrs));
      s = fbn::FusedBatchNormGrad(OpVersion::kV3, g.Inputs(), gattrs, g.Outputs());
      EXPECT_TRUE(s.ok()) << s.ToString();
    }
  }
}

TEST(FusedBatchNormEdge, EmptyBatchGradientIsZero) {
  for (TensorFormat format : kAllFormats) {
    for (DataType t : kAllDtypes) {
      for (bool training : {true, false}) {
        SCOPED_TRACE(FormatTag(format) + " " + DTypeTag(t) + (training ? " training" : ""));
        const Shape x =
            MakeShape(format, 0, 5,
                      Is5D(format) ? std::vector<int64_t>{2, 3, 1} : std::vector<int64_t>{3, 7});
        const DataType u = StatsType(t);
        GradIO g;
        g.dy = g.x = HostTensor(t, x);
        g.scale = g.rs1 = g.rs2 = Filled(u, Shape{5}, 1.0);
        g.rs3 = HostTensor(u, Shape{});
        const auto attrs = GradAttrs(training, format);
        ASSERT_NO_FATAL_FAILURE(g.AllocateOutputs(OpVersion::kV3, attrs));
        g.dscale.FillBytes(kSentinel);
        g.doffset.FillBytes(kSentinel);
        const Status s = fbn::FusedBatchNormGrad(OpVersion::kV3, g.Inputs(), attrs, g.Outputs());
        ASSERT_TRUE(s.ok()) << s.ToString();
        for (int c = 0; c < 5; ++c) {
          EXPECT_EQ(g.dscale.Get(c), 0.0);
          EXPECT_EQ(g.doffset.Get(c), 0.0);
        }
      }
    }
  }
}

// n = 1 per channel: variance 0, Bessel factor 1 (not a division by zero), y = offset.
TEST(FusedBatchNormEdge, SingleElementPerChannel) {
  for (TensorFormat format : kAllFormats) {
    for (DataType t : kAllDtypes) {
      SCOPED_TRACE(FormatTag(format) + " " + DTypeTag(t));
      const int64_t C = 17;
      const Shape xs = MakeShape(
          format, 1, C, Is5D(format) ? std::vector<int64_t>{1, 1, 1} : std::vector<int64_t>{1, 1});
      std::mt19937 rng(7);
      const DataType u = StatsType(t);
      ForwardIO io;
      io.x = RandomTensor(t, xs, -5, 5, &rng);
      io.scale = RandomTensor(u, Shape{C}, -2, 2, &rng);
      io.offset = RandomTensor(u, Shape{C}, -2, 2, &rng);
      io.mean = io.variance = HostTensor(u, Shape{0});
      const auto attrs = Attrs(true, 1.0f, format);
      ASSERT_NO_FATAL_FAILURE(io.AllocateOutputs(OpVersion::kV3, attrs));
      const Status s = fbn::FusedBatchNorm(OpVersion::kV3, io.Inputs(), attrs, io.Outputs());
      ASSERT_TRUE(s.ok()) << s.ToString();
      for (int64_t c = 0; c < C; ++c) {
        EXPECT_EQ(io.y.Get(c), RoundTo(t, io.offset.Get(c))) << c;
        EXPECT_EQ(io.batch_mean.Get(c), io.x.Get(c)) << c;
        EXPECT_EQ(io.batch_variance.Get(c), 0.0) << c;
        EXPECT_EQ(io.rs2.Get(c), 0.0) << c;
      }
    }
  }
}

// y may reuse x's buffer, and batch_mean/batch_variance the mean/variance inputs' buffers, as
// TensorFlow's kernel allows (forward_input_or_allocate_output).
TEST(FusedBatchNormEdge, OutputsMayAliasInputs) {
  for (TensorFormat format : {TensorFormat::kNHWC, TensorFormat::kNCHW}) {
    for (DataType t : kAllDtypes) {
      for (bool training : {true, false}) {
        SCOPED_TRACE(FormatTag(format) + " " + DTypeTag(t) + (training ? " training" : ""));
        const int64_t C = 19;
        const Shape xs = MakeShape(format, 3, C, {5, 7});
        std::mt19937 rng(11);
        const DataType u = StatsType(t);
        ForwardIO io;
        io.x = RandomX(t, xs, format, &rng);
        io.scale = RandomTensor(u, Shape{C}, -2, 2, &rng);
        io.offset = RandomTensor(u, Shape{C}, -2, 2, &rng);
        io.mean = RandomTensor(u, Shape{C}, -1, 1, &rng);
        io.variance = RandomTensor(u, Shape{C}, 0.5, 2, &rng);
        const auto attrs = Attrs(training, 0.25f, format);
        ASSERT_NO_FATAL_FAILURE(io.AllocateOutputs(OpVersion::kV3, attrs));
        Status s = fbn::FusedBatchNorm(OpVersion::kV3, io.Inputs(), attrs, io.Outputs());
        ASSERT_TRUE(s.ok()) << s.ToString();

        ForwardIO alias = io;  // copies of the inputs, written in place
        fbn::FusedBatchNormOutputs o = alias.Outputs();
        o.y.data = alias.x.data();
        o.batch_mean.data = alias.mean.data();
        o.batch_variance.data = alias.variance.data();
        s = fbn::FusedBatchNorm(OpVersion::kV3, alias.Inputs(), attrs, o);
        ASSERT_TRUE(s.ok()) << s.ToString();
        EXPECT_TRUE(alias.x.BytesEqual(io.y));
        EXPECT_TRUE(alias.mean.BytesEqual(io.batch_mean));
        EXPECT_TRUE(alias.variance.BytesEqual(io.batch_variance));
      }
    }
  }
}

// All three versions compute the same thing; they differ in types, formats and output count.
TEST(FusedBatchNormEdge, VersionsAgree) {
  std::mt19937 rng(3);
  const Shape xs{2, 3, 5, 6};
  ForwardIO base;
  base.x = RandomX(DataType::kFloat32, xs, TensorFormat::kNHWC, &rng);
  base.scale = RandomTensor(DataType::kFloat32, Shape{6}, -2, 2, &rng);
  base.offset = RandomTensor(DataType::kFloat32, Shape{6}, -2, 2, &rng);
  base.mean = RandomTensor(DataType::kFloat32, Shape{6}, -1, 1, &rng);
  base.variance = RandomTensor(DataType::kFloat32, Shape{6}, 0.5, 2, &rng);
  for (bool training : {true, false}) {
    const auto attrs = Attrs(training, 0.3f);
    std::vector<ForwardIO> runs;
    for (OpVersion v : kAllVersions) {
      ForwardIO io = base;
      ASSERT_NO_FATAL_FAILURE(io.AllocateOutputs(v, attrs));
      const Status s = fbn::FusedBatchNorm(v, io.Inputs(), attrs, io.Outputs());
      ASSERT_TRUE(s.ok()) << s.ToString();
      runs.push_back(io);
    }
    for (size_t i = 1; i < runs.size(); ++i) {
      EXPECT_TRUE(runs[i].y.BytesEqual(runs[0].y));
      EXPECT_TRUE(runs[i].batch_mean.BytesEqual(runs[0].batch_mean));
      EXPECT_TRUE(runs[i].batch_variance.BytesEqual(runs[0].batch_variance));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Sweep against the float64 reference: dtype x format (one test each), and inside every test all
// channel counts (1, 3, 17, 64, 67: below, at and around the vector widths) and three shapes with
// odd spatial sizes (the last one spans several reduction blocks and tasks).

using SweepParam = std::tuple<DataType, TensorFormat>;

struct SweepCase {
  int64_t c;
  int shape;
};

Shape SweepShape(TensorFormat f, const SweepCase& p) {
  static const int64_t kBatch[] = {2, 3, 4};
  static const std::vector<int64_t> k4d[] = {{3, 5}, {1, 7}, {17, 33}};
  static const std::vector<int64_t> k5d[] = {{3, 1, 5}, {1, 7, 1}, {3, 11, 17}};
  return MakeShape(f, kBatch[p.shape], p.c, Is5D(f) ? k5d[p.shape] : k4d[p.shape]);
}

// Runs check(shape, seed) for every channel count and shape.
template <typename F>
void ForEachSweepCase(const SweepParam& param, uint32_t salt, F&& check) {
  const auto [t, f] = param;
  for (int64_t c : {1, 3, 17, 64, 67}) {
    for (int s = 0; s < 3; ++s) {
      const Shape xs = SweepShape(f, {c, s});
      SCOPED_TRACE(DTypeTag(t) + " " + FormatTag(f) + " x " + xs.DebugString());
      check(xs, static_cast<uint32_t>(1000 * static_cast<int>(t) + 100 * static_cast<int>(f) +
                                      10 * c + s) *
                        4 +
                    salt);
    }
  }
}

class ReferenceSweep : public ::testing::TestWithParam<SweepParam> {};

TEST_P(ReferenceSweep, ForwardTraining) {
  // (Not a structured binding: clang 14 cannot capture those.)
  const DataType t = std::get<0>(GetParam());
  const TensorFormat f = std::get<1>(GetParam());
  ForEachSweepCase(GetParam(), 0,
                   [&](const Shape& xs, uint32_t seed) { CheckForwardTraining(t, f, xs, seed); });
}

TEST_P(ReferenceSweep, ForwardInference) {
  const DataType t = std::get<0>(GetParam());
  const TensorFormat f = std::get<1>(GetParam());
  ForEachSweepCase(GetParam(), 1,
                   [&](const Shape& xs, uint32_t seed) { CheckForwardInference(t, f, xs, seed); });
}

TEST_P(ReferenceSweep, GradTraining) {
  const DataType t = std::get<0>(GetParam());
  const TensorFormat f = std::get<1>(GetParam());
  ForEachSweepCase(GetParam(), 2,
                   [&](const Shape& xs, uint32_t seed) { CheckGrad(t, f, xs, true, seed); });
}

TEST_P(ReferenceSweep, GradInference) {
  const DataType t = std::get<0>(GetParam());
  const TensorFormat f = std::get<1>(GetParam());
  ForEachSweepCase(GetParam(), 3,
                   [&](const Shape& xs, uint32_t seed) { CheckGrad(t, f, xs, false, seed); });
}

std::string SweepName(const ::testing::TestParamInfo<SweepParam>& info) {
  return DTypeTag(std::get<0>(info.param)) + "_" + FormatTag(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(All, ReferenceSweep,
                         ::testing::Combine(::testing::ValuesIn(kAllDtypes),
                                            ::testing::ValuesIn(kAllFormats)),
                         SweepName);

// ---------------------------------------------------------------------------------------------
// NCHW and NHWC (and NCDHW/NDHWC) give the same numbers for transposed data (tf-semantics §3: the
// CPU kernel transposes channels-first to channels-last). The two runs sum in different orders,
// so each result is held to the reference tolerance of the other.

// Wide channels-last tensors with few rows (batch-1 7x7x2051): the reductions split the
// channels into groups (multiples of 64 channels; the last one ends in a tail of 3).
TEST(ReferenceWideFewRows, AllPasses) {
  for (DataType t : kAllDtypes) {
    SCOPED_TRACE(DTypeTag(t));
    const Shape xs{1, 7, 7, 2051};
    CheckForwardTraining(t, TensorFormat::kNHWC, xs, 11);
    CheckForwardInference(t, TensorFormat::kNHWC, xs, 12);
    CheckGrad(t, TensorFormat::kNHWC, xs, true, 13);
    CheckGrad(t, TensorFormat::kNHWC, xs, false, 14);
  }
}

class LayoutEquivalence : public ::testing::TestWithParam<std::tuple<DataType, TensorFormat>> {};

TEST_P(LayoutEquivalence, SameNumbers) {
  const auto [t, last] = GetParam();
  const TensorFormat first = ChannelsFirstOf(last);
  const int64_t C = 7;
  const std::vector<int64_t> spatial =
      Is5D(last) ? std::vector<int64_t>{3, 5, 3} : std::vector<int64_t>{5, 9};
  const Shape xs = MakeShape(last, 3, C, spatial);
  const DataType u = StatsType(t);
  const double rel = RelTolerance(u);
  std::mt19937 rng(17);
  for (bool training : {true, false}) {
    SCOPED_TRACE(training ? "training" : "inference");
    ForwardIO a;
    a.x = RandomX(t, xs, last, &rng);
    a.scale = RandomTensor(u, Shape{C}, -2, 2, &rng);
    a.offset = RandomTensor(u, Shape{C}, -1, 1, &rng);
    a.mean = RandomTensor(u, Shape{C}, -1, 1, &rng);
    a.variance = RandomTensor(u, Shape{C}, 0.5, 2, &rng);
    ForwardIO b = a;
    b.x = ToChannelsFirst(a.x);
    const auto attrs_a = Attrs(training, 0.5f, last);
    const auto attrs_b = Attrs(training, 0.5f, first);
    ASSERT_NO_FATAL_FAILURE(a.AllocateOutputs(OpVersion::kV3, attrs_a));
    ASSERT_NO_FATAL_FAILURE(b.AllocateOutputs(OpVersion::kV3, attrs_b));
    ASSERT_TRUE(fbn::FusedBatchNorm(OpVersion::kV3, a.Inputs(), attrs_a, a.Outputs()).ok());
    ASSERT_TRUE(fbn::FusedBatchNorm(OpVersion::kV3, b.Inputs(), attrs_b, b.Outputs()).ok());
    const RefLayout l = LayoutOf(xs, last);
    const auto x = a.x.ToVector();
    const auto var = training ? RefBatchNormTraining(l, x, a.scale.ToVector(), a.offset.ToVector(),
                                                     {}, {}, kEpsilon, 1.0)
                                    .saved_variance
                              : a.variance.ToVector();
    auto ybound = YBound(l, x, a.scale.ToVector(), a.offset.ToVector(), var);
    for (double& v : ybound) v *= 2;  // both sides carry their own error
    const HostTensor ya = ToChannelsFirst(a.y);
    EXPECT_TRUE(AllNearRef(b.y, ya.ToVector(), ybound, rel));
    // Blended statistics: the old value's term plus the batch's (f = 0.5).
    const auto maxabs = MaxAbsPerChannel(l, x);
    std::vector<double> mb(C), vb(C);
    for (int64_t c = 0; c < C; ++c) {
      mb[c] = 2 * (maxabs[c] + std::fabs(a.mean.Get(c)));
      vb[c] = 2 * (std::fabs(a.batch_variance.Get(c)) + std::fabs(a.variance.Get(c)));
    }
    EXPECT_TRUE(AllNearRef(b.batch_mean, a.batch_mean.ToVector(), mb, rel));
    EXPECT_TRUE(AllNearRef(b.batch_variance, a.batch_variance.ToVector(), vb, rel));

    // Gradients, with a's saved statistics.
    GradIO ga;
    ga.dy = RandomTensor(t, xs, -1, 1, &rng);
    ga.x = a.x;
    ga.scale = a.scale;
    ga.rs1 = a.rs1;
    ga.rs2 = a.rs2;
    ga.rs3 = a.rs3;
    GradIO gb = ga;
    gb.dy = ToChannelsFirst(ga.dy);
    gb.x = b.x;
    const auto gattrs_a = GradAttrs(training, last);
    const auto gattrs_b = GradAttrs(training, first);
    ASSERT_NO_FATAL_FAILURE(ga.AllocateOutputs(OpVersion::kV3, gattrs_a));
    ASSERT_NO_FATAL_FAILURE(gb.AllocateOutputs(OpVersion::kV3, gattrs_b));
    ASSERT_TRUE(fbn::FusedBatchNormGrad(OpVersion::kV3, ga.Inputs(), gattrs_a, ga.Outputs()).ok());
    ASSERT_TRUE(fbn::FusedBatchNormGrad(OpVersion::kV3, gb.Inputs(), gattrs_b, gb.Outputs()).ok());
    const auto dy = ga.dy.ToVector();
    const RefGrad ref =
        training ? RefBatchNormGradTraining(l, dy, x, ga.scale.ToVector(), ga.rs1.ToVector(),
                                            ga.rs2.ToVector(), kEpsilon)
                 : RefBatchNormGradInference(l, dy, x, ga.scale.ToVector(), ga.rs1.ToVector(),
                                             ga.rs2.ToVector(), kEpsilon);
    auto twice = [](std::vector<double> v) {
      for (double& e : v) e *= 2;
      return v;
    };
    // dx's bound in channels-first order.
    HostTensor dxb(DataType::kFloat64, xs);
    dxb.FromVector(twice(ref.dx_bound));
    EXPECT_TRUE(
        AllNearRef(gb.dx, ToChannelsFirst(ga.dx).ToVector(), ToChannelsFirst(dxb).ToVector(), rel));
    EXPECT_TRUE(AllNearRef(gb.dscale, ga.dscale.ToVector(), twice(ref.dscale_bound), rel));
    EXPECT_TRUE(AllNearRef(gb.doffset, ga.doffset.ToVector(), twice(ref.doffset_bound), rel));
  }
}

INSTANTIATE_TEST_SUITE_P(All, LayoutEquivalence,
                         ::testing::Combine(::testing::ValuesIn(kAllDtypes),
                                            ::testing::Values(TensorFormat::kNHWC,
                                                              TensorFormat::kNDHWC)),
                         [](const ::testing::TestParamInfo<std::tuple<DataType, TensorFormat>>& p) {
                           return DTypeTag(std::get<0>(p.param)) + "_" +
                                  FormatTag(std::get<1>(p.param));
                         });

// Statistics of data far from zero: fbn's two-pass reduction keeps the variance accurate where
// E[x^2] - E[x]^2 in float would lose every digit.
// The 4 MB channels-last shape takes the two-sweep statistics where the L3 is a victim cache.
TEST(FusedBatchNormAccuracy, LargeOffsetVariance) {
  struct Case {
    TensorFormat format;
    int64_t n, c;
    std::vector<int64_t> spatial;
  };
  for (const Case& k :
       {Case{TensorFormat::kNHWC, 8, 5, {31, 33}}, Case{TensorFormat::kNCHW, 8, 5, {31, 33}},
        Case{TensorFormat::kNHWC, 16, 260, {16, 16}}}) {
    const TensorFormat format = k.format;
    SCOPED_TRACE(FormatTag(format) + " C=" + std::to_string(k.c));
    const int64_t C = k.c;
    const Shape xs = MakeShape(format, k.n, C, k.spatial);
    std::mt19937 rng(5);
    ForwardIO io;
    io.x = RandomTensor(DataType::kFloat32, xs, 999.0, 1001.0, &rng);
    io.scale = Filled(DataType::kFloat32, Shape{C}, 1.0);
    io.offset = Filled(DataType::kFloat32, Shape{C}, 0.0);
    io.mean = io.variance = HostTensor(DataType::kFloat32, Shape{0});
    const auto attrs = Attrs(true, 1.0f, format);
    ASSERT_NO_FATAL_FAILURE(io.AllocateOutputs(OpVersion::kV3, attrs));
    ASSERT_TRUE(fbn::FusedBatchNorm(OpVersion::kV3, io.Inputs(), attrs, io.Outputs()).ok());
    const RefLayout l = LayoutOf(xs, format);
    const RefForward ref = RefBatchNormTraining(l, io.x.ToVector(), io.scale.ToVector(),
                                                io.offset.ToVector(), {}, {}, kEpsilon, 1.0);
    for (int64_t c = 0; c < C; ++c) {
      EXPECT_NEAR(io.rs2.Get(c), ref.saved_variance[c], 1e-4 * ref.saved_variance[c]) << c;
      EXPECT_NEAR(io.rs1.Get(c), ref.saved_mean[c], 1e-6 * 1000) << c;
    }
  }
}

// float64 x (an fbn extension): double statistics, agreement with the reference to ~1e-12.
TEST(FusedBatchNormAccuracy, Float64MatchesGoldenClosely) {
  ForwardIO io;
  io.x = HostTensor(DataType::kFloat64, Shape{1, 1, 6, 2});
  for (int i = 0; i < 6; ++i) {
    io.x.Set(2 * i, kGoldenX[i]);
    io.x.Set(2 * i + 1, kGoldenX[i]);
  }
  io.scale = Vec(DataType::kFloat64, {4, 4});
  io.offset = Vec(DataType::kFloat64, {2, 2});
  io.mean = io.variance = HostTensor(DataType::kFloat64, Shape{0});
  const auto attrs = Attrs(true);
  for (OpVersion v : kAllVersions) {
    ASSERT_NO_FATAL_FAILURE(io.AllocateOutputs(v, attrs));
    ASSERT_EQ(io.batch_mean.dtype(), DataType::kFloat64);
    const Status s = fbn::FusedBatchNorm(v, io.Inputs(), attrs, io.Outputs());
    ASSERT_TRUE(s.ok()) << s.ToString();
    const double eps = static_cast<double>(kEpsilon);
    for (int i = 0; i < 6; ++i) {
      const double want = (kGoldenX[i] - 10.0) / std::sqrt(70.0 / 6 + eps) * 4 + 2;
      EXPECT_NEAR(io.y.Get(2 * i), want, 1e-12);
    }
    EXPECT_DOUBLE_EQ(io.batch_mean.Get(0), 10.0);
    EXPECT_DOUBLE_EQ(io.batch_variance.Get(1), 14.0);
  }
}

}  // namespace
}  // namespace fbn_test
