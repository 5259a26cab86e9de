// TF1-style graph state for the layer API: a Graph owns variables (created through variable
// scopes, named as tf.compat.v1.get_variable names them) and named collections of variables,
// update ops and regularization losses.
//
// Execution is eager: a layer call computes its output at once. What a TF1 graph defers to
// session runs is deferred here too: the moving-average updates of a training call are UpdateOps,
// and the moving statistics do not change until they are run. A regularization loss is evaluated
// when read, from the variable's value at that time.
//
// A Graph is built and run from one thread at a time. The default-graph stack is per thread.
#ifndef FBN_GRAPH_H_
#define FBN_GRAPH_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fbn/export.h"
#include "fbn/initializers.h"
#include "fbn/status.h"
#include "fbn/tensor.h"
#include "fbn/types.h"

namespace fbn {

// Raised for what TensorFlow reports with Python's ValueError (bad layer configuration, variable
// store misuse). It is an fbn::Error with code kInvalidArgument, so one catch covers both.
class FBN_API ValueError : public Error {
 public:
  explicit ValueError(const std::string& message)
      : Error(Status(StatusCode::kInvalidArgument, message)) {}
};

// Raised for what TensorFlow reports with Python's TypeError.
class FBN_API TypeError : public Error {
 public:
  explicit TypeError(const std::string& message)
      : Error(Status(StatusCode::kInvalidArgument, message)) {}
};

// Anything a collection can hold.
class FBN_API GraphObject {
 public:
  virtual ~GraphObject();
  // TensorFlow's name: "bn/gamma:0" for a variable, "bn/AssignMovingAvg" for an update op.
  virtual const std::string& name() const = 0;
};

class FBN_API Variable : public GraphObject {
 public:
  Variable(std::string name, Tensor value, bool trainable, Constraint constraint = {});

  const std::string& name() const override { return name_; }
  // The name without the ":0" output suffix, as get_variable's `name` would be.
  std::string op_name() const;
  const Tensor& value() const { return value_; }
  DataType dtype() const { return value_.dtype(); }
  const Shape& shape() const { return value_.shape(); }
  bool trainable() const { return trainable_; }
  const Constraint& constraint() const { return constraint_; }

  // Replaces the value; ValueError when `value`'s shape differs (another dtype is cast).
  void Assign(const Tensor& value);
  // Direct access for fbn's own updates (same shape and dtype must be kept).
  Tensor& mutable_value() { return value_; }

 private:
  std::string name_;
  Tensor value_;
  bool trainable_;
  Constraint constraint_;
};

// A deferred assignment, as the ops in TensorFlow's UPDATE_OPS collection. Running it applies its
// assignment to the variables' current values; running it again applies it again (as running the
// same op in another session run does). Dependencies shared between ops (batch renormalization's
// renorm_mean/renorm_stddev updates, which both moving-statistics updates depend on in TensorFlow)
// run once per Run call: RunUpdateOps({a, b}) runs them once, a->Run(); b->Run() twice.
class FBN_API UpdateOp : public GraphObject {
 public:
  // A step that runs before the ops depending on it, once per RunUpdateOps call.
  struct Dependency {
    std::function<void()> run;
  };

  UpdateOp(std::string name, std::shared_ptr<Variable> variable, std::function<void()> apply,
           std::vector<std::shared_ptr<Dependency>> dependencies = {});

  const std::string& name() const override { return name_; }
  // The variable this op assigns (moving_mean or moving_variance).
  const std::shared_ptr<Variable>& variable() const { return variable_; }
  void Run();

 private:
  friend FBN_API void RunUpdateOps(const std::vector<std::shared_ptr<UpdateOp>>& ops);
  std::string name_;
  std::shared_ptr<Variable> variable_;
  std::function<void()> apply_;
  std::vector<std::shared_ptr<Dependency>> dependencies_;
};

// Runs `ops` as one TensorFlow session run: each shared dependency once, then each op in order.
FBN_API void RunUpdateOps(const std::vector<std::shared_ptr<UpdateOp>>& ops);

// A regularizer's loss on one variable, evaluated when read.
class FBN_API RegularizationLoss : public GraphObject {
 public:
  RegularizationLoss(std::string name, std::shared_ptr<Variable> variable, Regularizer regularizer);

  const std::string& name() const override { return name_; }
  const std::shared_ptr<Variable>& variable() const { return variable_; }
  const Regularizer& regularizer() const { return regularizer_; }
  // The loss for the variable's current value, as a scalar in the variable's dtype.
  Tensor Value() const;
  // d(loss)/d(variable), in the variable's shape and dtype; ValueError for a regularizer without a
  // gradient function.
  Tensor Gradient() const;

