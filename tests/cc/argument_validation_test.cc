// Arguments outside their types' meaning: an OpVersion other than kV1..kV3 (any int converts to
// the enum) and Moments' axes count. Each is an InvalidArgument naming the argument, returned
// before any output is written (or *format set).
#include <gtest/gtest.h>

#include <climits>
#include <string>
#include <vector>

#include "fbn/fbn.h"
#include "test_util.h"

namespace fbn_test {
namespace {

using fbn::DataType;
using fbn::OpVersion;
using fbn::Shape;
using fbn::Status;
using fbn::StatusCode;
using fbn::TensorFormat;
using fbn::TensorSpec;

constexpr unsigned char kSentinel = 0xA7;
const int kBadVersions[] = {0, 4, 7, -1, INT_MIN, INT_MAX};

::testing::AssertionResult IsInvalidArgument(const Status& s, const std::string& message) {
  if (s.code() != StatusCode::kInvalidArgument || s.message() != message) {
    return ::testing::AssertionFailure()
           << "got " << s.ToString() << "\nwant InvalidArgument: " << message;
  }
  return ::testing::AssertionSuccess();
}

std::string VersionMessage(const char* function, int v) {
  return std::string(function) +
         ": argument version must be fbn::OpVersion::kV1, kV2 or kV3 (1, 2 or 3), got " +
         std::to_string(v);
}

// A valid V2/V3 forward call (NHWC float, 2 channels) with outputs filled with kSentinel.
ForwardIO ValidForward(const fbn::FusedBatchNormAttrs& attrs) {
  ForwardIO io;
  std::mt19937 rng(7);
  io.x = RandomTensor(DataType::kFloat32, Shape{2, 2, 2, 2}, -1, 1, &rng);
  io.scale = RandomTensor(DataType::kFloat32, Shape{2}, 0.5, 2, &rng);
  io.offset = RandomTensor(DataType::kFloat32, Shape{2}, -1, 1, &rng);
  io.mean = RandomTensor(DataType::kFloat32, Shape{2}, -1, 1, &rng);
  io.variance = RandomTensor(DataType::kFloat32, Shape{2}, 0.5, 2, &rng);
  io.AllocateOutputs(OpVersion::kV3, attrs);
  for (HostTensor* t : {&io.y, &io.batch_mean, &io.batch_variance, &io.rs1, &io.rs2, &io.rs3}) {
    t->FillBytes(kSentinel);
  }
  return io;
}

GradIO ValidGrad(const fbn::FusedBatchNormGradAttrs& attrs) {
  GradIO io;
  std::mt19937 rng(8);
  io.dy = RandomTensor(DataType::kFloat32, Shape{2, 2, 2, 2}, -1, 1, &rng);
  io.x = RandomTensor(DataType::kFloat32, Shape{2, 2, 2, 2}, -1, 1, &rng);
  io.scale = RandomTensor(DataType::kFloat32, Shape{2}, 0.5, 2, &rng);
  io.rs1 = RandomTensor(DataType::kFloat32, Shape{2}, -1, 1, &rng);
  io.rs2 = RandomTensor(DataType::kFloat32, Shape{2}, 0.5, 2, &rng);
  io.rs3 = HostTensor(DataType::kFloat32, Shape{0});
  io.AllocateOutputs(OpVersion::kV3, attrs);
  for (HostTensor* t : {&io.dx, &io.dscale, &io.doffset, &io.rs_a, &io.rs_b}) {
    t->FillBytes(kSentinel);
  }
  return io;
}

bool AllBytesAre(const HostTensor& t, unsigned char byte) {
  for (unsigned char b : t.RawBytes()) {
    if (b != byte) return false;
  }
  return true;
}

TEST(OpVersionArgument, ValidVersionsStillWork) {
  const fbn::FusedBatchNormAttrs attrs;
  for (int v = 1; v <= 3; ++v) {
    ForwardIO io = ValidForward(attrs);
    const Status s =
        fbn::FusedBatchNorm(static_cast<OpVersion>(v), io.Inputs(), attrs, io.Outputs());
    EXPECT_TRUE(s.ok()) << "V" << v << ": " << s.ToString();
  }
}

TEST(OpVersionArgument, FusedBatchNormAndSpecs) {
  for (int v : kBadVersions) {
    SCOPED_TRACE(v);
    const auto version = static_cast<OpVersion>(v);
    const fbn::FusedBatchNormAttrs attrs;
    ForwardIO io = ValidForward(attrs);
    TensorSpec specs[fbn::kMaxOpOutputs];
    int n = -5;
    EXPECT_TRUE(
        IsInvalidArgument(fbn::FusedBatchNormOutputSpecs(version, io.Inputs(), attrs, specs, &n),
                          VersionMessage("FusedBatchNorm", v)));
    EXPECT_EQ(n, -5);
    EXPECT_TRUE(IsInvalidArgument(fbn::FusedBatchNorm(version, io.Inputs(), attrs, io.Outputs()),
                                  VersionMessage("FusedBatchNorm", v)));
    for (const HostTensor* t :
         {&io.y, &io.batch_mean, &io.batch_variance, &io.rs1, &io.rs2, &io.rs3}) {
      EXPECT_TRUE(AllBytesAre(*t, kSentinel)) << "an output was written";
    }
    // The version is checked first: other errors in the same call do not mask it.
    fbn::FusedBatchNormInputs in = io.Inputs();
    in.x.dtype = static_cast<DataType>(9);
    fbn::FusedBatchNormAttrs bad_attrs;
    bad_attrs.data_format = static_cast<TensorFormat>(11);
    EXPECT_TRUE(IsInvalidArgument(fbn::FusedBatchNorm(version, in, bad_attrs, io.Outputs()),
                                  VersionMessage("FusedBatchNorm", v)));
  }
}

TEST(OpVersionArgument, FusedBatchNormGradAndSpecs) {
  for (int v : kBadVersions) {
    SCOPED_TRACE(v);
    const auto version = static_cast<OpVersion>(v);
    const fbn::FusedBatchNormGradAttrs attrs;
    GradIO io = ValidGrad(attrs);
    TensorSpec specs[fbn::kMaxOpOutputs];
    int n = -5;
    EXPECT_TRUE(IsInvalidArgument(
        fbn::FusedBatchNormGradOutputSpecs(version, io.Inputs(), attrs, specs, &n),
        VersionMessage("FusedBatchNormGrad", v)));
    EXPECT_EQ(n, -5);
    EXPECT_TRUE(
        IsInvalidArgument(fbn::FusedBatchNormGrad(version, io.Inputs(), attrs, io.Outputs()),
                          VersionMessage("FusedBatchNormGrad", v)));
    for (const HostTensor* t : {&io.dx, &io.dscale, &io.doffset, &io.rs_a, &io.rs_b}) {
      EXPECT_TRUE(AllBytesAre(*t, kSentinel)) << "an output was written";
    }
  }
}

TEST(OpVersionArgument, ParseDataFormat) {
  for (int v : kBadVersions) {
    SCOPED_TRACE(v);
    TensorFormat format = static_cast<TensorFormat>(-7);
    EXPECT_TRUE(IsInvalidArgument(fbn::ParseDataFormat("NHWC", static_cast<OpVersion>(v), &format),
                                  VersionMessage("ParseDataFormat", v)));
    EXPECT_EQ(static_cast<int>(format), -7) << "*format written on failure";
  }
  TensorFormat format = TensorFormat::kNHWC;
  EXPECT_TRUE(fbn::ParseDataFormat("NCDHW", OpVersion::kV3, &format).ok());
  EXPECT_EQ(format, TensorFormat::kNCDHW);
}

TEST(OpVersionArgument, OpNames) {
  EXPECT_STREQ(fbn::FusedBatchNormOpName(OpVersion::kV1), "FusedBatchNorm");
  EXPECT_STREQ(fbn::FusedBatchNormOpName(OpVersion::kV2), "FusedBatchNormV2");
  EXPECT_STREQ(fbn::FusedBatchNormOpName(OpVersion::kV3), "FusedBatchNormV3");
  EXPECT_STREQ(fbn::FusedBatchNormGradOpName(OpVersion::kV1), "FusedBatchNormGrad");
  EXPECT_STREQ(fbn::FusedBatchNormGradOpName(OpVersion::kV2), "FusedBatchNormGradV2");
  EXPECT_STREQ(fbn::FusedBatchNormGradOpName(OpVersion::kV3), "FusedBatchNormGradV3");
  for (int v : kBadVersions) {
    // A const char* cannot carry a Status: a fixed text that is no op's name, never null.
    EXPECT_STREQ(fbn::FusedBatchNormOpName(static_cast<OpVersion>(v)), "(invalid fbn::OpVersion)");
    EXPECT_STREQ(fbn::FusedBatchNormGradOpName(static_cast<OpVersion>(v)),
                 "(invalid fbn::OpVersion)");
  }
}

TEST(MomentsAxesArguments, NegativeCountAndNullAxes) {
  HostTensor x(DataType::kFloat32, Shape{2, 3, 4});
  const int axes[] = {0};
  HostTensor mean(DataType::kFloat32, Shape{3, 4}), var(DataType::kFloat32, Shape{3, 4});
  for (int n : {-1, -3, INT_MIN}) {
    SCOPED_TRACE(n);
    const std::string message =
        "Moments: argument num_axes must be >= 0 (the length of axes), got " + std::to_string(n);
    TensorSpec spec;
    spec.dtype = DataType::kFloat16;
    EXPECT_TRUE(
        IsInvalidArgument(fbn::MomentsOutputSpec(x.cview(), axes, n, false, &spec), message));
    EXPECT_EQ(spec.dtype, DataType::kFloat16) << "spec written on failure";
    EXPECT_TRUE(
        IsInvalidArgument(fbn::MomentsOutputSpec(x.cview(), nullptr, n, true, &spec), message));
    mean.FillBytes(kSentinel);
    var.FillBytes(kSentinel);
    EXPECT_TRUE(IsInvalidArgument(fbn::Moments(x.cview(), axes, n, false, mean.view(), var.view()),
                                  message));
    EXPECT_TRUE(AllBytesAre(mean, kSentinel) && AllBytesAre(var, kSentinel));
  }
  for (int n : {1, 2, INT_MAX}) {
    SCOPED_TRACE(n);
    const std::string message =
        "Moments: argument axes is null but num_axes is " + std::to_string(n);
    TensorSpec spec;
    EXPECT_TRUE(
        IsInvalidArgument(fbn::MomentsOutputSpec(x.cview(), nullptr, n, false, &spec), message));
    mean.FillBytes(kSentinel);
    var.FillBytes(kSentinel);
    EXPECT_TRUE(IsInvalidArgument(
        fbn::Moments(x.cview(), nullptr, n, false, mean.view(), var.view()), message));
    EXPECT_TRUE(AllBytesAre(mean, kSentinel) && AllBytesAre(var, kSentinel));
  }
  // No axes (null or not): nothing is reduced, as tf.nn.moments with axes=[].
  TensorSpec spec;
  ASSERT_TRUE(fbn::MomentsOutputSpec(x.cview(), nullptr, 0, false, &spec).ok());
  EXPECT_EQ(spec.shape, x.shape());
}

}  // namespace
}  // namespace fbn_test
