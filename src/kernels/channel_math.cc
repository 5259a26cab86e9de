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

// 1 / sqrt(v), lane by lane. Correctly rounded sqrt and division cost a fifth of a batch-1
// 7x7x2048 call (3.5 us for 2048 channels); on AVX-512 the float-range paths (`fast`) start from
// the 14-bit estimate and take two Newton steps, within about an ulp of double, then round to
// float. Lanes outside (0, inf) (zero, negative, NaN, inf) take the exact expression (lane by
// lane: a channel's value does not depend on its neighbours). Every lane
// goes through the same operations wherever it sits in a range, so per-task channel ranges give
// the values of one call over all channels.
template <bool fast>
HWY_INLINE hn::Vec<DD> InvSqrt(DD d, hn::Vec<DD> v) {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  if constexpr (fast) {
    const auto h = hn::Mul(v, hn::Set(d, 0.5));
    const auto half = hn::Set(d, 0.5);
    auto y = hn::Vec<DD>{_mm512_rsqrt14_pd(v.raw)};
    for (int step = 0; step < 2; ++step) {
      // y·(1.5 - h·y²) written as y + y·(0.5 - h·y²): the correction is small, so its rounding
      // error is too.
      y = hn::MulAdd(y, hn::NegMulAdd(hn::Mul(h, y), y, half), y);
    }
    const auto valid = hn::And(hn::Gt(v, hn::Zero(d)), hn::Lt(v, hn::Set(d, HUGE_VAL)));
    if (HWY_LIKELY(hn::AllTrue(d, valid))) return y;
    return hn::IfThenElse(valid, y, hn::Div(hn::Set(d, 1.0), hn::Sqrt(v)));
  }
#endif
  return hn::Div(hn::Set(d, 1.0), hn::Sqrt(v));
}

// Calls f(c, tail) for every vector of [0, n); the last partial one has `tail` set and runs as a
// full vector on copies (LoadLanes / StoreLanes), so each channel gets the same lane operations.
template <class F>
HWY_INLINE void ForEachVector(DD d, int64_t n, F&& f) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  int64_t c = 0;
  for (; c + N <= n; c += N) f(c, false);
  if (c < n) f(c, true);
}

// Loads lanes [c, min(c + N, n)) of p as double; with `tail`, lanes past n are `pad`.
template <typename U>
HWY_INLINE hn::Vec<DD> LoadLanes(DD d, const U* p, int64_t c, int64_t n, bool tail,
                                 double pad = 0.0) {
  if (!tail) return LoadAsDouble(d, p + c);
  HWY_ALIGN double lanes[hn::MaxLanes(d)];
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  for (int64_t i = 0; i < N; ++i) lanes[i] = c + i < n ? static_cast<double>(p[c + i]) : pad;
  return hn::Load(d, lanes);
}

template <typename U>
HWY_INLINE void StoreLanes(DD d, hn::Vec<DD> v, U* p, int64_t c, int64_t n, bool tail) {
  if (!tail) return StoreFromDouble(d, v, p + c);
  // The same conversion as whole vectors (Highway's emulated DemoteTo is not static_cast for
  // out-of-range values), then the lanes below n.
  HWY_ALIGN U lanes[hn::MaxLanes(d)];
  StoreFromDouble(d, v, lanes);
  for (int64_t i = 0; c + i < n; ++i) p[c + i] = lanes[i];
}

// a = U(scale / sqrt(var + eps)) with var of type V (as scale · InvSqrt).
template <typename V, typename U>
void ScaleOverStdT(int64_t n, const V* var, const U* scale, double eps, U* a) {
  const DD d;
  const auto ve = hn::Set(d, eps);
  ForEachVector(d, n, [&](int64_t c, bool tail) {
    const auto inv = InvSqrt<sizeof(U) < 8>(d, hn::Add(LoadLanes(d, var, c, n, tail, 1.0), ve));
    StoreLanes(d, hn::Mul(LoadLanes(d, scale, c, n, tail), inv), a, c, n, tail);
  });
}

// inv = 1 / sqrt(var + eps) and k1 = U(scale · inv).
template <typename U>
void InverseStdT(int64_t n, const U* var, const U* scale, double eps, double* inv, U* k1) {
  const DD d;
  const auto ve = hn::Set(d, eps);
  ForEachVector(d, n, [&](int64_t c, bool tail) {
    const auto vi = InvSqrt<sizeof(U) < 8>(d, hn::Add(LoadLanes(d, var, c, n, tail, 1.0), ve));
    StoreLanes(d, vi, inv, c, n, tail);
    StoreLanes(d, hn::Mul(LoadLanes(d, scale, c, n, tail), vi), k1, c, n, tail);
  });
}

