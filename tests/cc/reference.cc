#include "reference.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

namespace fbn_test {

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

int64_t Product(const std::vector<int64_t>& dims, size_t from, size_t to) {
  int64_t p = 1;
  for (size_t i = from; i < to; ++i) p *= dims[i];
  return p;
}

// Per-channel sums over the non-channel positions, in the order of the flat index.
std::vector<double> ChannelSums(const RefLayout& l, const std::vector<double>& v) {
  std::vector<double> s(static_cast<size_t>(l.Channels()), 0.0);
  for (int64_t i = 0; i < l.Elements(); ++i) s[l.ChannelOf(i)] += v[i];
  return s;
}

void CheckSize(const std::vector<double>& v, int64_t n, const char* what) {
  if (static_cast<int64_t>(v.size()) != n) {
    throw std::invalid_argument(std::string("reference: bad size of ") + what);
  }
}

}  // namespace

int64_t RefLayout::Channels() const { return channels_last ? dims.back() : dims.at(1); }

int64_t RefLayout::Elements() const { return Product(dims, 0, dims.size()); }

int64_t RefLayout::PerChannel() const {
  const int64_t c = Channels();
  return c == 0 ? 0 : Elements() / c;
}

int64_t RefLayout::ChannelOf(int64_t i) const {
  if (channels_last) return i % dims.back();
  const int64_t inner = Product(dims, 2, dims.size());
  return (i / inner) % dims[1];
}

RefForward RefBatchNormTraining(const RefLayout& l, const std::vector<double>& x,
                                const std::vector<double>& scale, const std::vector<double>& offset,
                                const std::vector<double>& old_mean,
                                const std::vector<double>& old_variance, double epsilon,
                                double factor) {
  const int64_t C = l.Channels();
  CheckSize(x, l.Elements(), "x");
  CheckSize(scale, C, "scale");
  CheckSize(offset, C, "offset");
  RefForward r;
  r.y.assign(x.size(), 0.0);
  if (l.Elements() == 0) {
    r.batch_mean.assign(C, kNaN);
    r.batch_variance.assign(C, kNaN);
    r.saved_mean.assign(C, kNaN);
    r.saved_variance.assign(C, kNaN);
    return r;
  }
  const double n = static_cast<double>(l.PerChannel());
  std::vector<double> mean = ChannelSums(l, x);
  for (double& m : mean) m /= n;
  std::vector<double> sq(static_cast<size_t>(C), 0.0);
  for (int64_t i = 0; i < l.Elements(); ++i) {
    const double d = x[i] - mean[l.ChannelOf(i)];
    sq[l.ChannelOf(i)] += d * d;
  }
  std::vector<double> var(static_cast<size_t>(C));
  for (int64_t c = 0; c < C; ++c) var[c] = sq[c] / n;
  for (int64_t i = 0; i < l.Elements(); ++i) {
    const int64_t c = l.ChannelOf(i);
    r.y[i] = (x[i] - mean[c]) / std::sqrt(var[c] + epsilon) * scale[c] + offset[c];
  }
  const double bessel = n / std::max(n - 1.0, 1.0);
  r.batch_mean.resize(C);
  r.batch_variance.resize(C);
  for (int64_t c = 0; c < C; ++c) {
    if (factor == 1.0) {
      r.batch_mean[c] = mean[c];
      r.batch_variance[c] = var[c] * bessel;
    } else {
      r.batch_mean[c] = (1.0 - factor) * old_mean.at(c) + factor * mean[c];
      r.batch_variance[c] = (1.0 - factor) * old_variance.at(c) + factor * var[c] * bessel;
    }
  }
  r.saved_mean = mean;
  r.saved_variance = var;
  return r;
}

RefForward RefBatchNormInference(const RefLayout& l, const std::vector<double>& x,
                                 const std::vector<double>& scale,
                                 const std::vector<double>& offset, const std::vector<double>& mean,
                                 const std::vector<double>& variance, double epsilon) {
  const int64_t C = l.Channels();
  CheckSize(x, l.Elements(), "x");
  CheckSize(mean, C, "mean");
  CheckSize(variance, C, "variance");
  RefForward r;
  r.y.assign(x.size(), 0.0);
  if (l.Elements() == 0) {
    r.batch_mean.assign(C, kNaN);
    r.batch_variance.assign(C, kNaN);
    return r;
  }
  for (int64_t i = 0; i < l.Elements(); ++i) {
    const int64_t c = l.ChannelOf(i);
    r.y[i] = (x[i] - mean[c]) / std::sqrt(variance[c] + epsilon) * scale[c] + offset[c];
  }
  r.batch_mean = r.saved_mean = mean;
  r.batch_variance = r.saved_variance = variance;
  return r;
}

