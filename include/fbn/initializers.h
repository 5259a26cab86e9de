// Initializers, regularizers and constraints for layer variables, as in (tf_)keras: the built-in
// ones by their Keras names and defaults, or any callable.
#ifndef FBN_INITIALIZERS_H_
#define FBN_INITIALIZERS_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "fbn/export.h"
#include "fbn/tensor.h"
#include "fbn/types.h"

namespace fbn {

// Produces a variable's initial value. An empty Initializer means "none given".
class FBN_API Initializer {
 public:
  using Fn = std::function<Tensor(const Shape& shape, DataType dtype)>;

  Initializer() = default;
  explicit Initializer(Fn fn, std::string name = "custom");

  bool empty() const { return !fn_; }
  const std::string& name() const { return name_; }
  // Calls the function and checks the result: its shape must be `shape` (ValueError otherwise);
  // another dtype is cast to `dtype`.
  Tensor operator()(const Shape& shape, DataType dtype) const;

  static Initializer Zeros();
  static Initializer Ones();
  static Initializer Constant(double value = 0.0);
  // Keras defaults. With a seed, every call returns the same values (Keras's seeded initializers
  // do too); without one, each call draws fresh values. fbn's generator is its own: values differ
  // from TensorFlow's for the same seed.
  static Initializer RandomNormal(double mean = 0.0, double stddev = 0.05,
                                  std::optional<uint64_t> seed = std::nullopt);
  static Initializer RandomUniform(double minval = -0.05, double maxval = 0.05,
                                   std::optional<uint64_t> seed = std::nullopt);
  // Normal values redrawn until within two standard deviations of the mean.
  static Initializer TruncatedNormal(double mean = 0.0, double stddev = 0.05,
                                     std::optional<uint64_t> seed = std::nullopt);
  // mode: "fan_in", "fan_out" or "fan_avg"; distribution: "truncated_normal", "untruncated_normal"
  // or "uniform". Fans as Keras computes them (rank 1: fan_in = fan_out = dim 0).
  static Initializer VarianceScaling(double scale = 1.0, const std::string& mode = "fan_in",
                                     const std::string& distribution = "truncated_normal",
                                     std::optional<uint64_t> seed = std::nullopt);
  static Initializer GlorotUniform(std::optional<uint64_t> seed = std::nullopt);
  static Initializer GlorotNormal(std::optional<uint64_t> seed = std::nullopt);
  static Initializer HeNormal(std::optional<uint64_t> seed = std::nullopt);
  static Initializer HeUniform(std::optional<uint64_t> seed = std::nullopt);
  // By Keras name: "zeros", "ones", "random_normal", "random_uniform", "truncated_normal",
  // "glorot_uniform", "glorot_normal", "he_normal", "he_uniform" (and their CamelCase class
  // names). ValueError for an unknown name.
  static Initializer Get(const std::string& name);

  // The same function under another name.
  Initializer Renamed(std::string name) const;

 private:
  Fn fn_;
  std::string name_;
};

// A penalty on a variable: its loss and, where known, the loss's gradient. An empty Regularizer
// means "none given".
class FBN_API Regularizer {
 public:
  using LossFn = std::function<double(const Tensor& value)>;
  using GradientFn = std::function<Tensor(const Tensor& value)>;

  Regularizer() = default;
  explicit Regularizer(LossFn loss, GradientFn gradient = nullptr, std::string name = "custom");

  bool empty() const { return !loss_; }
  const std::string& name() const { return name_; }
  double Loss(const Tensor& value) const;
  bool has_gradient() const { return static_cast<bool>(gradient_); }
  // ValueError if the regularizer has no gradient function.
  Tensor Gradient(const Tensor& value) const;

  // Keras: l1 * sum(|w|), l2 * sum(w^2), and their sum. The gradient of |w| at 0 is 0.
  static Regularizer L1(double l1 = 0.01);
  static Regularizer L2(double l2 = 0.01);
  static Regularizer L1L2(double l1 = 0.01, double l2 = 0.01);
  // "l1", "l2", "l1_l2" with Keras's default factors. ValueError for an unknown name.
  static Regularizer Get(const std::string& name);

 private:
  LossFn loss_;
  GradientFn gradient_;
  std::string name_;
};

// A projection applied to a variable after each optimizer update (never by the layer's forward
// pass). An empty Constraint means "none given".
class FBN_API Constraint {
 public:
  using Fn = std::function<Tensor(const Tensor& value)>;

  Constraint() = default;
  explicit Constraint(Fn fn, std::string name = "custom");

  bool empty() const { return !fn_; }
  const std::string& name() const { return name_; }
  // The projected value, with `value`'s shape (ValueError otherwise) and dtype.
  Tensor operator()(const Tensor& value) const;

  // Keras's formulas, with its epsilon 1e-7 and norms over `axis` (negative allowed, keepdims).
  static Constraint NonNeg();
  static Constraint MaxNorm(double max_value = 2.0, std::vector<int> axis = {0});
  static Constraint MinMaxNorm(double min_value = 0.0, double max_value = 1.0, double rate = 1.0,
                               std::vector<int> axis = {0});
  static Constraint UnitNorm(std::vector<int> axis = {0});
  // "non_neg", "max_norm", "min_max_norm", "unit_norm" with defaults. ValueError when unknown.
  static Constraint Get(const std::string& name);

 private:
  Fn fn_;
  std::string name_;
};

}  // namespace fbn

#endif  // FBN_INITIALIZERS_H_