// offset_bp = U(sum_dy), scale_bp = U(sum_dy_xc · inv).
template <typename U>
void GradientOutputsT(int64_t n, const double* sum_dy, const double* sum_dy_xc, const double* inv,
                      U* offset_bp, U* scale_bp) {
  const DD d;
  ForEachVector(d, n, [&](int64_t c, bool tail) {
    const auto s = LoadLanes(d, sum_dy_xc, c, n, tail);
    const auto vi = LoadLanes(d, inv, c, n, tail);
    StoreLanes(d, LoadLanes(d, sum_dy, c, n, tail), offset_bp, c, n, tail);
    StoreLanes(d, hn::Mul(s, vi), scale_bp, c, n, tail);
  });
}

// The training forward's per-channel outputs: see channel_math.h. Every input lane is loaded
// before any output lane is stored, so outputs may be the very arrays of old_mean / old_var.
template <typename U>
void TrainingOutputsT(int64_t n, const double* mean, const double* var, const U* old_mean,
                      const U* old_var, double bessel, double factor, bool blend, U* batch_mean,
                      U* batch_var, U* saved_mean, U* saved_var) {
  const DD d;
  const auto vbessel = hn::Set(d, bessel);
  const auto vf = hn::Set(d, factor), keep = hn::Set(d, 1.0 - factor);
  ForEachVector(d, n, [&](int64_t c, bool tail) {
    const auto m = LoadLanes(d, mean, c, n, tail);
    const auto v = LoadLanes(d, var, c, n, tail);
    const auto unbiased = hn::Mul(v, vbessel);
    auto new_mean = m, new_var = unbiased;
    if (blend) {
      // (1 - f)·old + f·batch, rounded as the scalar expression (no fused multiply-add).
      new_mean = hn::Add(hn::Mul(keep, LoadLanes(d, old_mean, c, n, tail)), hn::Mul(vf, m));
      new_var = hn::Add(hn::Mul(keep, LoadLanes(d, old_var, c, n, tail)), hn::Mul(vf, unbiased));
    }
    StoreLanes(d, new_mean, batch_mean, c, n, tail);
    StoreLanes(d, new_var, batch_var, c, n, tail);
    StoreLanes(d, m, saved_mean, c, n, tail);
    StoreLanes(d, v, saved_var, c, n, tail);
  });
}

