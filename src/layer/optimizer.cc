#include "fbn/optimizer.h"

#include <string>

namespace fbn {
namespace {

template <typename T>
void SgdStep(Tensor* w, const Tensor& g, Tensor* velocity, double lr_d, double momentum_d,
             bool nesterov) {
  // Keras casts the hyperparameters to the variable's dtype.
  const T lr = static_cast<T>(lr_d), momentum = static_cast<T>(momentum_d);
  for (int64_t i = 0; i < w->num_elements(); ++i) {
    const T grad = static_cast<T>(g.Get(i));
    const T v = static_cast<T>(w->Get(i));
    if (velocity) {
      const T m = -grad * lr + static_cast<T>(velocity->Get(i)) * momentum;
      velocity->Set(i, static_cast<double>(m));
      w->Set(i, static_cast<double>(nesterov ? v + (-grad * lr + m * momentum) : v + m));
    } else {
      w->Set(i, static_cast<double>(v + -grad * lr));
    }
  }
}

}  // namespace

SGD::SGD(double learning_rate, double momentum, bool nesterov)
    : learning_rate_(learning_rate), momentum_(momentum), nesterov_(nesterov) {
  if (momentum < 0.0 || momentum > 1.0) {
    throw ValueError("`momentum` must be between [0, 1].");
  }
}

void SGD::ApplyGradients(
    const std::vector<std::pair<Tensor, std::shared_ptr<Variable>>>& grads_and_vars) {
  // Validate everything first: a rejected call writes nothing.
  for (const auto& [grad, var] : grads_and_vars) {
    if (!var) throw ValueError("ApplyGradients: a variable is null");
    if (grad.valid() && grad.shape() != var->shape()) {
      throw ValueError("Gradient for variable " + var->name() + " has shape " +
                       PyTupleString(grad.shape()) + ", expected " + PyTupleString(var->shape()));
    }
  }
  for (const auto& [grad, var] : grads_and_vars) {
    if (!grad.valid()) continue;
    Tensor* velocity = nullptr;
    if (momentum_ != 0.0) {
      auto it = velocity_.find(var.get());
      if (it == velocity_.end()) {
        it = velocity_.emplace(var.get(), std::make_pair(var, Tensor(var->dtype(), var->shape())))
                 .first;
      }
      velocity = &it->second.second;
    }
    if (var->dtype() == DataType::kFloat64) {
      SgdStep<double>(&var->mutable_value(), grad, velocity, learning_rate_, momentum_, nesterov_);
    } else {
      SgdStep<float>(&var->mutable_value(), grad, velocity, learning_rate_, momentum_, nesterov_);
    }
  }
  // Then the constraints, as Keras's apply_gradients does after the updates.
  for (const auto& [grad, var] : grads_and_vars) {
    if (grad.valid() && !var->constraint().empty()) var->Assign(var->constraint()(var->value()));
  }
  ++iterations_;
}

}  // namespace fbn
