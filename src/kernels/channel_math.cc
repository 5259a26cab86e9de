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

}  // namespace fbn::kernels
#endif  // HWY_ONCE
