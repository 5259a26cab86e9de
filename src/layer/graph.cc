#include "fbn/graph.h"

#include <algorithm>
#include <set>
#include <string>
#include <utility>

#include "layer/names.h"

namespace fbn {

GraphObject::~GraphObject() = default;

// ----------------------------------------------------------------------------- Variable

Variable::Variable(std::string name, Tensor value, bool trainable, Constraint constraint)
    : name_(std::move(name)),
      value_(std::move(value)),
      trainable_(trainable),
      constraint_(std::move(constraint)) {}

std::string Variable::op_name() const {
  const size_t colon = name_.rfind(':');
  return colon == std::string::npos ? name_ : name_.substr(0, colon);
}

void Variable::Assign(const Tensor& value) {
  if (!value.valid() || value.shape() != value_.shape()) {
    throw ValueError("Cannot assign value of shape " +
                     (value.valid() ? PyTupleString(value.shape()) : std::string("None")) +
                     " to variable " + name_ + " of shape " + PyTupleString(value_.shape()));
  }
  value_ = value.dtype() == value_.dtype() ? value : value.Cast(value_.dtype());
}

// ----------------------------------------------------------------------------- UpdateOp

UpdateOp::UpdateOp(std::string name, std::shared_ptr<Variable> variable,
                   std::function<void()> apply, std::vector<std::shared_ptr<Dependency>> deps)
    : name_(std::move(name)),
      variable_(std::move(variable)),
      apply_(std::move(apply)),
      dependencies_(std::move(deps)) {}

void UpdateOp::Run() {
  for (const auto& dep : dependencies_) {
    if (dep->run) dep->run();
  }
  if (apply_) apply_();
}

void RunUpdateOps(const std::vector<std::shared_ptr<UpdateOp>>& ops) {
  std::set<const UpdateOp::Dependency*> done;
  for (const auto& op : ops) {
    if (!op) continue;
    for (const auto& dep : op->dependencies_) {
      if (done.insert(dep.get()).second && dep->run) dep->run();
    }
  }
  for (const auto& op : ops) {
    if (op && op->apply_) op->apply_();
  }
}

// ----------------------------------------------------------------------------- Loss

RegularizationLoss::RegularizationLoss(std::string name, std::shared_ptr<Variable> variable,
                                       Regularizer regularizer)
    : name_(std::move(name)),
      variable_(std::move(variable)),
      regularizer_(std::move(regularizer)) {}

Tensor RegularizationLoss::Value() const {
  Tensor t(variable_->dtype(), Shape{});
  t.Set(0, regularizer_.Loss(variable_->value()));
  return t;
}

Tensor RegularizationLoss::Gradient() const { return regularizer_.Gradient(variable_->value()); }

// ----------------------------------------------------------------------------- Graph

namespace {
thread_local std::vector<std::shared_ptr<Graph>> default_stack;
}  // namespace

struct Graph::Impl {
  struct Frame {
    ScopeState state;
    bool captured = false;
    std::map<std::string, int> saved_counts;  // restored on exit of a captured scope
  };
  ScopeState root;
  std::vector<Frame> frames;
  std::map<std::string, int> scope_counts;
  std::map<std::string, std::shared_ptr<Variable>> variables;  // by op name ("bn/gamma")
  std::map<std::string, std::vector<std::shared_ptr<GraphObject>>> collections;
  std::map<std::string, int> layer_uids;
  std::map<std::string, int> op_uids;

