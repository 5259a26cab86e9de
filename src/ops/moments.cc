// tf.nn.moments and tf.nn.batch_normalization over arbitrary axes and broadcast shapes: the
// non-fused ops behind the layer's general path. Both walk x once per pass with an odometer over
// the shape (adjacent dims of one kind merged), so no transposed copy is made.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "fbn/ops.h"
#include "kernels/convert.h"
#include "ops/validation.h"

namespace fbn {
namespace {

using kernels::WithType;

template <typename T>
double Load(const void* p, int64_t i) {
  return static_cast<double>(kernels::ToAcc(static_cast<const T*>(p)[i]));
}
template <typename T>
void StoreD(void* p, int64_t i, double v) {
  static_cast<T*>(p)[i] = kernels::FromAcc<T>(static_cast<kernels::Acc<T>>(v));
}

// Normalized, sorted, de-duplicated axes; TensorFlow's texts for bad ones.
Status NormalizeAxes(const Shape& x, const int* axes, int num_axes, bool reduced[Shape::kMaxRank]) {
  std::fill(reduced, reduced + Shape::kMaxRank, false);
  if (num_axes < 0) {
    return InvalidArgument("Moments: argument num_axes must be >= 0 (the length of axes), got " +
                           std::to_string(num_axes));
  }
  if (num_axes > 0 && axes == nullptr) {
    return InvalidArgument("Moments: argument axes is null but num_axes is " +
                           std::to_string(num_axes));
  }
  for (int i = 0; i < num_axes; ++i) {
    const int a = axes[i];
    if (a < -x.rank() || a >= x.rank()) {
      // TensorFlow's text, stray parenthesis included.
      return InvalidArgument("Invalid reduction dimension (" + std::to_string(a) +
                             " for input with " + std::to_string(x.rank()) + " dimension(s)");
    }
    const int k = a < 0 ? a + x.rank() : a;
    if (reduced[k]) {
      return InvalidArgument("Invalid reduction arguments: Axes contains duplicate dimension: " +
                             std::to_string(k));
    }
    reduced[k] = true;
  }
  return Status::Ok();
}

Shape OutputShape(const Shape& x, const bool reduced[], bool keepdims) {
  int64_t dims[Shape::kMaxRank];
  int r = 0;
  for (int i = 0; i < x.rank(); ++i) {
    if (!reduced[i]) {
      dims[r++] = x.dim(i);
    } else if (keepdims) {
      dims[r++] = 1;
    }
  }
  return Shape(dims, r);
}

// Walks every index of `dims` (row-major) keeping one linear offset per stride set.
template <int K, typename F>
void Odometer(int rank, const int64_t* dims, const int64_t (*strides)[Shape::kMaxRank], F&& f) {
  int64_t total = 1;
  for (int i = 0; i < rank; ++i) total *= dims[i];
  if (total == 0) return;
  int64_t idx[Shape::kMaxRank] = {};
  int64_t off[K] = {};
  for (int64_t e = 0; e < total; ++e) {
    f(e, off);
    for (int i = rank - 1; i >= 0; --i) {
      if (++idx[i] < dims[i]) {
        for (int k = 0; k < K; ++k) off[k] += strides[k][i];
        break;
      }
      for (int k = 0; k < K; ++k) off[k] -= strides[k][i] * (dims[i] - 1);
      idx[i] = 0;
    }
  }
}

}  // namespace

Status MomentsOutputSpec(const ConstTensorView& x, const int* axes, int num_axes, bool keepdims,
                         TensorSpec* spec) noexcept {
  return ops::Guarded([&]() -> Status {
    Status s = ops::CheckTensor(x, "x");
    if (!s.ok()) return s;
    bool reduced[Shape::kMaxRank];
    if (!(s = NormalizeAxes(x.shape, axes, num_axes, reduced)).ok()) return s;
    *spec = {x.dtype, OutputShape(x.shape, reduced, keepdims)};
    return Status::Ok();
  });
}

Status Moments(const ConstTensorView& x, const int* axes, int num_axes, bool keepdims,
               const TensorView& mean, const TensorView& variance) noexcept {
  return ops::Guarded([&]() -> Status {
    TensorSpec spec;
    Status s = MomentsOutputSpec(x, axes, num_axes, keepdims, &spec);
    if (!s.ok()) return s;
    if (!(s = ops::CheckOutput(mean, spec, "mean")).ok()) return s;
    if (!(s = ops::CheckOutput(variance, spec, "variance")).ok()) return s;
    bool reduced[Shape::kMaxRank];
    (void)NormalizeAxes(x.shape, axes, num_axes, reduced);
    const int rank = x.shape.rank();
    // Strides: x's own, and the output's (0 along reduced axes).
    int64_t strides[2][Shape::kMaxRank] = {};
    int64_t xs = 1, os = 1;
    for (int i = rank - 1; i >= 0; --i) {
      strides[0][i] = xs;
      xs *= x.shape.dim(i);
      strides[1][i] = reduced[i] ? 0 : os;
      if (!reduced[i]) os *= x.shape.dim(i);
    }
    const int64_t outputs = spec.shape.num_elements();
    const int64_t count = outputs > 0 ? x.shape.num_elements() / outputs : 0;
    std::vector<double> sum(static_cast<size_t>(outputs), 0.0);
    std::vector<double> sq(static_cast<size_t>(outputs), 0.0);
    WithType(x.dtype, [&](auto tag) {
      using T = decltype(tag);
      const int64_t* dims = x.shape.dims();
      Odometer<2>(rank, dims, strides, [&](int64_t, const int64_t* off) {
        sum[static_cast<size_t>(off[1])] += Load<T>(x.data, off[0]);
      });
      // Two-pass: the centred sum of squares about the exact mean (never E[x²] - E[x]²).
      for (double& v : sum) v /= static_cast<double>(count);
      Odometer<2>(rank, dims, strides, [&](int64_t, const int64_t* off) {
        const double d = Load<T>(x.data, off[0]) - sum[static_cast<size_t>(off[1])];
        sq[static_cast<size_t>(off[1])] += d * d;
      });
      for (int64_t i = 0; i < outputs; ++i) {
        StoreD<T>(mean.data, i, sum[static_cast<size_t>(i)]);
        StoreD<T>(variance.data, i, sq[static_cast<size_t>(i)] / static_cast<double>(count));
      }
    });
    return Status::Ok();
  });
}

namespace {

// Broadcast strides of `p` against x (NumPy rules, p no larger than x), or TensorFlow's error.
Status BroadcastStrides(const Shape& x, const ConstTensorView& p, int64_t strides[]) {
  const int rank = x.rank(), pr = p.shape.rank();
  auto incompatible = [&] {
    return InvalidArgument("Incompatible shapes: " + x.DebugString() + " vs. " +
                           p.shape.DebugString());
  };
  if (pr > rank) return incompatible();
  int64_t stride = 1;
  for (int i = rank - 1; i >= 0; --i) {
    const int j = i - (rank - pr);
    if (j < 0) {
      strides[i] = 0;
      continue;
    }
    const int64_t d = p.shape.dim(j);
    if (d != 1 && d != x.dim(i)) return incompatible();
    strides[i] = d == 1 ? 0 : stride;
    stride *= d;
  }
  return Status::Ok();
}

}  // namespace

Status BatchNormalization(const ConstTensorView& x, const ConstTensorView& mean,
                          const ConstTensorView& variance, const ConstTensorView& offset,
                          const ConstTensorView& scale, float variance_epsilon,
                          const TensorView& y) noexcept {
  return ops::Guarded([&]() -> Status {
    const bool use_offset = offset.data != nullptr;
    const bool use_scale = scale.data != nullptr;
    Status s = ops::CheckTensor(x, "x");
    if (!s.ok()) return s;
    const std::pair<const ConstTensorView*, const char*> params[] = {
        {&mean, "mean"}, {&variance, "variance"}, {&offset, "offset"}, {&scale, "scale"}};
    int64_t strides[5][Shape::kMaxRank] = {};
    for (int k = 0; k < 4; ++k) {
      const auto& [p, name] = params[k];
      if ((k == 2 && !use_offset) || (k == 3 && !use_scale)) continue;
      if (!(s = ops::CheckTensor(*p, name)).ok()) return s;
      if (p->dtype != x.dtype) {
        return InvalidArgument(std::string(name) + " must have the dtype of x (" +
                               DataTypeName(x.dtype) + "), got " + DataTypeName(p->dtype));
      }
      if (!(s = BroadcastStrides(x.shape, *p, strides[k + 1])).ok()) return s;
    }
    if (!(s = ops::CheckOutput(y, TensorSpec{x.dtype, x.shape}, "y")).ok()) return s;
    int64_t xs = 1;
    for (int i = x.shape.rank() - 1; i >= 0; --i) {
      strides[0][i] = xs;
      xs *= x.shape.dim(i);
    }
    const double eps = static_cast<double>(variance_epsilon);
    WithType(x.dtype, [&](auto tag) {
      using T = decltype(tag);
      Odometer<5>(x.shape.rank(), x.shape.dims(), strides, [&](int64_t, const int64_t* off) {
        double inv = 1.0 / std::sqrt(Load<T>(variance.data, off[2]) + eps);
        if (use_scale) inv *= Load<T>(scale.data, off[4]);
        const double shift =
            (use_offset ? Load<T>(offset.data, off[3]) : 0.0) - Load<T>(mean.data, off[1]) * inv;
        StoreD<T>(y.data, off[0], Load<T>(x.data, off[0]) * inv + shift);
      });
    });
    return Status::Ok();
  });
}

}  // namespace fbn