RefGrad RefBatchNormGradTraining(const RefLayout& l, const std::vector<double>& dy,
                                 const std::vector<double>& x, const std::vector<double>& scale,
                                 const std::vector<double>& mean,
                                 const std::vector<double>& variance, double epsilon) {
  const int64_t C = l.Channels();
  CheckSize(dy, l.Elements(), "dy");
  CheckSize(x, l.Elements(), "x");
  RefGrad g;
  g.dx.assign(x.size(), 0.0);
  g.dx_bound.assign(x.size(), 0.0);
  g.dscale.assign(C, 0.0);
  g.doffset.assign(C, 0.0);
  g.dscale_bound.assign(C, 0.0);
  g.doffset_bound.assign(C, 0.0);
  if (l.Elements() == 0) return g;
  const double n = static_cast<double>(l.PerChannel());
  std::vector<double> inv(C), sum_dy(C, 0.0), sum_dy_xc(C, 0.0), abs_dy(C, 0.0), abs_dy_xc(C, 0.0);
  for (int64_t c = 0; c < C; ++c) inv[c] = 1.0 / std::sqrt(variance[c] + epsilon);
  for (int64_t i = 0; i < l.Elements(); ++i) {
    const int64_t c = l.ChannelOf(i);
    const double xc = x[i] - mean[c];
    sum_dy[c] += dy[i];
    sum_dy_xc[c] += dy[i] * xc;
    abs_dy[c] += std::fabs(dy[i]);
    abs_dy_xc[c] += std::fabs(dy[i] * xc);
  }
  for (int64_t i = 0; i < l.Elements(); ++i) {
    const int64_t c = l.ChannelOf(i);
    const double xc = x[i] - mean[c];
    const double a = scale[c] * inv[c];
    g.dx[i] = a * ((dy[i] - sum_dy[c] / n) - xc * inv[c] * inv[c] * sum_dy_xc[c] / n);
    g.dx_bound[i] = std::fabs(a) * (std::fabs(dy[i]) + abs_dy[c] / n +
                                    std::fabs(xc) * inv[c] * inv[c] * abs_dy_xc[c] / n);
  }
  for (int64_t c = 0; c < C; ++c) {
    g.doffset[c] = sum_dy[c];
    g.dscale[c] = sum_dy_xc[c] * inv[c];
    g.doffset_bound[c] = abs_dy[c];
    g.dscale_bound[c] = abs_dy_xc[c] * inv[c];
  }
  return g;
}

RefGrad RefBatchNormGradInference(const RefLayout& l, const std::vector<double>& dy,
                                  const std::vector<double>& x, const std::vector<double>& scale,
                                  const std::vector<double>& mean,
                                  const std::vector<double>& variance, double epsilon) {
  const int64_t C = l.Channels();
  CheckSize(dy, l.Elements(), "dy");
  CheckSize(x, l.Elements(), "x");
  RefGrad g;
  g.dx.assign(x.size(), 0.0);
  g.dx_bound.assign(x.size(), 0.0);
  g.dscale.assign(C, 0.0);
  g.doffset.assign(C, 0.0);
  g.dscale_bound.assign(C, 0.0);
  g.doffset_bound.assign(C, 0.0);
  for (int64_t i = 0; i < l.Elements(); ++i) {
    const int64_t c = l.ChannelOf(i);
    const double inv = 1.0 / std::sqrt(variance[c] + epsilon);
    const double xc = x[i] - mean[c];
    g.dx[i] = dy[i] * scale[c] * inv;
    g.dx_bound[i] = std::fabs(g.dx[i]);
    g.doffset[c] += dy[i];
    g.doffset_bound[c] += std::fabs(dy[i]);
    g.dscale[c] += dy[i] * xc * inv;
    g.dscale_bound[c] += std::fabs(dy[i] * xc * inv);
  }
  return g;
}

void RefMoments(const std::vector<int64_t>& dims, const std::vector<double>& x,
                const std::vector<bool>& reduced, std::vector<double>* mean,
                std::vector<double>* variance) {
  const size_t rank = dims.size();
  int64_t outputs = 1;
  for (size_t d = 0; d < rank; ++d) {
    if (!reduced[d]) outputs *= dims[d];
  }
  const int64_t total = Product(dims, 0, rank);
  const int64_t count = outputs == 0 ? 0 : total / outputs;
  // Output index of flat x index i: the row-major index over the kept dims.
  auto out_index = [&](int64_t i) {
    int64_t rem = i, o = 0, ostride = 1;
    for (size_t d = rank; d-- > 0;) {
      const int64_t idx = rem % dims[d];
      rem /= dims[d];
      if (!reduced[d]) {
        o += idx * ostride;
        ostride *= dims[d];
      }
    }
    return o;
  };
  mean->assign(outputs, 0.0);
  variance->assign(outputs, 0.0);
  for (int64_t i = 0; i < total; ++i) (*mean)[out_index(i)] += x[i];
  for (double& m : *mean) m /= static_cast<double>(count);
  for (int64_t i = 0; i < total; ++i) {
    const double d = x[i] - (*mean)[out_index(i)];
    (*variance)[out_index(i)] += d * d;
  }
  for (double& v : *variance) v /= static_cast<double>(count);
}