// Chan's merge, lane by lane, in the order and with the operations of the scalar loop
// delta = s - m; m += delta·w0; M2 += s2 + delta²·w1 (m and M2 from 0), then var = M2·inv_count.
bool MergeChannelPartialsT(int64_t n, int64_t parts, const double* partial, size_t stride,
                           int64_t m2_offset, const double* w, double inv_count, double* mean,
                           double* variance) {
  const DD d;
  const auto vinv = hn::Set(d, inv_count);
  auto nan = hn::Lt(hn::Zero(d), hn::Zero(d));  // all false
  ForEachVector(d, n, [&](int64_t c, bool tail) {
    auto m = hn::Zero(d), m2 = hn::Zero(d);
    for (int64_t t = 0; t < parts; ++t) {
      const double* s = partial + stride * static_cast<size_t>(t);
      const auto delta = hn::Sub(LoadLanes(d, s, c, n, tail), m);
      m = hn::Add(m, hn::Mul(delta, hn::Set(d, w[2 * t])));
      const auto dd = hn::Mul(hn::Mul(delta, delta), hn::Set(d, w[2 * t + 1]));
      m2 = hn::Add(m2, hn::Add(LoadLanes(d, s + m2_offset, c, n, tail), dd));
    }
    nan = hn::Or(nan, hn::IsNaN(m));
    StoreLanes(d, m, mean, c, n, tail);
    StoreLanes(d, hn::Mul(m2, vinv), variance, c, n, tail);
  });
  return !hn::AllFalse(d, nan);
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

bool MergeChannelPartialsImpl(int64_t n, int64_t parts, const double* partial, size_t stride,
                              int64_t m2_offset, const double* w, double inv_count, double* mean,
                              double* variance) {
  return MergeChannelPartialsT(n, parts, partial, stride, m2_offset, w, inv_count, mean, variance);
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

void InverseStdImpl(bool wide, int64_t n, const void* var, const void* scale, double eps,
                    double* inv, void* k1) {
  if (wide) {
    InverseStdT(n, static_cast<const double*>(var), static_cast<const double*>(scale), eps, inv,
                static_cast<double*>(k1));
  } else {
    InverseStdT(n, static_cast<const float*>(var), static_cast<const float*>(scale), eps, inv,
                static_cast<float*>(k1));
  }
}

void GradientOutputsImpl(bool wide, int64_t n, const double* sum_dy, const double* sum_dy_xc,
                         const double* inv, void* offset_bp, void* scale_bp) {
  if (wide) {
    GradientOutputsT(n, sum_dy, sum_dy_xc, inv, static_cast<double*>(offset_bp),
                     static_cast<double*>(scale_bp));
  } else {
    GradientOutputsT(n, sum_dy, sum_dy_xc, inv, static_cast<float*>(offset_bp),
                     static_cast<float*>(scale_bp));
  }
}

void TrainingOutputsImpl(bool wide, int64_t n, const double* mean, const double* var,
                         const void* old_mean, const void* old_var, double bessel, double factor,
                         bool blend, void* batch_mean, void* batch_var, void* saved_mean,
                         void* saved_var) {
  if (wide) {
    using U = double;
    TrainingOutputsT(n, mean, var, static_cast<const U*>(old_mean), static_cast<const U*>(old_var),
                     bessel, factor, blend, static_cast<U*>(batch_mean), static_cast<U*>(batch_var),
                     static_cast<U*>(saved_mean), static_cast<U*>(saved_var));
  } else {
    using U = float;
    TrainingOutputsT(n, mean, var, static_cast<const U*>(old_mean), static_cast<const U*>(old_var),
                     bessel, factor, blend, static_cast<U*>(batch_mean), static_cast<U*>(batch_var),
                     static_cast<U*>(saved_mean), static_cast<U*>(saved_var));
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace fbn::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace fbn::kernels {

HWY_EXPORT(MergeChannelPartialsImpl);
HWY_EXPORT(ScaleOverStdImpl);
HWY_EXPORT(ScaleOverStdOfUImpl);
HWY_EXPORT(InverseStdImpl);
HWY_EXPORT(BackwardCoefficientsImpl);
HWY_EXPORT(GradientOutputsImpl);
HWY_EXPORT(TrainingOutputsImpl);

bool MergeChannelPartials(int64_t n, int64_t parts, const double* partial, size_t stride,
                          int64_t m2_offset, const double* w, double inv_count, double* mean,
                          double* variance) {
  return HWY_DYNAMIC_DISPATCH(MergeChannelPartialsImpl)(n, parts, partial, stride, m2_offset, w,
                                                        inv_count, mean, variance);
}

void ScaleOverStd(bool wide, int64_t n, const double* var, const void* scale, double eps, void* a) {
  HWY_DYNAMIC_DISPATCH(ScaleOverStdImpl)(wide, n, var, scale, eps, a);
}

void ScaleOverStdOfU(bool wide, int64_t n, const void* var, const void* scale, double eps,
                     void* a) {
  HWY_DYNAMIC_DISPATCH(ScaleOverStdOfUImpl)(wide, n, var, scale, eps, a);
}

void InverseStd(bool wide, int64_t n, const void* var, const void* scale, double eps, double* inv,
                void* k1) {
  HWY_DYNAMIC_DISPATCH(InverseStdImpl)(wide, n, var, scale, eps, inv, k1);
}

void GradientOutputs(bool wide, int64_t n, const double* sum_dy, const double* sum_dy_xc,
                     const double* inv, void* offset_bp, void* scale_bp) {
  HWY_DYNAMIC_DISPATCH(GradientOutputsImpl)(wide, n, sum_dy, sum_dy_xc, inv, offset_bp, scale_bp);
}

void TrainingOutputs(bool wide, int64_t n, const double* mean, const double* var,
                     const void* old_mean, const void* old_var, double bessel, double factor,
                     bool blend, void* batch_mean, void* batch_var, void* saved_mean,
                     void* saved_var) {
  HWY_DYNAMIC_DISPATCH(TrainingOutputsImpl)
  (wide, n, mean, var, old_mean, old_var, bessel, factor, blend, batch_mean, batch_var, saved_mean,
   saved_var);
}

void BackwardCoefficients(bool wide, int64_t c0, int64_t c1, double n, const double* sum_dy,
                          const double* sum_dy_xc, const double* inv, const void* k1, void* k2,
                          void* k0) {
  HWY_DYNAMIC_DISPATCH(BackwardCoefficientsImpl)
  (wide, c0, c1, n, sum_dy, sum_dy_xc, inv, k1, k2, k0);
}

}  // namespace fbn::kernels
#endif  // HWY_ONCE
