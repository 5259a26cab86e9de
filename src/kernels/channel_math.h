// Per-channel coefficient math, vectorized in double: for wide-C layers with few elements per
// channel (batch-1 7x7x2048) it is a fifth of the call when done one channel at a time.
// `wide` selects the per-channel type U: double (float64 x) or float (every other x). Results are
// those of the expressions in double, rounded once to U; with float U on AVX-512, 1/sqrt is a
// Newton-refined estimate within about an ulp of double instead of a correctly rounded sqrt and
// division (see InvSqrt in channel_math.cc).
#ifndef FBN_KERNELS_CHANNEL_MATH_H_
#define FBN_KERNELS_CHANNEL_MATH_H_

#include <cstdint>

namespace fbn::kernels {

// Chan's merge of `parts` partials of n channels, in part order: part t's means at
// partial[t·stride + c], its M2 at partial[t·stride + m2_offset + c], its weights w[2t] = n_t / N_t
// and w[2t + 1] = N_(t-1)·n_t / N_t (N_t: the running count). Writes mean[c] and variance[c] =
// M2·inv_count; returns whether any mean is NaN.
bool MergeChannelPartials(int64_t n, int64_t parts, const double* partial, size_t stride,
                          int64_t m2_offset, const double* w, double inv_count, double* mean,
                          double* variance);

// a[c] = U(scale[c] / sqrt(var[c] + eps)); var in double, scale and a of type U.
void ScaleOverStd(bool wide, int64_t n, const double* var, const void* scale, double eps, void* a);

// a[c] = U(scale[c] / sqrt(var[c] + eps)); var, scale and a of type U.
void ScaleOverStdOfU(bool wide, int64_t n, const void* var, const void* scale, double eps, void* a);

// inv[c] = 1 / sqrt(var[c] + eps) and k1[c] = U(scale[c]·inv[c]); var, scale and k1 of type U.
void InverseStd(bool wide, int64_t n, const void* var, const void* scale, double eps, double* inv,
                void* k1);

// offset_bp[c] = U(sum_dy[c]), scale_bp[c] = U(sum_dy_xc[c]·inv[c]); outputs of type U.
void GradientOutputs(bool wide, int64_t n, const double* sum_dy, const double* sum_dy_xc,
                     const double* inv, void* offset_bp, void* scale_bp);

// The training forward's per-channel outputs from the batch's mean and (biased) variance:
// batch_mean = U(mean), batch_var = U(var·bessel), or with `blend`, U((1 - factor)·old + factor·
// that); saved_mean = U(mean), saved_var = U(var). U arrays; outputs may be old_mean / old_var.
void TrainingOutputs(bool wide, int64_t n, const double* mean, const double* var,
                     const void* old_mean, const void* old_var, double bessel, double factor,
                     bool blend, void* batch_mean, void* batch_var, void* saved_mean,
                     void* saved_var);

// k0[c] = U(-k1[c]·sum_dy[c] / n), k2[c] = U(-k1[c]·inv[c]²·sum_dy_xc[c] / n) for c in
// [c0, c1); k1, k2, k0 of type U.
void BackwardCoefficients(bool wide, int64_t c0, int64_t c1, double n, const double* sum_dy,
                          const double* sum_dy_xc, const double* inv, const void* k1, void* k2,
                          void* k0);

}  // namespace fbn::kernels

#endif  // FBN_KERNELS_CHANNEL_MATH_H_
