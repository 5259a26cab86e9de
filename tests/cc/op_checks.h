// Checks of fbn's fused ops against the float64 reference, shared by the dtype/layout sweep
// (fused_batch_norm_test.cc) and the per-SIMD-target runs (simd_targets_test.cc). Each check
// draws its inputs from `seed`, runs one op through the public API and compares every output with
// the tolerance rule of test_util.h (gtest EXPECTs; an op error fails the test).
#ifndef FBN_TESTS_CC_OP_CHECKS_H_
#define FBN_TESTS_CC_OP_CHECKS_H_

#include <cstdint>
#include <random>
#include <vector>

#include "fbn/fbn.h"
#include "reference.h"
#include "test_util.h"

namespace fbn_test {

// TensorFlow's Python default epsilon, used by the reference checks.
inline constexpr float kEpsilon = 0.001f;

// x with a random centre and spread per channel, so channels have different statistics.
HostTensor RandomX(fbn::DataType dtype, const fbn::Shape& shape, fbn::TensorFormat f,
                   std::mt19937* rng);
std::vector<double> MaxAbsPerChannel(const RefLayout& l, const std::vector<double>& x);
std::vector<double> Abs(std::vector<double> v);

// Bound of the terms of y = (x - mean)·a + b with a = scale/sqrt(var + kEpsilon) and a float mean
// (accurate to a few ulps of max|x|): |a|·(|x| + max|x|) + |b|.
std::vector<double> YBound(const RefLayout& l, const std::vector<double>& x,
                           const std::vector<double>& scale, const std::vector<double>& offset,
                           const std::vector<double>& var);

// FusedBatchNormV3 training, with exponential_avg_factor 1 (empty running statistics) and 0.6.
void CheckForwardTraining(fbn::DataType dtype, fbn::TensorFormat format, const fbn::Shape& x,
                          uint32_t seed);
// FusedBatchNormV3 inference (factor 0.6, which must be ignored).
void CheckForwardInference(fbn::DataType dtype, fbn::TensorFormat format, const fbn::Shape& x,
                           uint32_t seed);
// FusedBatchNormGradV3; training uses the batch mean and biased variance of x as the saved
// statistics, inference random population statistics.
void CheckGrad(fbn::DataType dtype, fbn::TensorFormat format, const fbn::Shape& x, bool training,
               uint32_t seed);

}  // namespace fbn_test

#endif  // FBN_TESTS_CC_OP_CHECKS_H_
