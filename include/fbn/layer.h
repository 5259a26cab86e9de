// The batch-normalization layer: tf.compat.v1.layers.BatchNormalization (TensorFlow's V1 layer
// behaviour) by default, with Keras V2's differences as an option.
//
//   fbn::BatchNormalizationOptions opt;          // TensorFlow's defaults
//   opt.axis = {1};
//   fbn::layers::BatchNormalization bn(opt);
//   fbn::Tensor y = bn.Call(x_view, /*training=*/true);
//   fbn::BatchNormalizationGradients g = bn.Backward(dy_view);
//
// Outside a graph (no fbn::Graph is the default) the layer owns its variables and applies its
// moving-average updates within each training call. Under a default Graph it creates its variables
// through the graph's variable scopes with TensorFlow's names, fills the graph's collections, and
// leaves its updates as UpdateOps in UPDATE_OPS: the moving statistics change only when they run.
//
// Paths: the fused path (FusedBatchNormV3 and its gradient) for rank-4/5 inputs whose single axis
// is the channel axis, first or last; the general path (tf.nn.moments + tf.nn.batch_normalization
// semantics) everywhere else, with multiple axes, batch renormalization, ghost batches and
// `adjustment`. The fused path's moving variance tracks the Bessel-corrected batch variance, the
// general path's the biased one, as in TensorFlow. Every call validates fully before anything is
// written: a failed call leaves the variables as they were.
//
// Synchronized (options.synchronized, Keras's `synchronized=True`): several processes each call
// the layer on their part of one batch, and training calls normalize with the statistics of the
// whole (global) batch; see BatchNormalizationOptions::synchronized.
#ifndef FBN_LAYER_H_
#define FBN_LAYER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fbn/distributed.h"
#include "fbn/export.h"
#include "fbn/graph.h"
#include "fbn/initializers.h"
#include "fbn/tensor.h"
#include "fbn/types.h"

namespace fbn {

// A boolean read when a layer is called: the counterpart of a boolean placeholder fed at run time.
// With a flag, the layer behaves as TensorFlow does for a dynamic `training` tensor (both branches
// exist; update ops are always created and do nothing when the flag was false).
class FBN_API TrainingFlag {
 public:
  explicit TrainingFlag(bool value = false) : value_(value) {}
  bool value() const { return value_; }
  void set_value(bool value) { value_ = value; }

 private:
  bool value_;
};

// The `training` argument: a static bool or a runtime flag.
class FBN_API Training {
 public:
  Training(bool value) : value_(value) {}       // NOLINT: implicit, as Python's training=True
  Training(std::shared_ptr<TrainingFlag> flag)  // NOLINT
      : value_(false), flag_(std::move(flag)) {}

  bool is_dynamic() const { return static_cast<bool>(flag_); }
  // The value now: the static value, or the flag's.
  bool value() const { return flag_ ? flag_->value() : value_; }

 private:
  bool value_;
  std::shared_ptr<TrainingFlag> flag_;
};

// `adjustment(shape) -> (scale, bias)`: tensors that broadcast (NumPy rules) to the input's shape,
// applied to the normalized values before gamma and beta, only when training.
struct AdjustmentResult {
  Tensor scale;
  Tensor bias;
};
using Adjustment = std::function<AdjustmentResult(const Shape& input_shape)>;

// renorm_clipping: a missing bound does not clip (rmax = inf, rmin = 0, dmax = inf in effect).
struct RenormClipping {
  std::optional<double> rmax, rmin, dmax;
};

enum class LayerBehavior {
  // tf.compat.v1.layers.BatchNormalization: fused=None means "fused where possible" with a silent
  // fallback; `trainable` only decides which collections the variables join.
  kV1,
  // tf.keras.layers.BatchNormalization (V2): fused=True raises where it cannot be used;
  // trainable=false makes every call an inference call.
  kKerasV2,
};

// Every constructor argument of tf.compat.v1.layers.BatchNormalization, with its defaults.
struct BatchNormalizationOptions {
  std::vector<int> axis = {-1};
  double momentum = 0.99;
  double epsilon = 1e-3;
  bool center = true;
  bool scale = true;
  Initializer beta_initializer = Initializer::Zeros();
  Initializer gamma_initializer = Initializer::Ones();
  Initializer moving_mean_initializer = Initializer::Zeros();
  Initializer moving_variance_initializer = Initializer::Ones();
  Regularizer beta_regularizer;
  Regularizer gamma_regularizer;
  Constraint beta_constraint;
  Constraint gamma_constraint;
  bool renorm = false;
  RenormClipping renorm_clipping;
  double renorm_momentum = 0.99;
  std::optional<bool> fused;  // nullopt is TensorFlow's None
  bool trainable = true;
  std::optional<int64_t> virtual_batch_size;
  Adjustment adjustment;
  std::string name;  // "" is None: "batch_normalization", "batch_normalization_1", ...
  LayerBehavior behavior = LayerBehavior::kV1;

