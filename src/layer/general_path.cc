#include "layer/general_path.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace fbn::layer_impl {

Geometry::Geometry(const Shape& shape, const std::vector<int>& axes, int64_t groups)
    : groups_(groups) {
  const int rank = shape.rank();
  n_ = shape.num_elements();
  std::vector<bool> is_axis(static_cast<size_t>(rank), false);
  for (int a : axes) is_axis[static_cast<size_t>(a)] = true;
  // Parameter stride of each dim: the product of the later axis dims (0 for reduced dims).
  std::vector<int64_t> pstride(static_cast<size_t>(rank), 0);
  int64_t acc = 1;
  for (int d = rank - 1; d >= 0; --d) {
    if (is_axis[static_cast<size_t>(d)]) {
      pstride[static_cast<size_t>(d)] = acc;
      acc *= shape.dim(d);
    }
  }
  params_ = acc;
  batch_ = rank > 0 ? shape.dim(0) : 1;
  pstride0_ = rank > 0 ? pstride[0] : 0;
  // Collapse dims 1..rank-1 into blocks of the same kind; a block's parameter stride is its
  // innermost dim's.
  for (int d = 1; d < rank; ++d) {
    const bool ax = is_axis[static_cast<size_t>(d)];
    if (!block_size_.empty() && block_is_axis_.back() == ax) {
      block_size_.back() *= shape.dim(d);
      block_pstride_.back() = ax ? pstride[static_cast<size_t>(d)] : 0;
    } else {
      block_size_.push_back(shape.dim(d));
      block_pstride_.push_back(ax ? pstride[static_cast<size_t>(d)] : 0);
      block_is_axis_.push_back(ax);
    }
  }
}

namespace {

// A synchronized layer's batch statistics: local moments around the local mean (in double),
// merged across processes by `sync`.
template <typename T>
void SyncedMoments(const Geometry& g, const T* x, StatsSync* sync, GeneralOutputs<T>* out) {
  const int64_t P = g.params(), S = g.slots();
  const int64_t local = g.count();
  std::vector<double> mean(static_cast<size_t>(S), 0.0), m2(static_cast<size_t>(S), 0.0);
  g.ForEachRun([&](int64_t off, int64_t len, int64_t p0, int64_t pstep, int64_t grp) {
    double* a = mean.data() + grp * P + p0;
    if (pstep == 0) {
      double s = 0.0;
      for (int64_t j = 0; j < len; ++j) s += x[off + j];
      *a += s;
    } else {
      for (int64_t j = 0; j < len; ++j) a[j] += x[off + j];
    }
  });
  if (local > 0) {
    for (double& v : mean) v /= static_cast<double>(local);
  }
  g.ForEachRun([&](int64_t off, int64_t len, int64_t p0, int64_t pstep, int64_t grp) {
    const int64_t base = grp * P + p0;
    for (int64_t j = 0; j < len; ++j) {
      const double dev = double(x[off + j]) - mean[base + j * pstep];
      m2[base + j * pstep] += dev * dev;
    }
  });
  int64_t total = 0;
  sync->MergeMoments(local, &mean, &m2, &total);
  // An empty global batch gives tf.nn.moments's NaN (0 / 0), as without synchronization.
  const double cnt = static_cast<double>(total);
  out->mean.resize(static_cast<size_t>(S));
  out->variance.resize(static_cast<size_t>(S));
  for (int64_t s = 0; s < S; ++s) {
    out->mean[s] = static_cast<T>(total > 0 ? mean[s] : std::numeric_limits<double>::quiet_NaN());
    out->variance[s] = static_cast<T>(m2[s] / cnt);
  }
}

}  // namespace