 private:
  std::string name_;
  std::shared_ptr<Variable> variable_;
  Regularizer regularizer_;
};

// tf.compat.v1.GraphKeys: the collection names TensorFlow uses.
struct GraphKeys {
  static constexpr const char* kGlobalVariables = "variables";
  static constexpr const char* kTrainableVariables = "trainable_variables";
  static constexpr const char* kUpdateOps = "update_ops";
  static constexpr const char* kRegularizationLosses = "regularization_losses";
};

// A variable scope's reuse mode: kInherit is TensorFlow's None (also what reuse=False means when
// entering a scope: it cannot undo an outer reuse); kReuse is True; kAutoReuse is AUTO_REUSE.
enum class Reuse { kInherit = 0, kReuse = 1, kAutoReuse = 2 };

class FBN_API Graph : public std::enable_shared_from_this<Graph> {
 public:
  static std::shared_ptr<Graph> Create();
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  // --- Default graph (a per-thread stack; empty means eager execution).
  static std::shared_ptr<Graph> GetDefault();
  void PushDefault();
  // Pops this graph; Error (kInternal) when it is not on top (improper nesting).
  void PopDefault();
  // RAII form of Push/PopDefault: `auto g = graph->AsDefault();`.
  class FBN_API DefaultGuard {
   public:
    explicit DefaultGuard(std::shared_ptr<Graph> graph);
    ~DefaultGuard();
    DefaultGuard(const DefaultGuard&) = delete;
    DefaultGuard& operator=(const DefaultGuard&) = delete;

   private:
    std::shared_ptr<Graph> graph_;
  };
  DefaultGuard AsDefault() { return DefaultGuard(shared_from_this()); }

  // --- Variable scopes (tf.compat.v1.variable_scope).
  struct ScopeState {
    std::string name;  // "" at the root, else "outer/inner"
    bool reuse = false;
    bool auto_reuse = false;
  };
  const ScopeState& current_scope() const;
  // Enters `name` relative to the current scope; reuse kInherit keeps the outer scope's mode.
  // An empty name with a non-empty default_name enters default_name made unique, as TF does
  // ("batch_normalization", then "batch_normalization_1", ...); reuse must then be kInherit.
  // Returns the entered scope's full name. Exit with ExitScope, innermost first.
  std::string EnterScope(const std::string& name, Reuse reuse,
                         const std::string& default_name = "");
  // Re-enters a scope captured earlier (TensorFlow's `variable_scope(scope_object)`): the same
  // full name, reuse from the capture unless `reuse` is kReuse/kAutoReuse.
  void EnterCapturedScope(const ScopeState& scope, Reuse reuse);
  void ExitScope();

  // tf.compat.v1.get_variable in the current scope: "<scope>/<name>:0". An existing variable is
  // returned when the scope reuses (shape and dtype must match); a new one is created when it
  // does not (kReuse with a missing variable, and no reuse with an existing one, are ValueErrors
  // with TensorFlow's texts). A new variable joins GLOBAL_VARIABLES, and TRAINABLE_VARIABLES when
  // trainable. `created` (optional) tells which happened.
  std::shared_ptr<Variable> GetVariable(const std::string& name, const Shape& shape, DataType dtype,
                                        const Initializer& initializer, bool trainable,
                                        const Constraint& constraint = {}, bool* created = nullptr);

  // --- Collections.
  std::vector<std::shared_ptr<GraphObject>> GetCollection(const std::string& key) const;
  void AddToCollection(const std::string& key, std::shared_ptr<GraphObject> object);
  // Adds unless the very object is already there (TensorFlow's layer bookkeeping).
  void AddToCollectionUnique(const std::string& key, std::shared_ptr<GraphObject> object);
  std::vector<std::shared_ptr<Variable>> global_variables() const;
  std::vector<std::shared_ptr<Variable>> trainable_variables() const;
  std::vector<std::shared_ptr<UpdateOp>> update_ops() const;
  std::vector<std::shared_ptr<RegularizationLoss>> regularization_losses() const;

  // --- Names.
  // backend.unique_object_name: "batch_normalization", then "_1", "_2", ... per graph.
  std::string UniqueLayerName(const std::string& base);
  // A graph-unique op name: `base`, then `base_1`, ...
  std::string UniqueOpName(const std::string& base);

 private:
  Graph();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// RAII tf.compat.v1.variable_scope on the default graph (ValueError when there is none).
class FBN_API VariableScope {
 public:
  explicit VariableScope(const std::string& name, Reuse reuse = Reuse::kInherit,
                         const std::string& default_name = "");
  ~VariableScope();
  VariableScope(const VariableScope&) = delete;
  VariableScope& operator=(const VariableScope&) = delete;
  const std::string& name() const { return name_; }

 private:
  std::shared_ptr<Graph> graph_;
  std::string name_;
};

}  // namespace fbn

#endif  // FBN_GRAPH_H_
