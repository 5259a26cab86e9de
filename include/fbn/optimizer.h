// A small SGD optimizer (with momentum) that applies variable constraints after each update, as
// Keras optimizers do (TensorFlow's TF1 optimizers do not apply constraints).
#ifndef FBN_OPTIMIZER_H_
#define FBN_OPTIMIZER_H_

#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "fbn/export.h"
#include "fbn/graph.h"
#include "fbn/tensor.h"

namespace fbn {

// tf.keras.optimizers.SGD: velocity = momentum * velocity - learning_rate * g, then
// w += velocity (nesterov: w += momentum * velocity - learning_rate * g); without momentum
// w -= learning_rate * g. After all variables are updated, each variable with a constraint is
// assigned constraint(w). Arithmetic in the variable's dtype.
class FBN_API SGD {
 public:
  explicit SGD(double learning_rate = 0.01, double momentum = 0.0, bool nesterov = false);

  double learning_rate() const { return learning_rate_; }
  double momentum() const { return momentum_; }
  bool nesterov() const { return nesterov_; }
  int64_t iterations() const { return iterations_; }

  // Each gradient must have its variable's shape (ValueError otherwise; nothing is written then).
  // A null gradient tensor skips its variable, as Keras filters None gradients.
  void ApplyGradients(const std::vector<std::pair<Tensor, std::shared_ptr<Variable>>>& grads);

 private:
  double learning_rate_;
  double momentum_;
  bool nesterov_;
  int64_t iterations_ = 0;
  // Keyed by variable; the shared_ptr keeps the key's variable alive.
  std::map<const Variable*, std::pair<std::shared_ptr<Variable>, Tensor>> velocity_;
};

}  // namespace fbn

#endif  // FBN_OPTIMIZER_H_
