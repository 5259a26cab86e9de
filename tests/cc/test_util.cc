#include "test_util.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <sstream>

namespace fbn_test {

using fbn::DataType;
using fbn::Shape;
using fbn::TensorFormat;

HostTensor::HostTensor(DataType dtype, Shape shape) : dtype_(dtype), shape_(shape) {
  // An invalid shape (negative dims, for error tests) gets no storage beyond the minimum.
  if (shape_.Validate("tensor").ok()) {
    bytes_ = static_cast<size_t>(shape_.num_elements()) * fbn::DataTypeSize(dtype_);
  }
  // At least one double, so data() is never null even for empty tensors.
  storage_.assign(std::max<size_t>(1, (bytes_ + 7) / 8), 0.0);
}

double HostTensor::Get(int64_t i) const {
  const auto* p = reinterpret_cast<const unsigned char*>(storage_.data());
  switch (dtype_) {
    case DataType::kFloat16: {
      uint16_t b;
      std::memcpy(&b, p + 2 * i, 2);
      return HalfFromBits(b);
    }
    case DataType::kBFloat16: {
      uint16_t b;
      std::memcpy(&b, p + 2 * i, 2);
      return BFloat16FromBits(b);
    }
    case DataType::kFloat32: {
      float f;
      std::memcpy(&f, p + 4 * i, 4);
      return f;
    }
    case DataType::kFloat64: {
      double d;
      std::memcpy(&d, p + 8 * i, 8);
      return d;
    }
  }
  return 0.0;
}

void HostTensor::Set(int64_t i, double v) {
  auto* p = reinterpret_cast<unsigned char*>(storage_.data());
  switch (dtype_) {
    case DataType::kFloat16: {
      const uint16_t b = HalfBits(v);
      std::memcpy(p + 2 * i, &b, 2);
      break;
    }
    case DataType::kBFloat16: {
      const uint16_t b = BFloat16Bits(v);
      std::memcpy(p + 2 * i, &b, 2);
      break;
    }
    case DataType::kFloat32: {
      const float f = static_cast<float>(v);
      std::memcpy(p + 4 * i, &f, 4);
      break;
    }
    case DataType::kFloat64:
      std::memcpy(p + 8 * i, &v, 8);
      break;
  }
}

std::vector<double> HostTensor::ToVector() const {
  std::vector<double> v(static_cast<size_t>(size()));
  for (int64_t i = 0; i < size(); ++i) v[i] = Get(i);
  return v;
}

void HostTensor::FromVector(const std::vector<double>& v) {
  for (int64_t i = 0; i < size(); ++i) Set(i, v.at(i));
}

void HostTensor::FillBytes(unsigned char byte) { std::memset(storage_.data(), byte, bytes()); }

bool HostTensor::BytesEqual(const HostTensor& other) const {
  return bytes() == other.bytes() && std::memcmp(data(), other.data(), bytes()) == 0;
}

std::vector<unsigned char> HostTensor::RawBytes() const {
  const auto* p = reinterpret_cast<const unsigned char*>(data());
  return std::vector<unsigned char>(p, p + bytes());
}

double RoundTo(DataType dtype, double v) {
  switch (dtype) {
    case DataType::kFloat16:
      return RoundToHalf(v);
    case DataType::kBFloat16:
      return RoundToBFloat16(v);
    case DataType::kFloat32:
      return static_cast<double>(static_cast<float>(v));
    case DataType::kFloat64:
      return v;
  }
  return v;
}

HostTensor RandomTensor(DataType dtype, const Shape& shape, double lo, double hi,
                        std::mt19937* rng) {
  HostTensor t(dtype, shape);
  std::uniform_real_distribution<double> dist(lo, hi);
  for (int64_t i = 0; i < t.size(); ++i) t.Set(i, dist(*rng));
  return t;
}

DataType StatsType(DataType x) {
  return x == DataType::kFloat64 ? DataType::kFloat64 : DataType::kFloat32;
}

bool ChannelsLast(TensorFormat f) { return f == TensorFormat::kNHWC || f == TensorFormat::kNDHWC; }
bool Is5D(TensorFormat f) { return f == TensorFormat::kNDHWC || f == TensorFormat::kNCDHW; }

Shape MakeShape(TensorFormat f, int64_t n, int64_t c, const std::vector<int64_t>& spatial) {
  std::vector<int64_t> dims{n};
  if (!ChannelsLast(f)) dims.push_back(c);
  dims.insert(dims.end(), spatial.begin(), spatial.end());
  if (ChannelsLast(f)) dims.push_back(c);
  return Shape(dims.data(), static_cast<int>(dims.size()));
}

std::vector<int64_t> DimsOf(const Shape& shape) {
  return std::vector<int64_t>(shape.dims(), shape.dims() + shape.rank());
}

RefLayout LayoutOf(const Shape& shape, TensorFormat f) {
  return RefLayout{DimsOf(shape), ChannelsLast(f)};
}

double RelTolerance(DataType compute_type) {
  return compute_type == DataType::kFloat64 ? 1e-12 : 1e-5;
}

::testing::AssertionResult NearRef(DataType out_dtype, double rel, double got, double ref,
                                   double bound) {
  if (std::isnan(ref) || std::isnan(got)) {
    if (std::isnan(ref) && std::isnan(got)) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "got " << got << ", want " << ref;
  }
  if (std::isinf(ref) || std::isinf(got)) {
    if (got == ref) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "got " << got << ", want " << ref;
  }
  double tol = rel * bound;
  const double mag = std::max(std::fabs(got), std::fabs(ref));
  if (out_dtype == DataType::kFloat16) tol += 0.5 * HalfUlp(mag);
  if (out_dtype == DataType::kBFloat16) tol += 0.5 * BFloat16Ulp(mag);
  if (std::fabs(got - ref) <= tol) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << std::setprecision(17) << "got " << got << ", want " << ref << " (|diff| "
         << std::fabs(got - ref) << " > tol " << tol << ")";
}

::testing::AssertionResult AllNearRef(const HostTensor& got, const std::vector<double>& ref,
                                      const std::vector<double>& bound, double rel) {
  if (static_cast<int64_t>(ref.size()) != got.size()) {
    return ::testing::AssertionFailure() << "size " << got.size() << " vs reference " << ref.size();
  }
  int failures = 0;
  std::ostringstream msg;
  for (int64_t i = 0; i < got.size(); ++i) {
    const auto r = NearRef(got.dtype(), rel, got.Get(i), ref[i], bound.at(i));
    if (!r) {
      if (failures < 5) msg << "\n  [" << i << "] " << r.message();
      ++failures;
    }
  }
  if (failures == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << failures << " of " << got.size() << " elements differ:" << msg.str();
}

std::string DTypeTag(DataType t) {
  switch (t) {
    case DataType::kFloat16:
      return "f16";
    case DataType::kBFloat16:
      return "bf16";
    case DataType::kFloat32:
      return "f32";
    case DataType::kFloat64:
      return "f64";
  }
  return "unknown";
}

std::string FormatTag(TensorFormat f) { return fbn::TensorFormatName(f); }

fbn::FusedBatchNormInputs ForwardIO::Inputs() const {
  return {x.cview(), scale.cview(), offset.cview(), mean.cview(), variance.cview()};
}

fbn::FusedBatchNormOutputs ForwardIO::Outputs() {
  return {y.view(), batch_mean.view(), batch_variance.view(), rs1.view(), rs2.view(), rs3.view()};
}

void ForwardIO::AllocateOutputs(fbn::OpVersion version, const fbn::FusedBatchNormAttrs& attrs) {
  fbn::TensorSpec specs[fbn::kMaxOpOutputs];
  int n = 0;
  const fbn::Status s = fbn::FusedBatchNormOutputSpecs(version, Inputs(), attrs, specs, &n);
  ASSERT_TRUE(s.ok()) << s.ToString();
  HostTensor* outs[] = {&y, &batch_mean, &batch_variance, &rs1, &rs2, &rs3};
  for (int i = 0; i < n; ++i) *outs[i] = HostTensor(specs[i].dtype, specs[i].shape);
}

fbn::FusedBatchNormGradInputs GradIO::Inputs() const {
  return {dy.cview(), x.cview(), scale.cview(), rs1.cview(), rs2.cview(), rs3.cview()};
}

fbn::FusedBatchNormGradOutputs GradIO::Outputs() {
  return {dx.view(), dscale.view(), doffset.view(), rs_a.view(), rs_b.view()};
}

void GradIO::AllocateOutputs(fbn::OpVersion version, const fbn::FusedBatchNormGradAttrs& attrs) {
  fbn::TensorSpec specs[fbn::kMaxOpOutputs];
  int n = 0;
  const fbn::Status s = fbn::FusedBatchNormGradOutputSpecs(version, Inputs(), attrs, specs, &n);
  ASSERT_TRUE(s.ok()) << s.ToString();
  HostTensor* outs[] = {&dx, &dscale, &doffset, &rs_a, &rs_b};
  for (int i = 0; i < n; ++i) *outs[i] = HostTensor(specs[i].dtype, specs[i].shape);
}

}  // namespace fbn_test
