// Helpers shared by fbn's C++ tests: owning host tensors of any fbn dtype, random data, the
// tolerance rules used to compare fbn with the float64 reference, and op-call shorthands.
#ifndef FBN_TESTS_CC_TEST_UTIL_H_
#define FBN_TESTS_CC_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "fbn/fbn.h"
#include "reference.h"

namespace fbn_test {

// A dense tensor owning its storage (8-byte aligned). Values go in and out as doubles: Set rounds
// to the dtype (round-to-nearest-even), Get is exact.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(fbn::DataType dtype, fbn::Shape shape);

  fbn::DataType dtype() const { return dtype_; }
  const fbn::Shape& shape() const { return shape_; }
  int64_t size() const { return shape_.num_elements(); }
  // 0 for a shape with negative dims (such tensors only feed error tests).
  size_t bytes() const { return bytes_; }
  void* data() { return storage_.data(); }
  const void* data() const { return storage_.data(); }

  fbn::TensorView view() { return fbn::TensorView{data(), dtype_, shape_}; }
  fbn::ConstTensorView cview() const { return fbn::ConstTensorView{data(), dtype_, shape_}; }

  double Get(int64_t i) const;
  void Set(int64_t i, double v);
  std::vector<double> ToVector() const;
  void FromVector(const std::vector<double>& v);
  // Fills every byte (a sentinel for "nothing written").
  void FillBytes(unsigned char byte);
  bool BytesEqual(const HostTensor& other) const;
  std::vector<unsigned char> RawBytes() const;

 private:
  fbn::DataType dtype_ = fbn::DataType::kFloat32;
  fbn::Shape shape_;
  size_t bytes_ = 0;
  std::vector<double> storage_;  // as many doubles as the bytes need
};

// Rounds v to the dtype's precision (identity for float64).
double RoundTo(fbn::DataType dtype, double v);

// Uniform values in [lo, hi), rounded to `dtype`, from a fixed-seed generator.
HostTensor RandomTensor(fbn::DataType dtype, const fbn::Shape& shape, double lo, double hi,
                        std::mt19937* rng);

// The statistics (per-channel) dtype fbn pairs with an x dtype.
fbn::DataType StatsType(fbn::DataType x);

// Shapes and layouts.
bool ChannelsLast(fbn::TensorFormat f);
bool Is5D(fbn::TensorFormat f);
// x's shape for a format: N, C and the spatial dims (2 of them for 4-D formats, 3 for 5-D).
fbn::Shape MakeShape(fbn::TensorFormat f, int64_t n, int64_t c,
                     const std::vector<int64_t>& spatial);
RefLayout LayoutOf(const fbn::Shape& shape, fbn::TensorFormat f);
std::vector<int64_t> DimsOf(const fbn::Shape& shape);

// Tolerance rule. fbn computes in float (float64 for float64 x) and rounds once to the output
// dtype. A float computation of a value whose terms have magnitudes summing to `bound` is within
// rel·bound of the exact value: rel = 1e-5 (about 170 float ulps) for float, 1e-12 for double.
// That covers fbn's blocked float sums over up to ~10^5 terms per channel, whose observed error
// over the whole sweep stays below 3e-6 of the bound, while a lost block, a wrong count or a
// wrong epsilon (all >= 1e-4) fails. A 16-bit output is the round-to-nearest-even of that float
// value, so it is within half a 16-bit ulp of it (taken at the larger of the two magnitudes, in
// case they straddle a binade). So:
//   |got - ref| <= rel·bound + (16-bit ? ulp(max(|got|, |ref|)) / 2 : 0).
// NaN must match NaN and infinities must match exactly.
double RelTolerance(fbn::DataType compute_type);
::testing::AssertionResult NearRef(fbn::DataType out_dtype, double rel, double got, double ref,
                                   double bound);

// Compares all elements; reports the first few mismatches with their index.
::testing::AssertionResult AllNearRef(const HostTensor& got, const std::vector<double>& ref,
                                      const std::vector<double>& bound, double rel);

// Names for test parameters.
std::string DTypeTag(fbn::DataType t);
std::string FormatTag(fbn::TensorFormat f);

// ---------------------------------------------------------------------------------------------
// Op-call shorthands: tensors for one forward or gradient call, allocated to the specs fbn
// reports.

struct ForwardIO {
  HostTensor x, scale, offset, mean, variance;
  HostTensor y, batch_mean, batch_variance, rs1, rs2, rs3;

  fbn::FusedBatchNormInputs Inputs() const;
  fbn::FusedBatchNormOutputs Outputs();
  // Allocates the outputs from FusedBatchNormOutputSpecs (fails the test if that fails).
  void AllocateOutputs(fbn::OpVersion version, const fbn::FusedBatchNormAttrs& attrs);
};

struct GradIO {
  HostTensor dy, x, scale, rs1, rs2, rs3;
  HostTensor dx, dscale, doffset, rs_a, rs_b;

  fbn::FusedBatchNormGradInputs Inputs() const;
  fbn::FusedBatchNormGradOutputs Outputs();
  void AllocateOutputs(fbn::OpVersion version, const fbn::FusedBatchNormGradAttrs& attrs);
};

}  // namespace fbn_test

#endif  // FBN_TESTS_CC_TEST_UTIL_H_
