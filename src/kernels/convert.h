// Scalar conversions between the storage types and their accumulation type, with
// round-to-nearest-even narrowing (as TensorFlow's Eigen casts). Plain C++, shared by all targets.
#ifndef FBN_KERNELS_CONVERT_H_
#define FBN_KERNELS_CONVERT_H_

#include <cstdint>
#include <cstring>

#include "fbn/types.h"

namespace fbn::kernels {

// 16-bit storage types are distinct structs so templates can tell them apart.
struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t FloatToBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float ToFloat(BFloat16 v) { return BitsToFloat(static_cast<uint32_t>(v.bits) << 16); }

inline BFloat16 ToBFloat16(float f) {
  uint32_t u = FloatToBits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return BFloat16{static_cast<uint16_t>((u >> 16) | 0x40)};
  u += 0x7FFFu + ((u >> 16) & 1u);
  return BFloat16{static_cast<uint16_t>(u >> 16)};
}

inline float ToFloat(Half v) {
  const uint32_t sign = static_cast<uint32_t>(v.bits & 0x8000u) << 16;
  const uint32_t exp = (v.bits >> 10) & 0x1Fu;
  const uint32_t mant = v.bits & 0x3FFu;
  if (exp == 0x1F) return BitsToFloat(sign | 0x7F800000u | (mant << 13));
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24, exact in float.
    const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -mag : mag;
  }
  return BitsToFloat(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline Half ToHalf(float f) {
  const uint32_t u = FloatToBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7FFFFFFFu;
  if (abs > 0x7F800000u)
    return Half{static_cast<uint16_t>(sign | 0x7E00u | ((abs >> 13) & 0x3FFu))};
  if (abs >= 0x477FF000u) return Half{static_cast<uint16_t>(sign | 0x7C00u)};  // rounds to inf
  if (abs < 0x38800000u) {
    // Result is subnormal or zero: round abs * 2^24 to an integer, ties to even.
    const float scaled = BitsToFloat(abs) * 16777216.0f;  // exact: a power-of-two scale
    uint32_t q = static_cast<uint32_t>(scaled);
    const float rem = scaled - static_cast<float>(q);
    if (rem > 0.5f || (rem == 0.5f && (q & 1u))) ++q;
    return Half{static_cast<uint16_t>(sign | q)};
  }
  // Normal: rebias the exponent, round the 13 dropped mantissa bits to nearest even.
  uint32_t h = ((abs - 0x38000000u) >> 13);
  const uint32_t dropped = abs & 0x1FFFu;
  if (dropped > 0x1000u || (dropped == 0x1000u && (h & 1u))) ++h;
  return Half{static_cast<uint16_t>(sign | h)};
}

// Accumulation type of each storage type: float for 16-bit and float, double for double.
template <typename T>
struct AccOf {
  using type = float;
};
template <>
struct AccOf<double> {
  using type = double;
};
template <typename T>
using Acc = typename AccOf<T>::type;

inline float ToAcc(float v) { return v; }
inline double ToAcc(double v) { return v; }
inline float ToAcc(Half v) { return ToFloat(v); }
inline float ToAcc(BFloat16 v) { return ToFloat(v); }

template <typename T>
inline T FromAcc(Acc<T> v);
template <>
inline float FromAcc<float>(float v) {
  return v;
}
template <>
inline double FromAcc<double>(double v) {
  return v;
}
template <>
inline Half FromAcc<Half>(float v) {
  return ToHalf(v);
}
template <>
inline BFloat16 FromAcc<BFloat16>(float v) {
  return ToBFloat16(v);
}

// Runs f(T{}) with the storage type T of `dtype` (Half, BFloat16, float or double).
template <typename F>
void WithType(DataType dtype, F&& f) {
  switch (dtype) {
    case DataType::kFloat16:
      f(Half{});
      break;
    case DataType::kBFloat16:
      f(BFloat16{});
      break;
    case DataType::kFloat32:
      f(float{});
      break;
    case DataType::kFloat64:
      f(double{});
      break;
  }
}

}  // namespace fbn::kernels

#endif  // FBN_KERNELS_CONVERT_H_
