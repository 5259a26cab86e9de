// A float64 reference for fbn's ops, written from the TensorFlow semantics (spec/tf-semantics.md
// §4, §5, §7.4) with plain loops and no code shared with src/. Tensors are flat row-major vectors
// of doubles; a RefLayout says where the channel dim is. Also: IEEE round-to-nearest-even to the
// 16-bit formats, written independently from the library's converters.
#ifndef FBN_TESTS_CC_REFERENCE_H_
#define FBN_TESTS_CC_REFERENCE_H_

#include <cstdint>
#include <vector>

namespace fbn_test {

// A dense tensor's dims and the position of its channel dim (last, or 1).
struct RefLayout {
  std::vector<int64_t> dims;
  bool channels_last = true;

  int64_t Channels() const;
  int64_t Elements() const;
  // Elements per channel (the batch-norm "n").
  int64_t PerChannel() const;
  // Channel of the element at flat (row-major) index i.
  int64_t ChannelOf(int64_t i) const;
};

struct RefForward {
  std::vector<double> y, batch_mean, batch_variance;
  // What the gradient needs: the batch mean and the biased batch variance (training), or the
  // given mean and variance (inference).
  std::vector<double> saved_mean, saved_variance;
};

// FusedBatchNorm, is_training=true: biased variance for y, Bessel-corrected running variance,
// exponential blending with old_mean/old_variance when factor != 1. Empty x: NaN statistics.
RefForward RefBatchNormTraining(const RefLayout& layout, const std::vector<double>& x,
                                const std::vector<double>& scale, const std::vector<double>& offset,
                                const std::vector<double>& old_mean,
                                const std::vector<double>& old_variance, double epsilon,
                                double factor);

// FusedBatchNorm, is_training=false. Empty x: NaN statistics (TensorFlow's kernel does the same).
RefForward RefBatchNormInference(const RefLayout& layout, const std::vector<double>& x,
                                 const std::vector<double>& scale,
                                 const std::vector<double>& offset, const std::vector<double>& mean,
                                 const std::vector<double>& variance, double epsilon);

struct RefGrad {
  std::vector<double> dx, dscale, doffset;
  // Sums of absolute values of the terms of each result: the scale a rounding error can reach,
  // used to size the tolerance of float computations.
  std::vector<double> dx_bound, dscale_bound, doffset_bound;
};

// FusedBatchNormGrad with is_training=true; mean/variance are the saved batch mean and biased
// variance.
RefGrad RefBatchNormGradTraining(const RefLayout& layout, const std::vector<double>& dy,
                                 const std::vector<double>& x, const std::vector<double>& scale,
                                 const std::vector<double>& mean,
                                 const std::vector<double>& variance, double epsilon);

// FusedBatchNormGrad with is_training=false (frozen statistics).
RefGrad RefBatchNormGradInference(const RefLayout& layout, const std::vector<double>& dy,
                                  const std::vector<double>& x, const std::vector<double>& scale,
                                  const std::vector<double>& mean,
                                  const std::vector<double>& variance, double epsilon);

// tf.nn.moments: mean and biased variance over the axes marked in `reduced` (one flag per dim).
// Outputs are laid out over the kept dims (row-major); keepdims does not change their order.
void RefMoments(const std::vector<int64_t>& dims, const std::vector<double>& x,
                const std::vector<bool>& reduced, std::vector<double>* mean,
                std::vector<double>* variance);

// tf.nn.batch_normalization with NumPy broadcasting of each parameter against x. An empty
// offset_dims/scale_dims with `has_offset`/`has_scale` false means "not given".
struct RefParam {
  std::vector<int64_t> dims;
  std::vector<double> values;
};
std::vector<double> RefBatchNormalization(const std::vector<int64_t>& x_dims,
                                          const std::vector<double>& x, const RefParam& mean,
                                          const RefParam& variance, const RefParam* offset,
                                          const RefParam* scale, double epsilon);

// ---------------------------------------------------------------------------------------------
// 16-bit formats. Rounding is to nearest, ties to even, with gradual underflow; a magnitude that
// rounds above the largest finite value becomes infinity; NaN stays NaN.

double RoundToHalf(double v);
double RoundToBFloat16(double v);
uint16_t HalfBits(double v);      // RoundToHalf, encoded (NaN: 0x7E00 with v's sign)
uint16_t BFloat16Bits(double v);  // RoundToBFloat16, encoded (NaN: 0x7FC0 with v's sign)
double HalfFromBits(uint16_t bits);
double BFloat16FromBits(uint16_t bits);
// The spacing of representable values at magnitude |v| (subnormal spacing below the normals).
double HalfUlp(double v);
double BFloat16Ulp(double v);

}  // namespace fbn_test

#endif  // FBN_TESTS_CC_REFERENCE_H_
