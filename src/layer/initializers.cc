#include "fbn/initializers.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <random>
#include <string>
#include <utility>

#include "fbn/graph.h"

namespace fbn {
namespace {

// Seeds for unseeded initializers: one random base per process, then a counter, so two unseeded
// calls never share a stream.
uint64_t FreshSeed() {
  static const uint64_t base = [] {
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }();
  static std::atomic<uint64_t> counter{0};
  return base + 0x9E3779B97F4A7C15ull * (counter.fetch_add(1) + 1);
}

// mt19937_64's output is fixed by the standard; the conversions below are fbn's own, so a seed
// gives the same values with every standard library.
class Rng {
 public:
  explicit Rng(uint64_t seed) : engine_(seed) {}
  // Uniform on [0, 1) with 53 random bits.
  double Uniform() { return static_cast<double>(engine_() >> 11) * (1.0 / 9007199254740992.0); }
  // Box-Muller, one value per pair of uniforms (simple and branch-free enough here).
  double Normal() {
    double u1 = Uniform();
    while (u1 <= 0.0) u1 = Uniform();
    const double u2 = Uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  std::mt19937_64 engine_;
};

template <typename Draw>
Initializer RandomInitializer(std::string name, std::optional<uint64_t> seed, Draw draw) {
  return Initializer(
      [seed, draw](const Shape& shape, DataType dtype) {
        Rng rng(seed ? *seed : FreshSeed());
        Tensor t(dtype, shape);
        for (int64_t i = 0; i < t.num_elements(); ++i) t.Set(i, draw(rng, shape));
        return t;
      },
      std::move(name));
}

// Keras's _compute_fans.
std::pair<double, double> Fans(const Shape& shape) {
  if (shape.rank() < 1) return {1.0, 1.0};
  if (shape.rank() == 1) return {double(shape.dim(0)), double(shape.dim(0))};
  if (shape.rank() == 2) return {double(shape.dim(0)), double(shape.dim(1))};
  double receptive = 1.0;
  for (int i = 0; i < shape.rank() - 2; ++i) receptive *= double(shape.dim(i));
  return {double(shape.dim(shape.rank() - 2)) * receptive,
          double(shape.dim(shape.rank() - 1)) * receptive};
}

std::string Lower(std::string s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    // CamelCase class names map to snake_case ("GlorotUniform" -> "glorot_uniform").
    if (c >= 'A' && c <= 'Z') {
      if (i > 0 && s[i - 1] != '_') out += '_';
      out += static_cast<char>(c - 'A' + 'a');
    } else {
      out += c;
    }
  }
  return out;
}

// For `shape` and reduction `axes` (negative allowed), the index of each element's reduction
// group (keepdims layout) and the group count.
std::vector<int64_t> ReductionGroups(const Shape& shape, const std::vector<int>& axes,
                                     int64_t* num_groups) {
  const int rank = shape.rank();
  std::vector<bool> reduced(static_cast<size_t>(rank), false);
  for (int a : axes) {
    const int r = a < 0 ? a + rank : a;
    if (r < 0 || r >= rank) {
      throw ValueError("Invalid reduction dimension " + std::to_string(a) + " for input with " +
                       std::to_string(rank) + " dimensions.");
    }
    reduced[static_cast<size_t>(r)] = true;
  }
  const int64_t n = shape.num_elements();
  std::vector<int64_t> group(static_cast<size_t>(n));
  std::vector<int64_t> idx(static_cast<size_t>(rank), 0);
  int64_t groups = 1;
  for (int d = 0; d < rank; ++d) {
    if (!reduced[static_cast<size_t>(d)]) groups *= shape.dim(d);
  }
  for (int64_t i = 0; i < n; ++i) {
    int64_t g = 0;
    for (int d = 0; d < rank; ++d) {
      if (!reduced[static_cast<size_t>(d)]) g = g * shape.dim(d) + idx[static_cast<size_t>(d)];
    }
    group[static_cast<size_t>(i)] = g;
    for (int d = rank - 1; d >= 0; --d) {
      if (++idx[static_cast<size_t>(d)] < shape.dim(d)) break;
      idx[static_cast<size_t>(d)] = 0;
    }
  }
  *num_groups = groups;
  return group;
}

constexpr double kKerasEpsilon = 1e-7;

// w * desired(norm) / (epsilon + norm), norms over `axis` with keepdims (Keras's norm constraints).
Constraint NormConstraint(std::string name, std::vector<int> axis,
                          std::function<double(double)> desired) {
  return Constraint(
      [axis, desired](const Tensor& w) {
        int64_t groups = 0;
        const std::vector<int64_t> group = ReductionGroups(w.shape(), axis, &groups);
        std::vector<double> sq(static_cast<size_t>(groups), 0.0);
        for (int64_t i = 0; i < w.num_elements(); ++i) {
          const double v = w.Get(i);
          sq[static_cast<size_t>(group[static_cast<size_t>(i)])] += v * v;
        }
        Tensor out(w.dtype(), w.shape());
        for (int64_t i = 0; i < w.num_elements(); ++i) {
          const double norm = std::sqrt(sq[static_cast<size_t>(group[static_cast<size_t>(i)])]);
          out.Set(i, w.Get(i) * (desired(norm) / (kKerasEpsilon + norm)));
        }
        return out;
      },
      std::move(name));
}

}  // namespace

// ----------------------------------------------------------------------------- Initializer

Initializer::Initializer(Fn fn, std::string name) : fn_(std::move(fn)), name_(std::move(name)) {}

Tensor Initializer::operator()(const Shape& shape, DataType dtype) const {
  if (!fn_) throw ValueError("initializer is empty");
  Tensor t = fn_(shape, dtype);
  if (!t.valid() || t.shape() != shape) {
    throw ValueError("initializer '" + name_ + "' returned a value of shape " +
                     (t.valid() ? PyTupleString(t.shape()) : std::string("None")) + ", expected " +
                     PyTupleString(shape));
  }
  return t.dtype() == dtype ? t : t.Cast(dtype);
}

Initializer Initializer::Zeros() { return Constant(0.0).Renamed("zeros"); }
Initializer Initializer::Ones() { return Constant(1.0).Renamed("ones"); }

Initializer Initializer::Constant(double value) {
  return Initializer(
      [value](const Shape& shape, DataType dtype) { return Tensor::Filled(dtype, shape, value); },
      "constant");
}

Initializer Initializer::Renamed(std::string name) const {
  Initializer copy = *this;
  copy.name_ = std::move(name);
  return copy;
}

Initializer Initializer::RandomNormal(double mean, double stddev, std::optional<uint64_t> seed) {
  return RandomInitializer("random_normal", seed, [mean, stddev](Rng& rng, const Shape&) {
    return mean + stddev * rng.Normal();
  });
}

Initializer Initializer::RandomUniform(double minval, double maxval, std::optional<uint64_t> seed) {
  return RandomInitializer("random_uniform", seed, [minval, maxval](Rng& rng, const Shape&) {
    return minval + (maxval - minval) * rng.Uniform();
  });
}

Initializer Initializer::TruncatedNormal(double mean, double stddev, std::optional<uint64_t> seed) {
  return RandomInitializer("truncated_normal", seed, [mean, stddev](Rng& rng, const Shape&) {
    double z = rng.Normal();
    while (std::fabs(z) > 2.0) z = rng.Normal();
    return mean + stddev * z;
  });
}

Initializer Initializer::VarianceScaling(double scale, const std::string& mode,
                                         const std::string& distribution,
                                         std::optional<uint64_t> seed) {
  if (scale <= 0.0) {
    throw ValueError("`scale` must be positive float. Received: scale=" + std::to_string(scale));
  }
  if (mode != "fan_in" && mode != "fan_out" && mode != "fan_avg") {
    throw ValueError(
        "Invalid `mode` argument: expected on of {'fan_in', 'fan_out', 'fan_avg'}. Received: "
        "mode=" +
        mode);
  }
  std::string dist = distribution == "normal" ? "truncated_normal" : distribution;
  if (dist != "truncated_normal" && dist != "untruncated_normal" && dist != "uniform") {
    throw ValueError(
        "Invalid `distribution` argument: expected one of {'normal', 'uniform', "
        "'truncated_normal', 'untruncated_normal'}. Received: distribution=" +
        distribution);
  }
  auto factor = [scale, mode](const Shape& shape) {
    const auto [fan_in, fan_out] = Fans(shape);
    if (mode == "fan_in") return scale / std::max(1.0, fan_in);
    if (mode == "fan_out") return scale / std::max(1.0, fan_out);
    return scale / std::max(1.0, (fan_in + fan_out) / 2.0);
  };
  std::string name = "variance_scaling";
  if (dist == "uniform") {
    return RandomInitializer(name, seed, [factor](Rng& rng, const Shape& shape) {
      const double limit = std::sqrt(3.0 * factor(shape));
      return -limit + 2.0 * limit * rng.Uniform();
    });
  }
  if (dist == "untruncated_normal") {
    return RandomInitializer(name, seed, [factor](Rng& rng, const Shape& shape) {
      return std::sqrt(factor(shape)) * rng.Normal();
    });
  }
  return RandomInitializer(name, seed, [factor](Rng& rng, const Shape& shape) {
    // Keras divides by the standard deviation of a unit normal truncated to [-2, 2].
    const double stddev = std::sqrt(factor(shape)) / 0.87962566103423978;
    double z = rng.Normal();
    while (std::fabs(z) > 2.0) z = rng.Normal();
    return stddev * z;
  });
}

Initializer Initializer::GlorotUniform(std::optional<uint64_t> seed) {
  return VarianceScaling(1.0, "fan_avg", "uniform", seed).Renamed("glorot_uniform");
}
Initializer Initializer::GlorotNormal(std::optional<uint64_t> seed) {
  return VarianceScaling(1.0, "fan_avg", "truncated_normal", seed).Renamed("glorot_normal");
}
Initializer Initializer::HeNormal(std::optional<uint64_t> seed) {
  return VarianceScaling(2.0, "fan_in", "truncated_normal", seed).Renamed("he_normal");
}
Initializer Initializer::HeUniform(std::optional<uint64_t> seed) {
  return VarianceScaling(2.0, "fan_in", "uniform", seed).Renamed("he_uniform");
}

Initializer Initializer::Get(const std::string& name) {
  const std::string n = Lower(name);
  if (n == "zeros" || n == "zero") return Zeros();
  if (n == "ones" || n == "one") return Ones();
  if (n == "constant") return Constant();
  if (n == "random_normal") return RandomNormal();
  if (n == "random_uniform") return RandomUniform();
  if (n == "truncated_normal") return TruncatedNormal();
  if (n == "glorot_uniform") return GlorotUniform();
  if (n == "glorot_normal") return GlorotNormal();
  if (n == "he_normal") return HeNormal();
  if (n == "he_uniform") return HeUniform();
  if (n == "variance_scaling") return VarianceScaling();
  throw ValueError("Unknown initializer: '" + name +
                   "'. Please ensure you are using a `keras.utils.custom_object_scope` and that "
                   "this object is included in the scope. See "
                   "https://www.tensorflow.org/guide/keras/save_and_serialize"
                   "#registering_the_custom_object for details.");
}

// ----------------------------------------------------------------------------- Regularizer

Regularizer::Regularizer(LossFn loss, GradientFn gradient, std::string name)
    : loss_(std::move(loss)), gradient_(std::move(gradient)), name_(std::move(name)) {}

double Regularizer::Loss(const Tensor& value) const {
  if (!loss_) throw ValueError("regularizer is empty");
  return loss_(value);
}

Tensor Regularizer::Gradient(const Tensor& value) const {
  if (!gradient_) {
    throw ValueError("regularizer '" + name_ +
                     "' has no gradient function; give one to compute its gradient");
  }
  Tensor g = gradient_(value);
  if (!g.valid() || g.shape() != value.shape()) {
    throw ValueError("regularizer '" + name_ + "' returned a gradient of the wrong shape");
  }
  return g.dtype() == value.dtype() ? g : g.Cast(value.dtype());
}

Regularizer Regularizer::L1L2(double l1, double l2) {
  // Keras casts the factors to float32 (floatx) and sums in the variable's dtype; fbn sums in
  // double, which differs from a float32 sum only in the last bits.
  const float f1 = static_cast<float>(l1), f2 = static_cast<float>(l2);
  return Regularizer(
      [f1, f2](const Tensor& w) {
        double s1 = 0.0, s2 = 0.0;
        for (int64_t i = 0; i < w.num_elements(); ++i) {
          const double v = w.Get(i);
          s1 += std::fabs(v);
          s2 += v * v;
        }
        double loss = 0.0;
        if (f1 != 0.0f) loss += double(f1) * s1;
        if (f2 != 0.0f) loss += double(f2) * s2;
        return loss;
      },
      [f1, f2](const Tensor& w) {
        Tensor g(w.dtype(), w.shape());
        for (int64_t i = 0; i < w.num_elements(); ++i) {
          const double v = w.Get(i);
          const double sign = v > 0.0 ? 1.0 : (v < 0.0 ? -1.0 : 0.0);
          g.Set(i, double(f1) * sign + 2.0 * double(f2) * v);
        }
        return g;
      },
      "l1_l2");
}

Regularizer Regularizer::L1(double l1) {
  Regularizer r = L1L2(l1, 0.0);
  r.name_ = "l1";
  return r;
}

Regularizer Regularizer::L2(double l2) {
  Regularizer r = L1L2(0.0, l2);
  r.name_ = "l2";
  return r;
}

Regularizer Regularizer::Get(const std::string& name) {
  const std::string n = Lower(name);
  if (n == "l1") return L1();
  if (n == "l2") return L2();
  if (n == "l1_l2") return L1L2();
  throw ValueError("Unknown regularizer: '" + name + "'");
}

// ----------------------------------------------------------------------------- Constraint

Constraint::Constraint(Fn fn, std::string name) : fn_(std::move(fn)), name_(std::move(name)) {}

Tensor Constraint::operator()(const Tensor& value) const {
  if (!fn_) throw ValueError("constraint is empty");
  Tensor t = fn_(value);
  if (!t.valid() || t.shape() != value.shape()) {
    throw ValueError("constraint '" + name_ + "' returned a value of shape " +
                     (t.valid() ? PyTupleString(t.shape()) : std::string("None")) + ", expected " +
                     PyTupleString(value.shape()));
  }
  return t.dtype() == value.dtype() ? t : t.Cast(value.dtype());
}

Constraint Constraint::NonNeg() {
  return Constraint(
      [](const Tensor& w) {
        Tensor out(w.dtype(), w.shape());
        // w * (w >= 0): NaN stays NaN, as in Keras.
        for (int64_t i = 0; i < w.num_elements(); ++i) {
          const double v = w.Get(i);
          out.Set(i, v * (v >= 0.0 ? 1.0 : 0.0));
        }
        return out;
      },
      "non_neg");
}

Constraint Constraint::MaxNorm(double max_value, std::vector<int> axis) {
  return NormConstraint("max_norm", std::move(axis),
                        [max_value](double n) { return std::clamp(n, 0.0, max_value); });
}

Constraint Constraint::MinMaxNorm(double min_value, double max_value, double rate,
                                  std::vector<int> axis) {
  return NormConstraint("min_max_norm", std::move(axis), [=](double n) {
    return rate * std::clamp(n, min_value, max_value) + (1.0 - rate) * n;
  });
}

Constraint Constraint::UnitNorm(std::vector<int> axis) {
  return NormConstraint("unit_norm", std::move(axis), [](double) { return 1.0; });
}

Constraint Constraint::Get(const std::string& name) {
  const std::string n = Lower(name);
  if (n == "non_neg") return NonNeg();
  if (n == "max_norm") return MaxNorm();
  if (n == "min_max_norm") return MinMaxNorm();
  if (n == "unit_norm") return UnitNorm();
  throw ValueError("Unknown constraint: '" + name + "'");
}

}  // namespace fbn