std::vector<double> RefBatchNormalization(const std::vector<int64_t>& x_dims,
                                          const std::vector<double>& x, const RefParam& mean,
                                          const RefParam& variance, const RefParam* offset,
                                          const RefParam* scale, double epsilon) {
  const size_t rank = x_dims.size();
  // Value of p broadcast to the x position given by idx (NumPy: align trailing dims).
  auto at = [&](const RefParam& p, const std::vector<int64_t>& idx) {
    int64_t o = 0;
    const size_t pr = p.dims.size();
    for (size_t j = 0; j < pr; ++j) {
      const int64_t i = p.dims[j] == 1 ? 0 : idx[rank - pr + j];
      o = o * p.dims[j] + i;
    }
    return p.values[o];
  };
  const int64_t total = Product(x_dims, 0, rank);
  std::vector<double> y(total);
  std::vector<int64_t> idx(rank);
  for (int64_t i = 0; i < total; ++i) {
    int64_t rem = i;
    for (size_t d = rank; d-- > 0;) {
      idx[d] = rem % x_dims[d];
      rem /= x_dims[d];
    }
    double v = (x[i] - at(mean, idx)) / std::sqrt(at(variance, idx) + epsilon);
    if (scale) v *= at(*scale, idx);
    if (offset) v += at(*offset, idx);
    y[i] = v;
  }
  return y;
}

// ---------------------------------------------------------------------------------------------

namespace {

// Rounds v to `precision` significant bits with exponent floor `emin` (subnormals below),
// ties to even; +-inf when the result exceeds max_finite.
double RoundTo(double v, int precision, int emin, double max_finite) {
  if (std::isnan(v) || std::isinf(v) || v == 0.0) return v;
  int e = 0;
  std::frexp(v, &e);  // |v| = m·2^e with m in [0.5, 1): the leading bit has exponent e - 1
  const int lead = std::max(e - 1, emin);
  const double quantum = std::ldexp(1.0, lead - (precision - 1));
  // v / quantum is exact (a power-of-two scale); nearbyint rounds ties to even in the default
  // rounding mode.
  const double r = std::nearbyint(v / quantum) * quantum;
  if (std::fabs(r) > max_finite) return std::copysign(std::numeric_limits<double>::infinity(), v);
  return r;
}

double UlpAt(double v, int precision, int emin) {
  v = std::fabs(v);
  int e = 0;
  if (v == 0.0 || std::isinf(v) || std::isnan(v)) return std::ldexp(1.0, emin - (precision - 1));
  std::frexp(v, &e);
  return std::ldexp(1.0, std::max(e - 1, emin) - (precision - 1));
}

constexpr double kHalfMax = 65504.0;
constexpr double kBFloat16Max = 3.3895313892515355e38;  // (2 - 2^-7) · 2^127

}  // namespace

double RoundToHalf(double v) { return RoundTo(v, 11, -14, kHalfMax); }
double RoundToBFloat16(double v) { return RoundTo(v, 8, -126, kBFloat16Max); }
double HalfUlp(double v) { return UlpAt(v, 11, -14); }
double BFloat16Ulp(double v) { return UlpAt(v, 8, -126); }

uint16_t HalfBits(double v) {
  const uint16_t sign = std::signbit(v) ? 0x8000 : 0;
  if (std::isnan(v)) return sign | 0x7E00;
  const double r = std::fabs(RoundToHalf(v));
  if (std::isinf(r)) return sign | 0x7C00;
  if (r < std::ldexp(1.0, -14)) {
    // Subnormal or zero: an integer multiple of 2^-24.
    return sign | static_cast<uint16_t>(r / std::ldexp(1.0, -24));
  }
  int e = 0;
  std::frexp(r, &e);
  const int exponent = e - 1;  // r in [2^exponent, 2^(exponent+1))
  const double mantissa = r / std::ldexp(1.0, exponent - 10) - 1024.0;  // exact: 10 bits
  return sign | static_cast<uint16_t>(((exponent + 15) << 10) | static_cast<int>(mantissa));
}

uint16_t BFloat16Bits(double v) {
  const uint16_t sign = std::signbit(v) ? 0x8000 : 0;
  if (std::isnan(v)) return sign | 0x7FC0;
  // The rounded value has at most 8 significant bits and a float exponent: exact in float, whose
  // upper 16 bits are then the encoding.
  const float f = static_cast<float>(RoundToBFloat16(v));
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

double HalfFromBits(uint16_t bits) {
  const double sign = (bits & 0x8000) ? -1.0 : 1.0;
  const int exponent = (bits >> 10) & 0x1F;
  const int mantissa = bits & 0x3FF;
  if (exponent == 0x1F) {
    return mantissa ? std::numeric_limits<double>::quiet_NaN()
                    : sign * std::numeric_limits<double>::infinity();
  }
  if (exponent == 0) return sign * std::ldexp(static_cast<double>(mantissa), -24);
  return sign * std::ldexp(1024.0 + mantissa, exponent - 25);
}

double BFloat16FromBits(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return static_cast<double>(f);
}

}  // namespace fbn_test