template <typename T>
void GeneralForward(const Geometry& g, const T* x, const GeneralParams<T>& p, bool batch_stats,
                    GeneralOutputs<T>* out, StatsSync* sync) {
  const int64_t P = g.params(), G = g.groups(), S = g.slots(), N = g.num_elements();
  const T eps = static_cast<T>(p.epsilon);
  const T nan = std::numeric_limits<T>::quiet_NaN();
  out->y.assign(static_cast<size_t>(N), T(0));
  out->r.assign(static_cast<size_t>(P), T(1));
  out->d.assign(static_cast<size_t>(P), T(0));

  if (batch_stats && sync) {
    SyncedMoments(g, x, sync, out);
  } else if (batch_stats) {
    // tf.nn.moments: mean, then the mean squared deviation from it (two passes, biased).
    const double cnt = static_cast<double>(g.count());
    std::vector<double> acc(static_cast<size_t>(S), 0.0);
    g.ForEachRun([&](int64_t off, int64_t len, int64_t p0, int64_t pstep, int64_t grp) {
      double* a = acc.data() + grp * P + p0;
      if (pstep == 0) {
        double s = 0.0;
        for (int64_t j = 0; j < len; ++j) s += x[off + j];
        *a += s;
      } else {
        for (int64_t j = 0; j < len; ++j) a[j] += x[off + j];
      }
    });
    out->mean.resize(static_cast<size_t>(S));
    for (int64_t s = 0; s < S; ++s) out->mean[s] = static_cast<T>(acc[s] / cnt);
    std::fill(acc.begin(), acc.end(), 0.0);
    const T* mean = out->mean.data();
    g.ForEachRun([&](int64_t off, int64_t len, int64_t p0, int64_t pstep, int64_t grp) {
      const int64_t base = grp * P + p0;
      for (int64_t j = 0; j < len; ++j) {
        const double dev = double(x[off + j]) - double(mean[base + j * pstep]);
        acc[base + j * pstep] += dev * dev;
      }
    });
    out->variance.resize(static_cast<size_t>(S));
    for (int64_t s = 0; s < S; ++s) out->variance[s] = static_cast<T>(acc[s] / cnt);
  }
  if (batch_stats) {
    // Moving statistics follow the mean over the virtual batches of their statistics.
    out->new_mean.assign(static_cast<size_t>(P), G > 0 ? T(0) : nan);
    out->new_var.assign(static_cast<size_t>(P), G > 0 ? T(0) : nan);
    if (G == 1) {
      out->new_mean = out->mean;
      out->new_var = out->variance;
    } else if (G > 1) {
      for (int64_t q = 0; q < P; ++q) {
        double sm = 0.0, sv = 0.0;
        for (int64_t grp = 0; grp < G; ++grp) {
          sm += out->mean[grp * P + q];
          sv += out->variance[grp * P + q];
        }
        out->new_mean[q] = static_cast<T>(sm / double(G));
        out->new_var[q] = static_cast<T>(sv / double(G));
      }
    }
    if (p.renorm) {
      // r and d from the renorm statistics as they are before this call's updates.
      const T min_sd = std::sqrt(eps);
      out->stddev.resize(static_cast<size_t>(P));
      for (int64_t q = 0; q < P; ++q) {
        const T sd = std::sqrt(out->new_var[q] + eps);
        out->stddev[q] = sd;
        const T rs = std::max(p.renorm_stddev[q], min_sd);
        T r = sd / rs;
        T d = (out->new_mean[q] - p.renorm_mean[q]) / rs;
        if (p.rmin) r = std::max(r, static_cast<T>(*p.rmin));
        if (p.rmax) r = std::min(r, static_cast<T>(*p.rmax));
        if (p.dmax) {
          d = std::max(d, static_cast<T>(-*p.dmax));
          d = std::min(d, static_cast<T>(*p.dmax));
        }
        out->r[q] = r;
        out->d[q] = d;
      }
    }
  }

  // tf.nn.batch_normalization: inv = rsqrt(var + eps) * scale; y = x * inv + (offset - mean * inv),
  // with scale = r * adj_scale * gamma and offset = d * (adj_scale * gamma) + adj_bias * gamma +
  // beta (each factor present only when configured).
  const T* mu = batch_stats ? out->mean.data() : p.moving_mean;
  const T* var = batch_stats ? out->variance.data() : p.moving_variance;
  std::vector<T> inv(static_cast<size_t>(S));
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q = s % std::max<int64_t>(P, 1);
    const T v = batch_stats ? var[s] : var[q];
    inv[s] = T(1) / std::sqrt(v + eps);
  }
  const bool has_renorm = batch_stats && p.renorm;
  const bool adjust = batch_stats && p.adj_scale;
  if (!adjust) {
    std::vector<T> a(static_cast<size_t>(S)), b(static_cast<size_t>(S));
    for (int64_t s = 0; s < S; ++s) {
      const int64_t q = s % std::max<int64_t>(P, 1);
      const T m = batch_stats ? mu[s] : mu[q];
      T scale = p.gamma ? p.gamma[q] : T(1);
      T offset = p.beta ? p.beta[q] : T(0);
      if (has_renorm) {
        offset = (p.gamma ? out->d[q] * p.gamma[q] : out->d[q]) + offset;
        scale = out->r[q] * scale;
      }
      a[s] = inv[s] * scale;
      b[s] = offset - m * a[s];
    }
    T* y = out->y.data();
    g.ForEachRun([&](int64_t off, int64_t len, int64_t p0, int64_t pstep, int64_t grp) {
      const int64_t base = grp * P + p0;
      for (int64_t j = 0; j < len; ++j) {
        const int64_t s = base + j * pstep;
        y[off + j] = x[off + j] * a[s] + b[s];
      }
    });
    return;
  }
  T* y = out->y.data();
  g.ForEachRun([&](int64_t off, int64_t len, int64_t p0, int64_t pstep, int64_t grp) {
    const int64_t base = grp * P + p0;
    for (int64_t j = 0; j < len; ++j) {
      const int64_t i = off + j, q = p0 + j * pstep, s = base + j * pstep;
      T scale = p.adj_scale[i], offset = p.adj_bias[i];
      if (p.gamma) {
        offset = offset * p.gamma[q];
        scale = scale * p.gamma[q];
      }
      if (p.beta) offset = offset + p.beta[q];
      if (has_renorm) {
        offset = out->d[q] * scale + offset;
        scale = out->r[q] * scale;
      }
      const T a = inv[s] * scale;
      y[i] = x[i] * a + (offset - mu[s] * a);
    }
  });
}