  // Synchronized batch normalization over the members of `communicator` (null: fbn's default
  // communicator, MPI_COMM_WORLD when the program includes fbn/mpi.h and links fbn::mpi). Each
  // member calls the layer on its part of the batch (split along dimension 0; parts may differ in
  // size and be empty). Training calls then use the mean and variance of the global batch, merged
  // per channel from every member's count, mean and centred sum of squares in rank order, and
  // Backward uses the global sums of the gradient terms: outputs and dx are those of the layer
  // called on the whole batch, and the moving statistics (and renorm's) are identical on every
  // member. dgamma and dbeta are this member's contributions (their sum over the members is the
  // whole batch's gradient), as a data-parallel optimizer that all-reduces gradients expects.
  // Training calls and their Backward are collective (fbn/distributed.h): every member makes them
  // in the same order; a mismatch between members (channel count, dtype, call order) or a member
  // whose call fails before its exchange is an error on every member. Inference calls exchange
  // nothing. With one member the layer is the unsynchronized layer, bit for bit.
  // Paths: kKerasV2 follows Keras (fused=None resolves to false; fused=true is an error); kV1
  // keeps its fused/general choice and synchronizes either path. With virtual_batch_size, the
  // virtual batches with the same index are merged across members (every member needs the same
  // number of them): the layer on the whole batch with virtual_batch_size·members.
  bool synchronized = false;
  std::shared_ptr<Communicator> communicator;
};

// Gradients of the last call's output: dx in the input's dtype, dgamma/dbeta in the parameter
// dtype (null tensors when the layer has no gamma (scale=false) or no beta (center=false)).
struct BatchNormalizationGradients {
  Tensor dx;
  Tensor dgamma;
  Tensor dbeta;
};

namespace layers {

class FBN_API BatchNormalization {
 public:
  // Checks what TensorFlow checks at construction (ValueError).
  explicit BatchNormalization(BatchNormalizationOptions options);
  ~BatchNormalization();
  BatchNormalization(const BatchNormalization&) = delete;
  BatchNormalization& operator=(const BatchNormalization&) = delete;

  // Applies the layer. Inputs: half, bfloat16, float or double, rank >= 1. The first call builds
  // the layer (axes, path, variables) for that input's rank, axis sizes and dtype; later calls
  // must match them (ValueError, TensorFlow's input-spec texts) and are cast to the layer's dtype.
  Tensor Call(const ConstTensorView& inputs, const Training& training = false);

  // Gradients of the last call's output with respect to its input, gamma and beta, for the output
  // gradient `dy` (the output's shape; any floating dtype). Uses the values of that call (input,
  // statistics, gamma, beta); Error when there was no successful call.
  BatchNormalizationGradients Backward(const ConstTensorView& dy) const;

  // --- State.
  const std::string& name() const;
  bool built() const;
  // TensorFlow's `layer.fused`: the resolved value after the first call, the constructor's before.
  std::optional<bool> fused() const;
  const BatchNormalizationOptions& options() const;
  bool trainable() const;
  // TensorFlow's `layer.trainable = value`: decides trainable_variables(); with kKerasV2 a
  // non-trainable layer runs in inference mode.
  void set_trainable(bool trainable);
  // Axes after validation (non-negative, as given otherwise); empty before the first call.
  std::vector<int> axis() const;
  DataType dtype() const;  // the layer dtype (the first input's); float32 before the first call

  std::shared_ptr<Variable> gamma() const;  // null when scale=false or not built
  std::shared_ptr<Variable> beta() const;   // null when center=false or not built
  std::shared_ptr<Variable> moving_mean() const;
  std::shared_ptr<Variable> moving_variance() const;
  std::shared_ptr<Variable> moving_stddev() const;  // renorm only
  std::shared_ptr<Variable> renorm_mean() const;    // renorm only
  std::shared_ptr<Variable> renorm_stddev() const;  // renorm only

  // Keras's weights lists: variables() = trainable + non-trainable, creation order within each.
  std::vector<std::shared_ptr<Variable>> variables() const;
  std::vector<std::shared_ptr<Variable>> trainable_variables() const;
  std::vector<std::shared_ptr<Variable>> non_trainable_variables() const;
  // One loss per regularized variable this layer created (a reusing layer creates none).
  std::vector<std::shared_ptr<RegularizationLoss>> losses() const;
  // Update ops of every graph-mode training call so far, two per call; none while the layer is
  // not trainable (as Keras: a frozen layer's updates never reach UPDATE_OPS). Eager calls apply
  // their updates at once and add none.
  std::vector<std::shared_ptr<UpdateOp>> updates() const;

 private:
  Tensor CallImpl(const ConstTensorView& inputs, const Training& training, Communicator* sync);

  friend FBN_API Tensor ApplyBatchNormalization(const ConstTensorView&,
                                                const BatchNormalizationOptions&, const Training&,
                                                std::optional<bool>,
                                                std::shared_ptr<BatchNormalization>*);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// tf.compat.v1.layers.batch_normalization: builds a layer with `options` (its `name` is also the
// variable scope, used as given, not made unique) and applies it once. `reuse` is TensorFlow's
// (nullopt: None). Needs a default Graph: without one it throws ValueError, since the layer's
// variables would have nowhere to live (use the BatchNormalization object instead). `layer`, when
// given, receives the layer object.
FBN_API Tensor ApplyBatchNormalization(const ConstTensorView& inputs,
                                       const BatchNormalizationOptions& options,
                                       const Training& training = false,
                                       std::optional<bool> reuse = std::nullopt,
                                       std::shared_ptr<BatchNormalization>* layer = nullptr);

}  // namespace layers
}  // namespace fbn

#endif  // FBN_LAYER_H_
