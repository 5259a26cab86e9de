// Per-channel coefficient math, vectorized in double: for wide-C layers with few elements per
// channel (batch-1 7x7x2048) it is a fifth of the call when done one channel at a time.
// `wide` selects the per-channel type U: double (float64 x) or float (every other x). Results are
// those of the scalar expressions in double, rounded once to U.
#ifndef FBN_KERNELS_CHANNEL_MATH_H_
#define FBN_KERNELS_CHANNEL_MATH_H_

#include <cstdint>

namespace fbn::kernels {

// a[c] = U(scale[c] / sqrt(var[c] + eps)); var in double, scale and a of type U.
void ScaleOverStd(bool wide, int64_t n, const double* var, const void* scale, double eps, void* a);

// a[c] = U(scale[c] / sqrt(var[c] + eps)); var, scale and a of type U.
void ScaleOverStdOfU(bool wide, int64_t n, const void* var, const void* scale, double eps, void* a);

// inv[c] = 1 / sqrt(var[c] + eps), var of type U.
void InverseStd(bool wide, int64_t n, const void* var, double eps, double* inv);

// k0[c] = U(-k1[c]·sum_dy[c] / n), k2[c] = U(-k1[c]·inv[c]²·sum_dy_xc[c] / n) for c in
// [c0, c1); k1, k2, k0 of type U.
void BackwardCoefficients(bool wide, int64_t c0, int64_t c1, double n, const double* sum_dy,
                          const double* sum_dy_xc, const double* inv, const void* k1, void* k2,
                          void* k0);

}  // namespace fbn::kernels

#endif  // FBN_KERNELS_CHANNEL_MATH_H_