template void GeneralForward<float>(const Geometry&, const float*, const GeneralParams<float>&,
                                    bool, GeneralOutputs<float>*, StatsSync*);
template void GeneralForward<double>(const Geometry&, const double*, const GeneralParams<double>&,
                                     bool, GeneralOutputs<double>*, StatsSync*);

void GeneralBackward(const Geometry& g, const double* x, const double* dy, const GeneralSaved& s,
                     std::vector<double>* dx_out, std::vector<double>* dgamma_out,
                     std::vector<double>* dbeta_out, StatsSync* sync) {
  const int64_t P = g.params(), S = g.slots(), N = g.num_elements();
  std::vector<double>& dx = *dx_out;
  std::vector<double>& dgamma = *dgamma_out;
  std::vector<double>& dbeta = *dbeta_out;
  dx.assign(static_cast<size_t>(N), 0.0);
  dgamma.assign(static_cast<size_t>(P), 0.0);
  dbeta.assign(static_cast<size_t>(P), 0.0);
  auto gamma = [&](int64_t q) { return s.gamma.empty() ? 1.0 : s.gamma[q]; };
  auto r = [&](int64_t q) { return s.r.empty() ? 1.0 : s.r[q]; };
  auto d = [&](int64_t q) { return s.d.empty() ? 0.0 : s.d[q]; };
  auto adj_s = [&](int64_t i) { return s.adj_scale.empty() ? 1.0 : s.adj_scale[i]; };
  auto adj_b = [&](int64_t i) { return s.adj_bias.empty() ? 0.0 : s.adj_bias[i]; };

  if (!s.batch_stats) {
    // y = (x - mean) * rsqrt(var + eps) * gamma + beta with the moving statistics: constants.
    std::vector<double> rs(static_cast<size_t>(P));
    for (int64_t q = 0; q < P; ++q) rs[q] = 1.0 / std::sqrt(s.variance[q] + s.epsilon);
    g.ForEachRun([&](int64_t off, int64_t len, int64_t p0, int64_t pstep, int64_t) {
      for (int64_t j = 0; j < len; ++j) {
        const int64_t i = off + j, q = p0 + j * pstep;
        dx[i] = dy[i] * gamma(q) * rs[q];
        dgamma[q] += dy[i] * (x[i] - s.mean[q]) * rs[q];
        dbeta[q] += dy[i];
      }
    });
    return;
  }

  // Training: y = A * gamma + beta with A = (xhat * r + d) * adj_scale + adj_bias and
  // xhat = (x - mean) * rsqrt(var + eps) over each slot; r and d carry no gradient.
  double cnt = static_cast<double>(g.count());
  std::vector<double> rs(static_cast<size_t>(S)), sum_g(static_cast<size_t>(S), 0.0),
      sum_gx(static_cast<size_t>(S), 0.0);
  for (int64_t k = 0; k < S; ++k) rs[k] = 1.0 / std::sqrt(s.variance[k] + s.epsilon);
  g.ForEachRun([&](int64_t off, int64_t len, int64_t p0, int64_t pstep, int64_t grp) {
    for (int64_t j = 0; j < len; ++j) {
      const int64_t i = off + j, q = p0 + j * pstep, k = grp * P + q;
      const double xhat = (x[i] - s.mean[k]) * rs[k];
      dgamma[q] += dy[i] * ((xhat * r(q) + d(q)) * adj_s(i) + adj_b(i));
      dbeta[q] += dy[i];
      const double gx = dy[i] * gamma(q) * r(q) * adj_s(i);
      dx[i] = gx;  // kept for the second pass
      sum_g[k] += gx;
      sum_gx[k] += gx * xhat;
    }
  });
  if (sync) {
    int64_t total = 0;
    sync->SumGradients(g.count(), &sum_g, &sum_gx, &total);
    cnt = static_cast<double>(total);
  }
  g.ForEachRun([&](int64_t off, int64_t len, int64_t p0, int64_t pstep, int64_t grp) {
    for (int64_t j = 0; j < len; ++j) {
      const int64_t i = off + j, k = grp * P + p0 + j * pstep;
      const double xhat = (x[i] - s.mean[k]) * rs[k];
      dx[i] = rs[k] * (dx[i] - sum_g[k] / cnt - xhat * sum_gx[k] / cnt);
    }
  });
}

}  // namespace fbn::layer_impl
