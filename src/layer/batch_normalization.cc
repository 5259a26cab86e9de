// tf.compat.v1.layers.BatchNormalization: building (axes, path, variables, scopes), the fused and
// general forward passes, update ops, and the backward pass of the last call.
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "distributed/exchange.h"
#include "fbn/distributed.h"
#include "fbn/layer.h"
#include "fbn/ops.h"
#include "layer/general_path.h"
#include "layer/names.h"

namespace fbn {
namespace {

constexpr const char* kBaseName = "batch_normalization";

// Python's repr of a list of ints: "[1, 3]".
std::string PyList(const std::vector<int>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

std::string PyTuple(const std::vector<int>& v) {
  return PyTupleString(std::vector<int64_t>(v.begin(), v.end()));
}

// Outside any graph, layers still get TensorFlow-like unique names and scopes, per process.
std::string EagerUnique(const std::string& base, bool zero_based) {
  static std::mutex mu;
  static std::map<std::pair<bool, std::string>, int> counts;
  std::lock_guard<std::mutex> lock(mu);
  const int n = counts[{zero_based, base}]++;
  if (zero_based) return n == 0 ? base : base + "_" + std::to_string(n);
  return base + "_" + std::to_string(n + 1);
}

bool IsFusedDtype(DataType t) {
  return t == DataType::kFloat16 || t == DataType::kBFloat16 || t == DataType::kFloat32;
}

// _raise_if_fused_cannot_be_used: the reason the fused path cannot be used, or "" when it can.
// `dtype` is the compute dtype when known.
std::string FusedProblem(const BatchNormalizationOptions& o, const std::vector<int>& axis,
                         std::optional<DataType> dtype) {
  if (o.renorm) return "Passing both `fused=True` and `renorm=True` is not supported";
  static const std::set<int> kAllowed = {-4, -3, -1, 1, 3, 4};
  if (axis.size() != 1 || !kAllowed.count(axis[0])) {
    return "Passing `fused=True` is only supported when axis is 1 or 3 for input rank = 4 or 1 "
           "or 4 for input rank = 5. Got axis " +
           PyList(axis);
  }
  if (o.virtual_batch_size) {
    return "Passing `fused=True` is not supported when `virtual_batch_size` is specified.";
  }
  if (o.adjustment) return "Passing `fused=True` is not supported when `adjustment` is specified.";
  if (dtype && !IsFusedDtype(*dtype)) {
    return "Passing `fused=True` is only supported when the compute dtype is float16, bfloat16, "
           "or float32. Got dtype: " +
           layer_impl::PyDtypeName(*dtype);
  }
  return "";
}

DataType ParamDtype(DataType t) {
  return t == DataType::kFloat64 ? DataType::kFloat64 : DataType::kFloat32;
}

// Broadcasts `t` (NumPy rules, rank <= target's) to `target`, as doubles in memory order.
std::vector<double> BroadcastTo(const Tensor& t, const Shape& target, const char* what) {
  const int rank = target.rank(), trank = t.shape().rank();
  bool ok = t.valid() && trank <= rank;
  std::vector<int64_t> strides(static_cast<size_t>(rank), 0);
  if (ok) {
    int64_t stride = 1;
    for (int k = trank - 1; k >= 0; --k) {
      const int d = rank - trank + k;
      const int64_t have = t.shape().dim(k);
      if (have == target.dim(d)) {
        strides[static_cast<size_t>(d)] = have == 1 ? 0 : stride;
      } else if (have != 1) {
        ok = false;
        break;
      }
      stride *= have;
    }
  }
  if (!ok) {
    throw ValueError(std::string("`adjustment` returned a ") + what + " of shape " +
                     (t.valid() ? PyTupleString(t.shape()) : std::string("None")) +
                     " that does not broadcast to the input shape " + PyTupleString(target));
  }
  const int64_t n = target.num_elements();
  std::vector<double> out(static_cast<size_t>(n));
  std::vector<int64_t> idx(static_cast<size_t>(rank), 0);
  for (int64_t i = 0; i < n; ++i) {
    int64_t src = 0;
    for (int d = 0; d < rank; ++d)
      src += idx[static_cast<size_t>(d)] * strides[static_cast<size_t>(d)];
    out[static_cast<size_t>(i)] = t.Get(src);
    for (int d = rank - 1; d >= 0; --d) {
      if (++idx[static_cast<size_t>(d)] < target.dim(d)) break;
      idx[static_cast<size_t>(d)] = 0;
    }
  }
  return out;
}

template <typename T>
std::vector<T> AsVector(const Tensor& t) {
  std::vector<T> v(static_cast<size_t>(t.num_elements()));
  for (int64_t i = 0; i < t.num_elements(); ++i)
    v[static_cast<size_t>(i)] = static_cast<T>(t.Get(i));
  return v;
}

template <typename T>
std::vector<T> AsVector(const std::vector<double>& d) {
  return std::vector<T>(d.begin(), d.end());
}

template <typename T>
std::vector<double> ToDouble(const std::vector<T>& v) {
  return std::vector<double>(v.begin(), v.end());
}

// _assign_moving_average: var -= (var - value) * (1 - momentum), in the variable's dtype.
template <typename T>
void MovingAverage(Variable* var, const std::vector<double>& value, double momentum) {
  Tensor& t = var->mutable_value();
  // TensorFlow makes `1 - momentum` a float32 tensor first, then casts it to the variable dtype.
  const float decay32 = static_cast<float>(1.0 - momentum);
  const T decay = static_cast<T>(decay32);
  for (int64_t i = 0; i < t.num_elements(); ++i) {
    const T v = static_cast<T>(t.Get(i));
    const T delta = (v - static_cast<T>(value[static_cast<size_t>(i)])) * decay;
    t.Set(i, static_cast<double>(v - delta));
  }
}

void MovingAverageAny(Variable* var, const std::vector<double>& value, double momentum) {
  if (var->dtype() == DataType::kFloat64) {
    MovingAverage<double>(var, value, momentum);
  } else {
    MovingAverage<float>(var, value, momentum);
  }
}

// The message of the exception being handled (inside a catch block).
std::string CurrentExceptionText() {
  try {
    throw;
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an unknown exception";
  }
}

// The general path's statistics exchange for a synchronized layer (fbn/distributed.h's protocol).
class LayerSync final : public layer_impl::StatsSync {
 public:
  LayerSync(Communicator* comm, DataType dtype, uint64_t* tag, bool* exchanged)
      : comm_(comm), dtype_(dtype), tag_(tag), exchanged_(exchanged) {}

  void MergeMoments(int64_t count, std::vector<double>* mean, std::vector<double>* m2,
                    int64_t* total) override {
    distributed::Gathered g = Exchange(distributed::Pass::kForward, count, *mean, *m2);
    distributed::MergeMoments(g, mean->data(), m2->data(), total);
  }

  void SumGradients(int64_t count, std::vector<double>* sum_g, std::vector<double>* sum_gx,
                    int64_t* total) override {
    distributed::Gathered g = Exchange(distributed::Pass::kBackward, count, *sum_g, *sum_gx);
    distributed::SumPartials(g, sum_g->data(), sum_gx->data(), total);
  }

 private:
  distributed::Gathered Exchange(distributed::Pass pass, int64_t count,
                                 const std::vector<double>& a, const std::vector<double>& b) {
    std::vector<double> partials(a);
    partials.insert(partials.end(), b.begin(), b.end());
    distributed::Gathered g;
    *exchanged_ = true;
    const distributed::PassInfo info{pass, dtype_, static_cast<int64_t>(a.size()), (*tag_)++};
    ThrowIfError(distributed::Exchange(*comm_, info, count, partials.data(), &g));
    return g;
  }

  Communicator* comm_;
  DataType dtype_;
  uint64_t* tag_;
  bool* exchanged_;
};

}  // namespace

namespace layers {

// ============================================================================= Impl

struct BatchNormalization::Impl {
  BatchNormalizationOptions opt;
  std::string name;
  bool trainable = true;
  std::optional<bool> fused;

