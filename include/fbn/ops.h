// TensorFlow's batch-normalization ops on caller-provided buffers.
//
// Every entry point validates all of its arguments first, in TensorFlow's order and with
// TensorFlow's message texts, and writes nothing unless validation passed. None throws or
// allocates on the hot path; all are safe to call from several threads at once.
//
//   FusedBatchNorm        = tf.raw_ops.FusedBatchNorm / V2 / V3
//   FusedBatchNormGrad    = tf.raw_ops.FusedBatchNormGrad / V2 / V3
//   Moments               = tf.nn.moments
//   BatchNormalization    = tf.nn.batch_normalization
//
// Element types: x (and y, y_backprop, x_backprop) in half, bfloat16, float or double. With a
// 16-bit or float x the per-channel tensors are float (statistics accumulate in float or wider);
// with a double x (an fbn extension) they are double. The V1 ops take float only, as in TF.
#ifndef FBN_OPS_H_
#define FBN_OPS_H_

#include <string_view>

#include "fbn/export.h"
#include "fbn/status.h"
#include "fbn/types.h"

namespace fbn {

// Any int converts to an OpVersion; every function below that takes one returns InvalidArgument
// for a value other than kV1, kV2 and kV3 ("...: argument version must be fbn::OpVersion::kV1,
// kV2 or kV3 (1, 2 or 3), got 7"), before anything else is checked or written.
enum class OpVersion : int { kV1 = 1, kV2 = 2, kV3 = 3 };

// The name TensorFlow gives the op: "FusedBatchNormV3", "FusedBatchNormGrad", ... For a version
// outside kV1..kV3, the fixed text "(invalid fbn::OpVersion)" (never null).
FBN_API const char* FusedBatchNormOpName(OpVersion version);
FBN_API const char* FusedBatchNormGradOpName(OpVersion version);

// Parses a data_format attribute as the op `version` accepts it (V1/V2: NHWC, NCHW; V3 also
// NDHWC, NCDHW), with TensorFlow's attribute error text. *format is written only on success.
FBN_API Status ParseDataFormat(std::string_view text, OpVersion version, TensorFormat* format);

// The shape and type an output must have.
struct TensorSpec {
  DataType dtype = DataType::kFloat32;
  Shape shape;
};

// ---------------------------------------------------------------------------------------------
// Forward.

struct FusedBatchNormAttrs {
  float epsilon = 0.0001f;
  float exponential_avg_factor = 1.0f;  // compared exactly to 1.0, as TensorFlow does
  TensorFormat data_format = TensorFormat::kNHWC;
  bool is_training = true;
};

struct FusedBatchNormInputs {
  ConstTensorView x, scale, offset, mean, variance;
};

// Outputs in TensorFlow's order. reserve_space_3 exists only for V3 (a scalar holding 0, as on
// TensorFlow's CPU kernel); it is ignored for V1 and V2.
struct FusedBatchNormOutputs {
  TensorView y, batch_mean, batch_variance, reserve_space_1, reserve_space_2, reserve_space_3;
};

inline constexpr int kMaxOpOutputs = 6;

// Validates the inputs and reports the outputs' specs (5 for V1/V2, 6 for V3).
FBN_API Status FusedBatchNormOutputSpecs(OpVersion version, const FusedBatchNormInputs& inputs,
                                         const FusedBatchNormAttrs& attrs,
                                         TensorSpec specs[kMaxOpOutputs],
                                         int* num_outputs) noexcept;

// Training: y normalized with the batch's biased variance; batch_variance is Bessel-corrected
// and blended with `variance` unless exponential_avg_factor == 1; reserve_space_1/2 hold the batch
// mean and biased variance for the gradient. Inference: y from the given mean and variance, which
// batch_mean/batch_variance echo (reserve_space_1/2 echo them too; TensorFlow leaves them
// undefined). Empty x: NaN statistics, as TensorFlow.
FBN_API Status FusedBatchNorm(OpVersion version, const FusedBatchNormInputs& inputs,
                              const FusedBatchNormAttrs& attrs,
                              const FusedBatchNormOutputs& outputs) noexcept;

// ---------------------------------------------------------------------------------------------
// Gradient.

struct FusedBatchNormGradAttrs {
  float epsilon = 0.0001f;
  TensorFormat data_format = TensorFormat::kNHWC;
  bool is_training = true;
};

// is_training: reserve_space_1/2 are the forward pass's saved batch mean and biased variance.
// Otherwise they are the population mean and variance. reserve_space_3 (V3) is not read.
struct FusedBatchNormGradInputs {
  ConstTensorView y_backprop, x, scale, reserve_space_1, reserve_space_2, reserve_space_3;
};

// The two trailing outputs are TensorFlow's placeholders: empty vectors of shape [0].
struct FusedBatchNormGradOutputs {
  TensorView x_backprop, scale_backprop, offset_backprop, reserve_space_a, reserve_space_b;
};

FBN_API Status FusedBatchNormGradOutputSpecs(OpVersion version,
                                             const FusedBatchNormGradInputs& inputs,
                                             const FusedBatchNormGradAttrs& attrs,
                                             TensorSpec specs[kMaxOpOutputs],
                                             int* num_outputs) noexcept;

// Unlike TensorFlow's CPU kernel, is_training=false accepts channels-first formats too.
FBN_API Status FusedBatchNormGrad(OpVersion version, const FusedBatchNormGradInputs& inputs,
                                  const FusedBatchNormGradAttrs& attrs,
                                  const FusedBatchNormGradOutputs& outputs) noexcept;

// ---------------------------------------------------------------------------------------------
// Non-fused ops (the layer's general path).

// tf.nn.moments: mean and biased variance of x over the `num_axes` entries of `axes` (negative
// axes count from the end; duplicates are an error; num_axes < 0, or axes == nullptr with
// num_axes > 0, is InvalidArgument naming the argument). Outputs have x's dtype; 16-bit x
// accumulates in float, float in double. keepdims keeps reduced axes as size 1.
FBN_API Status MomentsOutputSpec(const ConstTensorView& x, const int* axes, int num_axes,
                                 bool keepdims, TensorSpec* spec) noexcept;
FBN_API Status Moments(const ConstTensorView& x, const int* axes, int num_axes, bool keepdims,
                       const TensorView& mean, const TensorView& variance) noexcept;

// tf.nn.batch_normalization: y = x * inv + (offset - mean * inv), inv = rsqrt(variance + eps)
// [* scale]. mean, variance, offset and scale broadcast against x (NumPy rules, no larger than x);
// offset or scale with data == nullptr means "not given". All tensors share x's dtype.
FBN_API Status BatchNormalization(const ConstTensorView& x, const ConstTensorView& mean,
                                  const ConstTensorView& variance, const ConstTensorView& offset,
                                  const ConstTensorView& scale, float variance_epsilon,
                                  const TensorView& y) noexcept;

}  // namespace fbn

#endif  // FBN_OPS_H_
