#include "ops/op_common.h"

#include <string>

#include "ops/validation.h"

namespace fbn {

namespace {
constexpr const char* kInvalidOpVersionName = "(invalid fbn::OpVersion)";
}  // namespace

const char* FusedBatchNormOpName(OpVersion version) {
  switch (version) {
    case OpVersion::kV1:
      return "FusedBatchNorm";
    case OpVersion::kV2:
      return "FusedBatchNormV2";
    case OpVersion::kV3:
      return "FusedBatchNormV3";
  }
  return kInvalidOpVersionName;
}

const char* FusedBatchNormGradOpName(OpVersion version) {
  switch (version) {
    case OpVersion::kV1:
      return "FusedBatchNormGrad";
    case OpVersion::kV2:
      return "FusedBatchNormGradV2";
    case OpVersion::kV3:
      return "FusedBatchNormGradV3";
  }
  return kInvalidOpVersionName;
}

namespace {
const char* AllowedFormats(OpVersion version) {
  return version == OpVersion::kV3 ? "\"NHWC\", \"NCHW\", \"NDHWC\", \"NCDHW\""
                                   : "\"NHWC\", \"NCHW\"";
}
}  // namespace

Status ParseDataFormat(std::string_view text, OpVersion version, TensorFormat* format) {
  Status s = ops::CheckVersion("ParseDataFormat", version);
  if (!s.ok()) return s;
  const TensorFormat all[] = {TensorFormat::kNHWC, TensorFormat::kNCHW, TensorFormat::kNDHWC,
                              TensorFormat::kNCDHW};
  const int allowed = version == OpVersion::kV3 ? 4 : 2;
  for (int i = 0; i < allowed; ++i) {
    if (text == TensorFormatName(all[i])) {
      *format = all[i];
      return Status::Ok();
    }
  }
  return InvalidArgument("Value for attr 'data_format' of \"" + std::string(text) +
                         "\" is not in the list of allowed values: " + AllowedFormats(version));
}

namespace ops {

Status CheckVersion(const char* function, OpVersion version) {
  const int v = static_cast<int>(version);
  if (v >= 1 && v <= 3) return Status::Ok();
  return InvalidArgument(std::string(function) +
                         ": argument version must be fbn::OpVersion::kV1, kV2 or kV3 (1, 2 or 3), "
                         "got " +
                         std::to_string(v));
}

Status CheckOpTypes(const char* op, OpVersion version, DataType t,
                    std::initializer_list<DataType> stats, int first_index) {
  if (static_cast<int>(t) < 0 || static_cast<int>(t) > 3) {
    return InvalidArgument(std::string(op) + ": unknown dtype code " +
                           std::to_string(static_cast<int>(t)));
  }
  if (version == OpVersion::kV1) {
    if (t != DataType::kFloat32 && t != DataType::kFloat64) {
      return AttrTypeError("T", t, "float, double");
    }
  }
  const DataType u = StatsType(t);
  int index = first_index;
  bool first = true;
  for (DataType got : stats) {
    if (first && version != OpVersion::kV1 && got != u) {
      if (u == DataType::kFloat64) return AttrTypeError("U", got, "double");
      if (version == OpVersion::kV3 && got == DataType::kBFloat16) {
        // V3's registration admits U=bfloat16, but no kernel (TensorFlow's or fbn's) runs it.
        return InvalidArgument(std::string(op) +
                               " has no kernel for U=bfloat16: scale, offset, mean and variance "
                               "must be float");
      }
      return AttrTypeError("U", got, version == OpVersion::kV3 ? "bfloat16, float" : "float");
    }
    Status s = CheckInputType(op, index, got, version == OpVersion::kV1 ? t : u);
    if (!s.ok()) return s;
    first = false;
    ++index;
  }
  return Status::Ok();
}

Status CheckFormat(TensorFormat format, OpVersion version) {
  const int f = static_cast<int>(format);
  if (f < 0 || f > 3 || (version != OpVersion::kV3 && f > 1)) {
    const char* name = (f >= 0 && f <= 3) ? TensorFormatName(format) : "?";
    return InvalidArgument(std::string("Value for attr 'data_format' of \"") + name +
                           "\" is not in the list of allowed values: " + AllowedFormats(version));
  }
  return Status::Ok();
}

int64_t ChannelCount(const Shape& x, TensorFormat format) {
  return IsChannelsLast(format) ? x.dim(x.rank() - 1) : x.dim(1);
}

kernels::Geometry MakeGeometry(const Shape& x, TensorFormat format) {
  kernels::Geometry g;
  g.channels_last = IsChannelsLast(format);
  g.n = x.dim(0);
  g.c = ChannelCount(x, format);
  g.s = 1;
  const int first = g.channels_last ? 1 : 2;
  const int last = g.channels_last ? x.rank() - 1 : x.rank();
  for (int i = first; i < last; ++i) g.s *= x.dim(i);
  return g;
}

}  // namespace ops
}  // namespace fbn