  // Scoping, as tf_keras's legacy base.Layer: the functional form's name is a scope captured at
  // construction; otherwise one is captured at the first call.
  bool reuse = false;  // the functional form's reuse=True
  std::optional<Graph::ScopeState> scope;
  std::shared_ptr<Graph> graph;  // the graph the layer was built in; null: eager
  std::string eager_scope;

  // Build results.
  bool built = false;
  std::vector<int> axes;  // validated (original indices)
  int rank = 0;
  std::vector<int64_t> axis_dims;
  DataType dtype = DataType::kFloat32;
  DataType param_dtype = DataType::kFloat32;
  Shape param_shape;
  TensorFormat data_format = TensorFormat::kNHWC;
  std::shared_ptr<Variable> gamma, beta, moving_mean, moving_variance, moving_stddev, renorm_mean,
      renorm_stddev;
  std::vector<std::shared_ptr<Variable>> trainable_weights, non_trainable_weights;
  std::vector<std::shared_ptr<RegularizationLoss>> losses;
  std::vector<std::shared_ptr<UpdateOp>> updates;

  // The last successful call, for Backward.
  struct Record {
    bool fused = false;
    bool batch_stats = false;
    bool synced = false;  // batch statistics of a synchronized group of more than one member
    DataType input_dtype = DataType::kFloat32;
    Tensor x;  // in the layer dtype
    // Fused path: the grad op's inputs.
    Tensor scale, rs1, rs2, rs3;
    // General path.
    layer_impl::Geometry geometry;
    layer_impl::GeneralSaved saved;
  };
  std::optional<Record> last;

  // Synchronized layers: the communicator (resolved at the first synchronized pass), the tag of
  // the next exchange (every member counts its passes alike), and whether the pass in progress
  // has taken part in its exchange.
  mutable std::shared_ptr<Communicator> comm;
  mutable uint64_t sync_tag = 0;
  mutable bool exchanged = false;

  // The communicator of a pass with batch statistics, when synchronized over more than one member;
  // null otherwise (a group of one runs the unsynchronized code).
  Communicator* SyncFor(bool batch_stats) const;
  // A synchronized pass that failed on this member before its exchange still takes part in it,
  // so that the other members fail too instead of waiting.
  void FailPass(distributed::Pass pass, const std::string& message) const;

  // What building for an input decides, before anything is created.
  struct Plan {
    std::vector<int> axes;
    bool fused = false;
    TensorFormat format = TensorFormat::kNHWC;
    Shape param_shape;
  };

