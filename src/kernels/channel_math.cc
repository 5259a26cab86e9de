// Vectorized per-channel coefficient math (see channel_math.h), compiled per SIMD target.
#include <cmath>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/channel_math.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Must come after foreach_target.h.
#include "hwy/highway.h"
#include "kernels/channel_math.h"

HWY_BEFORE_NAMESPACE();
namespace fbn::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DD = hn::ScalableTag<double>;

template <typename U>
HWY_INLINE hn::Vec<DD> LoadAsDouble(DD d, const U* p) {
  if constexpr (sizeof(U) == sizeof(double)) {
    return hn::LoadU(d, p);
  } else {
    return hn::PromoteTo(d, hn::LoadU(hn::Rebind<float, DD>(), p));
  }
}

template <typename U>
HWY_INLINE void StoreFromDouble(DD d, hn::Vec<DD> v, U* p) {
  if constexpr (sizeof(U) == sizeof(double)) {
    hn::StoreU(v, d, p);
  } else {
    const hn::Rebind<float, DD> df;
    hn::StoreU(hn::DemoteTo(df, v), df, p);  // round to nearest even, as static_cast<float>
  }
}

// a = U(scale / sqrt(var + eps)) with var of type V.
template <typename V, typename U>
void ScaleOverStdT(int64_t n, const V* var, const U* scale, double eps, U* a) {
  const DD d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const auto ve = hn::Set(d, eps);
  int64_t c = 0;
  for (; c + N <= n; c += N) {
    const auto sd = hn::Sqrt(hn::Add(LoadAsDouble(d, var + c), ve));
    StoreFromDouble(d, hn::Div(LoadAsDouble(d, scale + c), sd), a + c);
  }
  for (; c < n; ++c) {
    a[c] = static_cast<U>(static_cast<double>(scale[c]) /
                          std::sqrt(static_cast<double>(var[c]) + eps));
  }
}

template <typename U>
void InverseStdT(int64_t n, const U* var, double eps, double* inv) {
  const DD d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const auto ve = hn::Set(d, eps);
  const auto one = hn::Set(d, 1.0);
  int64_t c = 0;
  for (; c + N <= n; c += N) {
    hn::StoreU(hn::Div(one, hn::Sqrt(hn::Add(LoadAsDouble(d, var + c), ve))), d, inv + c);
  }
  for (; c < n; ++c) {
    inv[c] = 1.0 / std::sqrt(static_cast<double>(var[c]) + eps);
  }
}

template <typename U>
void BackwardCoefficientsT(int64_t c0, int64_t c1, double n, const double* sum_dy,
                           const double* sum_dy_xc, const double* inv, const U* k1, U* k2, U* k0) {
  const DD d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const auto vn = hn::Set(d, n);
  int64_t c = c0;
  for (; c + N <= c1; c += N) {
    const auto neg_a = hn::Neg(LoadAsDouble(d, k1 + c));
    const auto vi = hn::LoadU(d, inv + c);
    StoreFromDouble(d, hn::Div(hn::Mul(neg_a, hn::LoadU(d, sum_dy + c)), vn), k0 + c);
    const auto t = hn::Mul(hn::Mul(hn::Mul(neg_a, vi), vi), hn::LoadU(d, sum_dy_xc + c));
    StoreFromDouble(d, hn::Div(t, vn), k2 + c);
  }
  for (; c < c1; ++c) {
    const double a = static_cast<double>(k1[c]);
    k0[c] = static_cast<U>(-a * sum_dy[c] / n);
    k2[c] = static_cast<U>(-a * inv[c] * inv[c] * sum_dy_xc[c] / n);
  }
}

void BackwardCoefficientsImpl(bool wide, int64_t c0, int64_t c1, double n, const double* sum_dy,
                              const double* sum_dy_xc, const double* inv, const void* k1, void* k2,
                              void* k0) {
  if (wide) {
    BackwardCoefficientsT(c0, c1, n, sum_dy, sum_dy_xc, inv, static_cast<const double*>(k1),
                          static_cast<double*>(k2), static_cast<double*>(k0));
  } else {
    BackwardCoefficientsT(c0, c1, n, sum_dy, sum_dy_xc, inv, static_cast<const float*>(k1),
                          static_cast<float*>(k2), static_cast<float*>(k0));
  }
}

void ScaleOverStdImpl(bool wide, int64_t n, const double* var, const void* scale, double eps,
                      void* a) {
  if (wide) {
    ScaleOverStdT(n, var, static_cast<const double*>(scale), eps, static_cast<double*>(a));
  } else {
    ScaleOverStdT(n, var, static_cast<const float*>(scale), eps, static_cast<float*>(a));
  }
}

void ScaleOverStdOfUImpl(bool wide, int64_t n, const void* var, const void* scale, double eps,
                         void* a) {
  if (wide) {
    ScaleOverStdT(n, static_cast<const double*>(var), static_cast<const double*>(scale), eps,
                  static_cast<double*>(a));
  } else {
    ScaleOverStdT(n, static_cast<const float*>(var), static_cast<const float*>(scale), eps,
                  static_cast<float*>(a));
  }
}

void InverseStdImpl(bool wide, int64_t n, const void* var, double eps, double* inv) {
  if (wide) {
    InverseStdT(n, static_cast<const double*>(var), eps, inv);
  } else {
    InverseStdT(n, static_cast<const float*>(var), eps, inv);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace fbn::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace fbn::kernels {

HWY_EXPORT(ScaleOverStdImpl);
HWY_EXPORT(ScaleOverStdOfUImpl);
HWY_EXPORT(InverseStdImpl);
HWY_EXPORT(BackwardCoefficientsImpl);

void ScaleOverStd(bool wide, int64_t n, const double* var, const void* scale, double eps, void* a) {
  HWY_DYNAMIC_DISPATCH(ScaleOverStdImpl)(wide, n, var, scale, eps, a);
}

void ScaleOverStdOfU(bool wide, int64_t n, const void* var, const void* scale, double eps,
                     void* a) {
  HWY_DYNAMIC_DISPATCH(ScaleOverStdOfUImpl)(wide, n, var, scale, eps, a);
}

void InverseStd(bool wide, int64_t n, const void* var, double eps, double* inv) {
  HWY_DYNAMIC_DISPATCH(InverseStdImpl)(wide, n, var, eps, inv);
}

void BackwardCoefficients(bool wide, int64_t c0, int64_t c1, double n, const double* sum_dy,
                          const double* sum_dy_xc, const double* inv, const void* k1, void* k2,
                          void* k0) {
  HWY_DYNAMIC_DISPATCH(BackwardCoefficientsImpl)
  (wide, c0, c1, n, sum_dy, sum_dy_xc, inv, k1, k2, k0);
}

}  // namespace fbn::kernels
#endif  // HWY_ONCE