  const ScopeState& current() const { return frames.empty() ? root : frames.back().state; }
  int count(const std::string& name) const {
    auto it = scope_counts.find(name);
    return it == scope_counts.end() ? 0 : it->second;
  }
};

Graph::Graph() : impl_(std::make_unique<Impl>()) {}
Graph::~Graph() = default;

std::shared_ptr<Graph> Graph::Create() { return std::shared_ptr<Graph>(new Graph()); }

std::shared_ptr<Graph> Graph::GetDefault() {
  return default_stack.empty() ? nullptr : default_stack.back();
}

void Graph::PushDefault() { default_stack.push_back(shared_from_this()); }

void Graph::PopDefault() {
  if (default_stack.empty() || default_stack.back().get() != this) {
    throw Error(Status(StatusCode::kInternal,
                       "Graph::PopDefault: this graph is not the default "
                       "(improper nesting of as_default)"));
  }
  default_stack.pop_back();
}

Graph::DefaultGuard::DefaultGuard(std::shared_ptr<Graph> graph) : graph_(std::move(graph)) {
  graph_->PushDefault();
}
Graph::DefaultGuard::~DefaultGuard() {
  if (!default_stack.empty() && default_stack.back() == graph_) default_stack.pop_back();
}

const Graph::ScopeState& Graph::current_scope() const { return impl_->current(); }

std::string Graph::EnterScope(const std::string& name, Reuse reuse,
                              const std::string& default_name) {
  const ScopeState& cur = impl_->current();
  std::string relative = name;
  if (relative.empty()) {
    if (default_name.empty())
      throw TypeError("If default_name is None then name_or_scope is required");
    if (reuse != Reuse::kInherit) {
      throw ValueError("reuse=True cannot be used without a name_or_scope");
    }
    // _get_unique_variable_scope: the first free "<default>", "<default>_1", ... here.
    const std::string prefix = cur.name.empty() ? default_name : cur.name + "/" + default_name;
    relative = default_name;
    if (impl_->count(prefix) > 0) {
      int idx = 1;
      while (impl_->count(prefix + "_" + std::to_string(idx)) > 0) ++idx;
      relative = default_name + "_" + std::to_string(idx);
    }
  }
  Impl::Frame frame;
  frame.state.name = cur.name.empty() ? relative : cur.name + "/" + relative;
  if (reuse == Reuse::kReuse) {
    frame.state.reuse = true;
  } else if (reuse == Reuse::kAutoReuse) {
    frame.state.auto_reuse = true;
  } else {
    frame.state.reuse = cur.reuse;
    frame.state.auto_reuse = cur.auto_reuse;
  }
  impl_->scope_counts[frame.state.name] += 1;
  impl_->frames.push_back(frame);
  return impl_->frames.back().state.name;
}

void Graph::EnterCapturedScope(const ScopeState& scope, Reuse reuse) {
  Impl::Frame frame;
  frame.state = scope;
  if (reuse == Reuse::kReuse) {
    frame.state.reuse = true;
    frame.state.auto_reuse = false;
  } else if (reuse == Reuse::kAutoReuse) {
    frame.state.reuse = false;
    frame.state.auto_reuse = true;
  }
  frame.captured = true;
  impl_->scope_counts[scope.name] += 1;
  frame.saved_counts = impl_->scope_counts;
  impl_->frames.push_back(std::move(frame));
}

void Graph::ExitScope() {
  if (impl_->frames.empty()) {
    throw Error(Status(StatusCode::kInternal, "Graph::ExitScope without a matching EnterScope"));
  }
  Impl::Frame frame = std::move(impl_->frames.back());
  impl_->frames.pop_back();
  if (frame.captured) {
    impl_->scope_counts = std::move(frame.saved_counts);
  } else {
    // close_variable_subscopes: names made unique inside start over next time.
    const std::string prefix = frame.state.name + "/";
    for (auto& [key, count] : impl_->scope_counts) {
      if (key.compare(0, prefix.size(), prefix) == 0) count = 0;
    }
  }
}

std::shared_ptr<Variable> Graph::GetVariable(const std::string& name, const Shape& shape,
                                             DataType dtype, const Initializer& initializer,
                                             bool trainable, const Constraint& constraint,
                                             bool* created) {
  const ScopeState& cur = impl_->current();
  const std::string full = cur.name.empty() ? name : cur.name + "/" + name;
  if (created) *created = false;
  auto it = impl_->variables.find(full);
  if (it != impl_->variables.end()) {
    if (!cur.reuse && !cur.auto_reuse) {
      throw ValueError("Variable " + full +
                       " already exists, disallowed. Did you mean to set reuse=True or "
                       "reuse=tf.AUTO_REUSE in VarScope?");
    }
    const Variable& found = *it->second;
    if (found.shape() != shape) {
      throw ValueError("Trying to share variable " + full + ", but specified shape " +
                       PyTupleString(shape) + " and found shape " + PyTupleString(found.shape()) +
                       ".");
    }
    if (found.dtype() != dtype) {
      throw ValueError("Trying to share variable " + full + ", but specified dtype " +
                       layer_impl::PyDtypeName(dtype) + " and found dtype " +
                       layer_impl::PyDtypeName(found.dtype()) + ".");
    }
    return it->second;
  }
  if (cur.reuse && !cur.auto_reuse) {
    throw ValueError("Variable " + full +
                     " does not exist, or was not created with tf.get_variable(). Did you mean "
                     "to set reuse=tf.AUTO_REUSE in VarScope?");
  }
  auto var =
      std::make_shared<Variable>(full + ":0", initializer(shape, dtype), trainable, constraint);
  impl_->variables[full] = var;
  AddToCollection(GraphKeys::kGlobalVariables, var);
  if (trainable) AddToCollection(GraphKeys::kTrainableVariables, var);
  if (created) *created = true;
  return var;
}

std::vector<std::shared_ptr<GraphObject>> Graph::GetCollection(const std::string& key) const {
  auto it = impl_->collections.find(key);
  return it == impl_->collections.end() ? std::vector<std::shared_ptr<GraphObject>>{} : it->second;
}

void Graph::AddToCollection(const std::string& key, std::shared_ptr<GraphObject> object) {
  impl_->collections[key].push_back(std::move(object));
}

void Graph::AddToCollectionUnique(const std::string& key, std::shared_ptr<GraphObject> object) {
  auto& list = impl_->collections[key];
  if (std::find(list.begin(), list.end(), object) == list.end()) list.push_back(std::move(object));
}

namespace {
template <typename T>
std::vector<std::shared_ptr<T>> Typed(const std::vector<std::shared_ptr<GraphObject>>& objects) {
  std::vector<std::shared_ptr<T>> out;
  for (const auto& o : objects) {
    if (auto t = std::dynamic_pointer_cast<T>(o)) out.push_back(std::move(t));
  }
  return out;
}
}  // namespace

std::vector<std::shared_ptr<Variable>> Graph::global_variables() const {
  return Typed<Variable>(GetCollection(GraphKeys::kGlobalVariables));
}
std::vector<std::shared_ptr<Variable>> Graph::trainable_variables() const {
  return Typed<Variable>(GetCollection(GraphKeys::kTrainableVariables));
}
std::vector<std::shared_ptr<UpdateOp>> Graph::update_ops() const {
  return Typed<UpdateOp>(GetCollection(GraphKeys::kUpdateOps));
}
std::vector<std::shared_ptr<RegularizationLoss>> Graph::regularization_losses() const {
  return Typed<RegularizationLoss>(GetCollection(GraphKeys::kRegularizationLosses));
}

std::string Graph::UniqueLayerName(const std::string& base) {
  return base + "_" + std::to_string(++impl_->layer_uids[base]);
}

std::string Graph::UniqueOpName(const std::string& base) {
  const int n = impl_->op_uids[base]++;
  return n == 0 ? base : base + "_" + std::to_string(n);
}

// ----------------------------------------------------------------------------- VariableScope

VariableScope::VariableScope(const std::string& name, Reuse reuse, const std::string& default_name)
    : graph_(Graph::GetDefault()) {
  if (!graph_) {
    throw ValueError(
        "fbn::VariableScope needs a default graph: variables live in a Graph (enter one with "
        "Graph::AsDefault())");
  }
  name_ = graph_->EnterScope(name, reuse, default_name);
}

VariableScope::~VariableScope() {
  try {
    graph_->ExitScope();
  } catch (...) {
    // Destructors must not throw; improper nesting is a caller bug already reported by
    // ExitScope's other callers.
  }
}

}  // namespace fbn