  Plan MakePlan(const Shape& shape, DataType input_dtype) const;
  void Build(const Plan& plan, const Shape& shape, DataType input_dtype);
  std::shared_ptr<Variable> AddWeight(const std::string& var_name, const Initializer& init,
                                      const Regularizer& reg, const Constraint& constraint,
                                      bool trainable_weight);
  void CheckInputSpec(const Shape& shape) const;
  int64_t Groups(const Shape& shape, bool training_now, bool dynamic) const;
  Tensor FusedForward(const Tensor& x, bool training_now, bool dynamic, Communicator* sync,
                      Record* rec, std::vector<std::shared_ptr<UpdateOp>>* ops,
                      const std::string& op_scope);
  template <typename T>
  Tensor GeneralForward(const Tensor& x, const Shape& input_shape, bool training_now, bool dynamic,
                        Communicator* sync, Record* rec,
                        std::vector<std::shared_ptr<UpdateOp>>* ops, const std::string& op_scope);
  BatchNormalizationGradients BackwardPass(const ConstTensorView& dy, Communicator* sync) const;
  std::shared_ptr<UpdateOp> MakeOp(const std::string& name, std::shared_ptr<Variable> var,
                                   std::function<void()> apply,
                                   std::vector<std::shared_ptr<UpdateOp::Dependency>> deps);
};

Communicator* BatchNormalization::Impl::SyncFor(bool batch_stats) const {
  if (!opt.synchronized || !batch_stats) return nullptr;
  if (!comm) comm = opt.communicator ? opt.communicator : DefaultCommunicator();
  return comm->size() > 1 ? comm.get() : nullptr;
}

void BatchNormalization::Impl::FailPass(distributed::Pass pass, const std::string& message) const {
  if (exchanged || !comm) return;
  exchanged = true;
  distributed::ExchangeFailure(*comm, distributed::PassInfo{pass, dtype, 0, sync_tag++},
                               "layer \"" + name + "\": " + message);
}

BatchNormalization::Impl::Plan BatchNormalization::Impl::MakePlan(const Shape& shape,
                                                                  DataType input_dtype) const {
  Plan plan;
  const int in_rank = shape.rank();
  // tf_utils.validate_axis.
  if (in_rank == 0) {
    throw ValueError("Input has undefined rank. Received: input_shape=" + PyTupleString(shape));
  }
  plan.axes = opt.axis;
  for (int& a : plan.axes) {
    if (a < 0) a += in_rank;
  }
  for (int a : plan.axes) {
    if (a < 0 || a >= in_rank) {
      throw ValueError(
          "Invalid value for `axis` argument. Expected 0 <= axis < inputs.rank (with "
          "inputs.rank=" +
          std::to_string(in_rank) + "). Received: axis=" + PyTuple(plan.axes));
    }
  }
  if (std::set<int>(plan.axes.begin(), plan.axes.end()).size() != plan.axes.size()) {
    throw ValueError("Duplicate axis: " + PyTuple(plan.axes));
  }
  if (opt.virtual_batch_size) {
    if (*opt.virtual_batch_size <= 0) {
      throw ValueError(
          "`virtual_batch_size` must be a positive integer that divides the true batch size of "
          "the input tensor. Received: virtual_batch_size=" +
          std::to_string(*opt.virtual_batch_size));
    }
    if (std::count(plan.axes.begin(), plan.axes.end(), 0)) {
      throw ValueError(
          "When using `virtual_batch_size`, the batch dimension must be 0 and thus axis cannot "
          "include 0. Received axis=" +
          PyList(plan.axes));
    }
    if (opt.adjustment) {
      throw ValueError("When using `virtual_batch_size`, adjustment cannot be specified");
    }
  }
  // Fused resolution (build time).
  bool fused_now = fused.value_or(true);
  if (!fused.has_value() || *fused) {
    if (opt.behavior == LayerBehavior::kKerasV2) {
      if (!fused.has_value()) {
        fused_now =
            (in_rank == 4 || in_rank == 5) && FusedProblem(opt, opt.axis, input_dtype).empty();
      } else if (in_rank != 4 && in_rank != 5) {
        throw ValueError(
            "Batch normalization layers with `fused=True` only support 4D or 5D input tensors. "
            "Received tensor with shape: " +
            PyTupleString(shape));
      } else {
        const std::string problem = FusedProblem(opt, opt.axis, input_dtype);
        if (!problem.empty()) throw ValueError(problem);
      }
    } else {
      // V1: silently falls back wherever the fused op cannot serve.
      fused_now =
          (in_rank == 4 || in_rank == 5) && FusedProblem(opt, plan.axes, input_dtype).empty();
    }
  }
  if (fused_now) {
    const std::vector<int>& ax = plan.axes;
    if (ax == std::vector<int>{1} && in_rank == 4) {
      plan.format = TensorFormat::kNCHW;
    } else if (ax == std::vector<int>{1} && in_rank == 5) {
      plan.format = TensorFormat::kNCDHW;
    } else if (ax == std::vector<int>{3} && in_rank == 4) {
      plan.format = TensorFormat::kNHWC;
    } else if (ax == std::vector<int>{4} && in_rank == 5) {
      plan.format = TensorFormat::kNDHWC;
    } else if (in_rank == 5) {
      fused_now = false;
    } else {
      throw ValueError(
          "Unsupported axis. The use of `fused=True` is only possible with `axis=1` or `axis=3` "
          "for 4D input tensors. Received: axis=" +
          PyTuple(ax));
    }
  }
  plan.fused = fused_now;
  // Parameter shape.
  if (plan.axes.size() == 1 && !opt.virtual_batch_size) {
    plan.param_shape = Shape{shape.dim(plan.axes[0])};
  } else {
    std::vector<int64_t> dims(static_cast<size_t>(in_rank), 1);
    for (int a : plan.axes) dims[static_cast<size_t>(a)] = shape.dim(a);
    if (opt.virtual_batch_size) dims.insert(dims.begin() + 1, 1);
    if (static_cast<int>(dims.size()) > Shape::kMaxRank) {
      throw ValueError("input rank " + std::to_string(in_rank) +
                       " is above what fbn supports here");
    }
    plan.param_shape = Shape(dims.data(), static_cast<int>(dims.size()));
  }
  return plan;
}

std::shared_ptr<Variable> BatchNormalization::Impl::AddWeight(const std::string& var_name,
                                                              const Initializer& init,
                                                              const Regularizer& reg,
                                                              const Constraint& constraint,
                                                              bool trainable_weight) {
  // base.Layer.add_weight: trainable = trainable and self.trainable.
  const bool want_trainable = trainable_weight && trainable;
  std::shared_ptr<Variable> var;
  bool created = true;
  if (graph) {
    var = graph->GetVariable(var_name, param_shape, param_dtype, init, want_trainable, constraint,
                             &created);
  } else {
    var = std::make_shared<Variable>(eager_scope + "/" + var_name + ":0",
                                     init(param_shape, param_dtype), want_trainable, constraint);
  }
  // A reused variable that is not trainable in the graph stays non-trainable here too.
  if (want_trainable && var->trainable()) {
    trainable_weights.push_back(var);
  } else {
    non_trainable_weights.push_back(var);
  }
  if (!reg.empty() && created) {
    auto loss = std::make_shared<RegularizationLoss>(var->op_name() + "/Regularizer", var, reg);
    losses.push_back(loss);
    if (graph) graph->AddToCollection(GraphKeys::kRegularizationLosses, loss);
  }
  return var;
}

void BatchNormalization::Impl::Build(const Plan& plan, const Shape& shape, DataType input_dtype) {
  axes = plan.axes;
  rank = shape.rank();
  axis_dims.clear();
  for (int a : axes) axis_dims.push_back(shape.dim(a));
  dtype = input_dtype;
  param_dtype = ParamDtype(input_dtype);
  param_shape = plan.param_shape;
  data_format = plan.format;
  fused = plan.fused;

  // Variables, in TensorFlow's order. moving_stddev and renorm_stddev start at
  // sqrt(moving_variance_initializer(...)).
  const Initializer sqrt_mv(
      [init = opt.moving_variance_initializer](const Shape& s, DataType t) {
        Tensor v = init(s, t);
        for (int64_t i = 0; i < v.num_elements(); ++i) v.Set(i, std::sqrt(v.Get(i)));
        return v;
      },
      "moving_stddev_initializer");
  if (opt.scale) {
    gamma = AddWeight("gamma", opt.gamma_initializer, opt.gamma_regularizer, opt.gamma_constraint,
                      true);
  }
  if (opt.center) {
    beta = AddWeight("beta", opt.beta_initializer, opt.beta_regularizer, opt.beta_constraint, true);
  }
  moving_mean = AddWeight("moving_mean", opt.moving_mean_initializer, {}, {}, false);
  moving_variance = AddWeight("moving_variance", opt.moving_variance_initializer, {}, {}, false);
  if (opt.renorm) {
    moving_stddev = AddWeight("moving_stddev", sqrt_mv, {}, {}, false);
    renorm_mean = AddWeight("renorm_mean", opt.moving_mean_initializer, {}, {}, false);
    renorm_stddev = AddWeight("renorm_stddev", sqrt_mv, {}, {}, false);
  }
  built = true;
}

void BatchNormalization::Impl::CheckInputSpec(const Shape& shape) const {
  const std::string who = "Input 0 of layer \"" + name + "\" is incompatible with the layer: ";
  if (shape.rank() != rank) {
    throw ValueError(who + "expected ndim=" + std::to_string(rank) +
                     ", found ndim=" + std::to_string(shape.rank()) +
                     ". Full shape received: " + PyTupleString(shape));
  }
  // InputSpec.axes iterates a dict built in axis order.
  for (size_t k = 0; k < axes.size(); ++k) {
    if (shape.dim(axes[k]) != axis_dims[k]) {
      throw ValueError(who + "expected axis " + std::to_string(axes[k]) +
                       " of input shape to have value " + std::to_string(axis_dims[k]) +
                       ", but received input with shape " + PyTupleString(shape));
    }
  }
}

int64_t BatchNormalization::Impl::Groups(const Shape& shape, bool training_now,
                                         bool dynamic) const {
  if (!opt.virtual_batch_size) return 1;
  // With TensorFlow 2 behaviour (on by default, also in tf.compat.v1 graphs), the reshape is
  // [-1, 1, ...] unless training is statically true: one virtual batch, no divisibility check.
  if (dynamic || !training_now) return 1;
  const int64_t vbs = *opt.virtual_batch_size;
  const int64_t n = shape.dim(0);
  if (n % vbs != 0) {
    const int64_t per_row = shape.num_elements() / std::max<int64_t>(n, 1);
    // vbs is the caller's and may be huge: the product must not overflow.
    const std::string multiple = per_row != 0 && vbs > std::numeric_limits<int64_t>::max() / per_row
                                     ? std::to_string(vbs) + "*" + std::to_string(per_row)
                                     : std::to_string(vbs * per_row);
    throw Error(InvalidArgument("Input to reshape is a tensor with " +
                                std::to_string(shape.num_elements()) +
                                " values, but the requested shape requires a multiple of " +
                                multiple + " (Reshape: virtual_batch_size=" + std::to_string(vbs) +
                                " does not divide the batch size " + std::to_string(n) + ")"));
  }
  return n / vbs;
}

std::shared_ptr<UpdateOp> BatchNormalization::Impl::MakeOp(
    const std::string& op_name, std::shared_ptr<Variable> var, std::function<void()> apply,
    std::vector<std::shared_ptr<UpdateOp::Dependency>> deps) {
  return std::make_shared<UpdateOp>(op_name, std::move(var), std::move(apply), std::move(deps));
}

Tensor BatchNormalization::Impl::FusedForward(const Tensor& x, bool training_now, bool dynamic,
                                              Communicator* sync, Record* rec,
                                              std::vector<std::shared_ptr<UpdateOp>>* ops,
                                              const std::string& op_scope) {
  // Constants 1 and 0 stand in for a missing gamma or beta, as TensorFlow's layer does.
  Tensor scale = gamma ? gamma->value() : Tensor::Filled(param_dtype, param_shape, 1.0);
  Tensor offset = beta ? beta->value() : Tensor::Filled(param_dtype, param_shape, 0.0);
  const Tensor& mm = moving_mean->value();
  const Tensor& mv = moving_variance->value();
  FusedBatchNormInputs in{x.view(), scale.view(), offset.view(), mm.view(), mv.view()};
  FusedBatchNormAttrs attrs;
  attrs.epsilon = static_cast<float>(opt.epsilon);
  attrs.exponential_avg_factor = 1.0f;  // the V1 layer averages through its update ops
  attrs.data_format = data_format;
  attrs.is_training = training_now;
  TensorSpec specs[kMaxOpOutputs];
  int n = 0;
  ThrowIfError(FusedBatchNormOutputSpecs(OpVersion::kV3, in, attrs, specs, &n));
  std::vector<Tensor> outs;
  for (int i = 0; i < n; ++i) outs.emplace_back(specs[i].dtype, specs[i].shape);
  const FusedBatchNormOutputs out_views{outs[0].view(), outs[1].view(), outs[2].view(),
                                        outs[3].view(), outs[4].view(), outs[5].view()};
  if (sync) {
    // Global statistics; the moving averages below follow them identically on every member.
    exchanged = true;
    ThrowIfError(SyncFusedBatchNorm(*sync, OpVersion::kV3, in, attrs, out_views, sync_tag++));
  } else {
    ThrowIfError(FusedBatchNorm(OpVersion::kV3, in, attrs, out_views));
  }

  rec->fused = true;
  rec->batch_stats = training_now;
  rec->synced = sync != nullptr;
  rec->scale = scale;
  if (training_now) {
    rec->rs1 = outs[3];
    rec->rs2 = outs[4];
    rec->rs3 = outs[5];
  } else {
    rec->rs1 = mm;
    rec->rs2 = mv;
    rec->rs3 = Tensor(DataType::kFloat32, Shape{});
  }
  if (training_now || dynamic) {
    // With a runtime flag that is false, TensorFlow's update still runs with momentum 1 on the
    // inference branch's outputs: a zero step (NaN for an empty batch, as there).
    const double momentum = training_now ? opt.momentum : 1.0;
    std::vector<double> mean = outs[1].ToDoubles(), var = outs[2].ToDoubles();
    auto mm_var = moving_mean, mv_var = moving_variance;
    ops->push_back(
        MakeOp(op_scope + "/AssignMovingAvg", mm_var,
               [mm_var, mean, momentum] { MovingAverageAny(mm_var.get(), mean, momentum); }, {}));
    ops->push_back(
        MakeOp(op_scope + "/AssignMovingAvg_1", mv_var,
               [mv_var, var, momentum] { MovingAverageAny(mv_var.get(), var, momentum); }, {}));
  }
  return std::move(outs[0]);
}

template <typename T>
Tensor BatchNormalization::Impl::GeneralForward(const Tensor& x, const Shape& input_shape,
                                                bool training_now, bool dynamic, Communicator* sync,
                                                Record* rec,
                                                std::vector<std::shared_ptr<UpdateOp>>* ops,
                                                const std::string& op_scope) {
  const int64_t groups = Groups(input_shape, training_now, dynamic);
  layer_impl::Geometry geo(input_shape, axes, groups);
  const std::vector<T> xs = AsVector<T>(x);
  std::vector<T> g, b, mm = AsVector<T>(moving_mean->value()),
                       mv = AsVector<T>(moving_variance->value()), rmean, rstd;
  if (gamma) g = AsVector<T>(gamma->value());
  if (beta) b = AsVector<T>(beta->value());
  layer_impl::GeneralParams<T> p;
  p.gamma = gamma ? g.data() : nullptr;
  p.beta = beta ? b.data() : nullptr;
  p.moving_mean = mm.data();
  p.moving_variance = mv.data();
  p.epsilon = opt.epsilon;
  // `adjustment` is called whenever training is not statically false, as in TensorFlow; its
  // values apply only when training.
  std::vector<double> adj_s, adj_b;
  std::vector<T> adj_st, adj_bt;
  if (opt.adjustment && (training_now || dynamic)) {
    AdjustmentResult adj = opt.adjustment(input_shape);
    adj_s = BroadcastTo(adj.scale, input_shape, "scale");
    adj_b = BroadcastTo(adj.bias, input_shape, "bias");
    if (training_now) {
      adj_st = AsVector<T>(adj_s);
      adj_bt = AsVector<T>(adj_b);
      p.adj_scale = adj_st.data();
      p.adj_bias = adj_bt.data();
    }
  }
  if (opt.renorm) {
    rmean = AsVector<T>(renorm_mean->value());
    rstd = AsVector<T>(renorm_stddev->value());
    p.renorm = true;
    p.renorm_mean = rmean.data();
    p.renorm_stddev = rstd.data();
    p.rmax = opt.renorm_clipping.rmax;
    p.rmin = opt.renorm_clipping.rmin;
    p.dmax = opt.renorm_clipping.dmax;
  }
  layer_impl::GeneralOutputs<T> out;
  std::optional<LayerSync> layer_sync;
  if (sync) layer_sync.emplace(sync, dtype, &sync_tag, &exchanged);
  layer_impl::GeneralForward<T>(geo, xs.data(), p, training_now, &out,
                                layer_sync ? &*layer_sync : nullptr);

  // The output, in the layer dtype (16-bit layers compute in float and round once).
  Tensor y(dtype, input_shape);
  for (int64_t i = 0; i < y.num_elements(); ++i) y.Set(i, static_cast<double>(out.y[i]));

  rec->fused = false;
  rec->batch_stats = training_now;
  rec->synced = sync != nullptr;
  rec->geometry = geo;
  layer_impl::GeneralSaved& s = rec->saved;
  s.batch_stats = training_now;
  s.epsilon = static_cast<double>(static_cast<T>(opt.epsilon));
  s.mean = training_now ? ToDouble(out.mean) : ToDouble(mm);
  s.variance = training_now ? ToDouble(out.variance) : ToDouble(mv);
  if (gamma) s.gamma = ToDouble(g);
  if (training_now && opt.renorm) {
    s.r = ToDouble(out.r);
    s.d = ToDouble(out.d);
  }
  if (training_now && p.adj_scale) {
    s.adj_scale = ToDouble(adj_st);
    s.adj_bias = ToDouble(adj_bt);
  }

  if (training_now || dynamic) {
    auto mm_var = moving_mean, mv_var = moving_variance;
    if (!training_now) {
      // smart_cond(training, update, identity) with training false: the ops do nothing.
      ops->push_back(MakeOp(op_scope + "/AssignMovingAvg", mm_var, [] {}, {}));
      ops->push_back(MakeOp(op_scope + "/AssignMovingAvg_1", mv_var, [] {}, {}));
      return y;
    }
    const std::vector<double> new_mean = ToDouble(out.new_mean), new_var = ToDouble(out.new_var);
    const double momentum = opt.momentum;
    std::vector<std::shared_ptr<UpdateOp::Dependency>> deps;
    if (opt.renorm) {
      // renorm_mean/renorm_stddev follow the batch mean and stddev with renorm_momentum; both
      // moving-statistics updates depend on these assignments.
      auto rm = renorm_mean, rs = renorm_stddev;
      const std::vector<double> stddev = ToDouble(out.stddev);
      const double rmom = opt.renorm_momentum;
      deps.push_back(std::make_shared<UpdateOp::Dependency>(
          UpdateOp::Dependency{[rm, rs, new_mean, stddev, rmom] {
            MovingAverageAny(rm.get(), new_mean, rmom);
            MovingAverageAny(rs.get(), stddev, rmom);
          }}));
      auto ms = moving_stddev;
      const T eps = static_cast<T>(opt.epsilon);
      std::vector<double> sd_target = stddev;
      ops->push_back(MakeOp(
          op_scope + "/AssignMovingAvg", mm_var,
          [mm_var, new_mean, momentum] { MovingAverageAny(mm_var.get(), new_mean, momentum); },
          deps));
      ops->push_back(MakeOp(
          op_scope + "/AssignMovingAvg_1", mv_var,
          [mv_var, ms, sd_target, momentum, eps] {
            // moving_stddev follows sqrt(var + eps); moving_variance = relu(stddev^2 - eps).
            MovingAverageAny(ms.get(), sd_target, momentum);
            Tensor& v = mv_var->mutable_value();
            const Tensor& sd = ms->value();
            for (int64_t i = 0; i < v.num_elements(); ++i) {
              const T sdi = static_cast<T>(sd.Get(i));
              const T val = sdi * sdi - eps;
              v.Set(i, static_cast<double>(val > T(0) ? val : T(0)));
            }
          },
          deps));
    } else {
      ops->push_back(MakeOp(
          op_scope + "/AssignMovingAvg", mm_var,
          [mm_var, new_mean, momentum] { MovingAverageAny(mm_var.get(), new_mean, momentum); },
          {}));
      ops->push_back(MakeOp(
          op_scope + "/AssignMovingAvg_1", mv_var,
          [mv_var, new_var, momentum] { MovingAverageAny(mv_var.get(), new_var, momentum); }, {}));
    }
  }
  return y;
}

// ============================================================================= Public API

BatchNormalization::BatchNormalization(BatchNormalizationOptions options)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.opt = std::move(options);
  if (m.opt.axis.empty()) {
    throw ValueError(
        "Expected an int or a list/tuple of ints for the argument 'axis', but "
        "received: []");
  }
  if (m.opt.synchronized && m.opt.behavior == LayerBehavior::kKerasV2) {
    // Keras: the synchronized layer is never fused.
    if (m.opt.fused.value_or(false)) {
      throw ValueError("`fused=True` is not supported when `synchronized=True`.");
    }
    m.opt.fused = false;
  }
  m.trainable = m.opt.trainable;
  m.fused = m.opt.fused;
  if (m.opt.behavior == LayerBehavior::kKerasV2) {
    if (m.fused.value_or(false)) {
      const std::string problem = FusedProblem(m.opt, m.opt.axis, std::nullopt);
      if (!problem.empty()) throw ValueError(problem);
    } else if (!m.fused.has_value() && !FusedProblem(m.opt, m.opt.axis, std::nullopt).empty()) {
      m.fused = false;
    }
  } else if (!m.fused.has_value()) {
    m.fused = true;
  }
  if (!m.opt.name.empty()) {
    m.name = m.opt.name;
  } else if (auto g = Graph::GetDefault()) {
    m.name = g->UniqueLayerName(kBaseName);
  } else {
    m.name = EagerUnique(kBaseName, /*zero_based=*/false);
  }
}

BatchNormalization::~BatchNormalization() = default;

Tensor BatchNormalization::Call(const ConstTensorView& inputs, const Training& training) {
  Impl& m = *impl_;
  // A synchronized call with batch statistics is collective: if it fails here before its
  // exchange, the other members learn of it from a failure record instead of waiting for one.
  const bool batch_stats =
      training.value() && !(m.opt.behavior == LayerBehavior::kKerasV2 && !m.trainable);
  Communicator* sync = m.SyncFor(batch_stats);
  if (!sync) return CallImpl(inputs, training, nullptr);
  m.exchanged = false;
  try {
    return CallImpl(inputs, training, sync);
  } catch (...) {
    m.FailPass(distributed::Pass::kForward, CurrentExceptionText());
    throw;
  }
}

Tensor BatchNormalization::CallImpl(const ConstTensorView& inputs, const Training& training,
                                    Communicator* sync) {
  Impl& m = *impl_;
  // Validate the input view itself.
  if (static_cast<int>(inputs.dtype) < 0 || static_cast<int>(inputs.dtype) > 3) {
    throw TypeError("inputs must be float16, bfloat16, float32 or float64");
  }
  ThrowIfError(inputs.shape.Validate("inputs"));
  if (inputs.shape.num_elements() > 0 && inputs.data == nullptr) {
    throw Error(InvalidArgument("inputs has no data"));
  }
  std::shared_ptr<Graph> graph = Graph::GetDefault();
  if (m.built && graph != m.graph) {
    throw ValueError("Layer \"" + m.name + "\" was built " +
                     (m.graph ? std::string("in another graph") : std::string("eagerly")) +
                     " and cannot be called " +
                     (graph ? std::string("in this graph") : std::string("eagerly")));
  }
  // `training`: static or runtime; Keras V2 runs a frozen layer in inference mode.
  bool dynamic = training.is_dynamic();
  bool training_now = training.value();
  if (m.opt.behavior == LayerBehavior::kKerasV2 && !m.trainable) {
    dynamic = false;
    training_now = false;
  }

  const Shape& shape = inputs.shape;
  // Scopes (graph mode): capture at the first call, re-enter at each call, as base.Layer does.
  std::string scope_name;
  if (graph) {
    if (!m.scope) {
      if (m.reuse) {
        graph->EnterScope(m.opt.name.empty() ? kBaseName : m.opt.name, Reuse::kInherit);
      } else {
        graph->EnterScope("", Reuse::kInherit, m.opt.name.empty() ? kBaseName : m.opt.name);
      }
      m.scope = graph->current_scope();
      graph->ExitScope();
    }
    graph->EnterCapturedScope(*m.scope, (m.built || m.reuse) ? Reuse::kReuse : Reuse::kInherit);
    scope_name = m.scope->name;
  } else if (m.eager_scope.empty()) {
    m.eager_scope = m.opt.name.empty() ? EagerUnique(kBaseName, /*zero_based=*/true) : m.opt.name;
  }
  Tensor y;
  Impl::Record rec;
  std::vector<std::shared_ptr<UpdateOp>> ops;
  try {
    // Validation after the scope is taken (TensorFlow builds inside it), before anything is
    // created or written.
    std::optional<Impl::Plan> plan;
    if (!m.built) {
      plan = m.MakePlan(shape, inputs.dtype);
    } else {
      m.CheckInputSpec(shape);
    }
    // A batch the virtual batch size does not divide fails before anything is created.
    if (m.opt.virtual_batch_size) (void)m.Groups(shape, training_now, dynamic);
    if (!m.built) {
      m.graph = graph;
      try {
        m.Build(*plan, shape, inputs.dtype);
      } catch (...) {
        // Leave the layer unbuilt: a later call may succeed (TensorFlow's layer stays unbuilt
        // after a failing build too).
        m.graph = nullptr;
        m.gamma = m.beta = m.moving_mean = m.moving_variance = nullptr;
        m.moving_stddev = m.renorm_mean = m.renorm_stddev = nullptr;
        m.trainable_weights.clear();
        m.non_trainable_weights.clear();
        m.losses.clear();
        throw;
      }
    }
    // Inputs are cast to the layer dtype (its compute dtype).
    Tensor x = Tensor::Copy(inputs);
    if (x.dtype() != m.dtype) x = x.Cast(m.dtype);
    const std::string op_scope =
        graph ? graph->UniqueOpName(scope_name) : (m.opt.name.empty() ? m.eager_scope : m.name);
    if (*m.fused) {
      y = m.FusedForward(x, training_now, dynamic, sync, &rec, &ops, op_scope);
    } else if (m.param_dtype == DataType::kFloat64) {
      y = m.GeneralForward<double>(x, shape, training_now, dynamic, sync, &rec, &ops, op_scope);
    } else {
      y = m.GeneralForward<float>(x, shape, training_now, dynamic, sync, &rec, &ops, op_scope);
    }
    rec.x = std::move(x);
    rec.input_dtype = inputs.dtype;
  } catch (...) {
    if (graph) graph->ExitScope();
    throw;
  }
  if (graph) graph->ExitScope();

  // Nothing has been written so far; now the updates are applied (eager) or recorded (graph).
  if (graph) {
    m.updates.insert(m.updates.end(), ops.begin(), ops.end());
    for (const auto& op : updates()) graph->AddToCollectionUnique(GraphKeys::kUpdateOps, op);
  } else {
    RunUpdateOps(ops);
  }
  m.last = std::move(rec);
  return y;
}

BatchNormalizationGradients BatchNormalization::Backward(const ConstTensorView& dy) const {
  const Impl& m = *impl_;
  // The backward pass of a synchronized training call is collective, like the call.
  Communicator* sync = (m.last && m.last->synced) ? m.comm.get() : nullptr;
  if (!sync) return m.BackwardPass(dy, nullptr);
  m.exchanged = false;
  try {
    return m.BackwardPass(dy, sync);
  } catch (...) {
    m.FailPass(distributed::Pass::kBackward, CurrentExceptionText());
    throw;
  }
}

BatchNormalizationGradients BatchNormalization::Impl::BackwardPass(const ConstTensorView& dy,
                                                                   Communicator* sync) const {
  const Impl& m = *this;
  if (!m.last) {
    throw Error(
        InvalidArgument("Backward needs a previous successful call of layer \"" + m.name + "\""));
  }
  const Impl::Record& rec = *m.last;
  if (dy.shape != rec.x.shape()) {
    throw Error(InvalidArgument("dy has shape " + dy.shape.DebugString() +
                                " but the last output has shape " + rec.x.shape().DebugString()));
  }
  if (dy.shape.num_elements() > 0 && dy.data == nullptr) {
    throw Error(InvalidArgument("dy has no data"));
  }
  Tensor dy_t = Tensor::Copy(dy);
  if (dy_t.dtype() != m.dtype) dy_t = dy_t.Cast(m.dtype);
  BatchNormalizationGradients grads;
  if (rec.fused) {
    FusedBatchNormGradInputs in{dy_t.view(),    rec.x.view(),   rec.scale.view(),
                                rec.rs1.view(), rec.rs2.view(), rec.rs3.view()};
    FusedBatchNormGradAttrs attrs;
    attrs.epsilon = static_cast<float>(m.opt.epsilon);
    attrs.data_format = m.data_format;
    attrs.is_training = rec.batch_stats;
    TensorSpec specs[kMaxOpOutputs];
    int n = 0;
    ThrowIfError(FusedBatchNormGradOutputSpecs(OpVersion::kV3, in, attrs, specs, &n));
    std::vector<Tensor> outs;
    for (int i = 0; i < n; ++i) outs.emplace_back(specs[i].dtype, specs[i].shape);
    const FusedBatchNormGradOutputs out_views{outs[0].view(), outs[1].view(), outs[2].view(),
                                              outs[3].view(), outs[4].view()};
    if (sync) {
      m.exchanged = true;
      ThrowIfError(
          SyncFusedBatchNormGrad(*sync, OpVersion::kV3, in, attrs, out_views, m.sync_tag++));
    } else {
      ThrowIfError(FusedBatchNormGrad(OpVersion::kV3, in, attrs, out_views));
    }
    grads.dx = std::move(outs[0]);
    if (m.gamma) grads.dgamma = outs[1].Reshaped(m.param_shape);
    if (m.beta) grads.dbeta = outs[2].Reshaped(m.param_shape);
  } else {
    const std::vector<double> x = rec.x.ToDoubles(), d = dy_t.ToDoubles();
    std::vector<double> dx, dgamma, dbeta;
    std::optional<LayerSync> layer_sync;
    if (sync) layer_sync.emplace(sync, m.dtype, &m.sync_tag, &m.exchanged);
    layer_impl::GeneralBackward(rec.geometry, x.data(), d.data(), rec.saved, &dx, &dgamma, &dbeta,
                                layer_sync ? &*layer_sync : nullptr);
    // dx is computed in the compute type (float for 16-bit layers) and rounded once.
    grads.dx = Tensor::FromDoubles(m.dtype, rec.x.shape(), dx);
    if (m.gamma) grads.dgamma = Tensor::FromDoubles(m.param_dtype, m.param_shape, dgamma);
    if (m.beta) grads.dbeta = Tensor::FromDoubles(m.param_dtype, m.param_shape, dbeta);
  }
  if (grads.dx.dtype() != rec.input_dtype) grads.dx = grads.dx.Cast(rec.input_dtype);
  return grads;
}

const std::string& BatchNormalization::name() const { return impl_->name; }
bool BatchNormalization::built() const { return impl_->built; }
std::optional<bool> BatchNormalization::fused() const { return impl_->fused; }
const BatchNormalizationOptions& BatchNormalization::options() const { return impl_->opt; }
bool BatchNormalization::trainable() const { return impl_->trainable; }
void BatchNormalization::set_trainable(bool trainable) { impl_->trainable = trainable; }
std::vector<int> BatchNormalization::axis() const { return impl_->axes; }
DataType BatchNormalization::dtype() const { return impl_->dtype; }
std::shared_ptr<Variable> BatchNormalization::gamma() const { return impl_->gamma; }
std::shared_ptr<Variable> BatchNormalization::beta() const { return impl_->beta; }
std::shared_ptr<Variable> BatchNormalization::moving_mean() const { return impl_->moving_mean; }
std::shared_ptr<Variable> BatchNormalization::moving_variance() const {
  return impl_->moving_variance;
}
std::shared_ptr<Variable> BatchNormalization::moving_stddev() const { return impl_->moving_stddev; }
std::shared_ptr<Variable> BatchNormalization::renorm_mean() const { return impl_->renorm_mean; }
std::shared_ptr<Variable> BatchNormalization::renorm_stddev() const { return impl_->renorm_stddev; }

std::vector<std::shared_ptr<Variable>> BatchNormalization::trainable_variables() const {
  return impl_->trainable ? impl_->trainable_weights : std::vector<std::shared_ptr<Variable>>{};
}

std::vector<std::shared_ptr<Variable>> BatchNormalization::non_trainable_variables() const {
  if (impl_->trainable) return impl_->non_trainable_weights;
  std::vector<std::shared_ptr<Variable>> all = impl_->trainable_weights;
  all.insert(all.end(), impl_->non_trainable_weights.begin(), impl_->non_trainable_weights.end());
  return all;
}

std::vector<std::shared_ptr<Variable>> BatchNormalization::variables() const {
  std::vector<std::shared_ptr<Variable>> all = trainable_variables();
  const auto rest = non_trainable_variables();
  all.insert(all.end(), rest.begin(), rest.end());
  return all;
}

std::vector<std::shared_ptr<RegularizationLoss>> BatchNormalization::losses() const {
  return impl_->losses;
}

std::vector<std::shared_ptr<UpdateOp>> BatchNormalization::updates() const {
  // Keras collects no updates from a non-trainable layer: in a graph, a frozen layer's moving
  // statistics never reach UPDATE_OPS.
  return impl_->trainable ? impl_->updates : std::vector<std::shared_ptr<UpdateOp>>{};
}

Tensor ApplyBatchNormalization(const ConstTensorView& inputs,
                               const BatchNormalizationOptions& options, const Training& training,
                               std::optional<bool> reuse,
                               std::shared_ptr<BatchNormalization>* layer_out) {
  std::shared_ptr<Graph> graph = Graph::GetDefault();
  if (!graph) {
    throw ValueError(
        "batch_normalization (the functional form of the layer) needs a default graph: its "
        "variables would have nowhere to live. Call it under `with fbn.Graph().as_default():` "
        "(C++: Graph::AsDefault()), or use the object form BatchNormalization(...), which works "
        "eagerly.");
  }
  auto layer = std::make_shared<BatchNormalization>(options);
  BatchNormalization::Impl& m = *layer->impl_;
  m.reuse = reuse.value_or(false);
  if (!options.name.empty()) {
    // base.Layer(_scope=name): the scope is entered (and captured) at construction.
    graph->EnterScope(options.name, Reuse::kInherit);
    m.scope = graph->current_scope();
    graph->ExitScope();
  }
  if (layer_out) *layer_out = layer;
  return layer->Call(inputs, training);
}

}  // namespace layers
}  // namespace fbn
