// SyncFusedBatchNorm / SyncFusedBatchNormGrad: local partials from the kernels, one exchange,
// rank-ordered merges, then the element-wise kernels with global coefficients.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "distributed/exchange.h"
#include "fbn/distributed.h"
#include "kernels/batch_norm_kernels.h"
#include "ops/op_common.h"
#include "ops/validation.h"

namespace fbn {
namespace {

using distributed::Gathered;
using distributed::Pass;
using distributed::PassInfo;

template <typename U>
Status RunForward(Communicator& comm, OpVersion version, const FusedBatchNormInputs& in,
                  const FusedBatchNormAttrs& attrs, const FusedBatchNormOutputs& out,
                  uint64_t tag) {
  const kernels::Geometry g = ops::MakeGeometry(in.x.shape, attrs.data_format);
  const int64_t C = g.c;
  const size_t uc = static_cast<size_t>(C);
  const int64_t local = g.per_channel();
  // Local partials: mean and centred sum of squares (M2) per channel.
  std::vector<double> partials(2 * uc, 0.0), mean(uc), m2(uc);
  if (g.elements() > 0) {
    kernels::ComputeStats(in.x.dtype, g, in.x.data, mean.data(), m2.data());
    for (size_t c = 0; c < uc; ++c) {
      partials[c] = mean[c];
      partials[uc + c] = m2[c] * static_cast<double>(local);
    }
  }
  Gathered gathered;
  Status s = distributed::Exchange(comm, PassInfo{Pass::kForward, in.x.dtype, C, tag}, local,
                                   partials.data(), &gathered);
  if (!s.ok()) return s;
  int64_t total = 0;
  distributed::MergeMoments(gathered, mean.data(), m2.data(), &total);

  const U* scale = static_cast<const U*>(in.scale.data);
  const U* offset = static_cast<const U*>(in.offset.data);
  const U* old_mean = static_cast<const U*>(in.mean.data);
  const U* old_var = static_cast<const U*>(in.variance.data);
  U* batch_mean = static_cast<U*>(out.batch_mean.data);
  U* batch_var = static_cast<U*>(out.batch_variance.data);
  U* rs1 = static_cast<U*>(out.reserve_space_1.data);
  U* rs2 = static_cast<U*>(out.reserve_space_2.data);
  if (version == OpVersion::kV3) *static_cast<U*>(out.reserve_space_3.data) = U(0);
  if (total == 0) {
    // An empty global batch: FusedBatchNorm's NaN statistics (nothing to normalize here either).
    for (size_t c = 0; c < uc; ++c) {
      batch_mean[c] = batch_var[c] = std::numeric_limits<U>::quiet_NaN();
      rs1[c] = rs2[c] = U(0);
    }
    return Status::Ok();
  }
  const double n = static_cast<double>(total);
  const double eps = static_cast<double>(attrs.epsilon);
  const double bessel = n / std::max(n - 1.0, 1.0);
  const double f = static_cast<double>(attrs.exponential_avg_factor);
  const bool blend = attrs.exponential_avg_factor != 1.0f;
  std::vector<U> k_mean(uc), k_a(uc), k_b(uc);
  for (size_t c = 0; c < uc; ++c) {
    const double var = m2[c] / n;
    k_mean[c] = static_cast<U>(mean[c]);
    k_a[c] = static_cast<U>(static_cast<double>(scale[c]) / std::sqrt(var + eps));
    k_b[c] = offset[c];
  }
  if (g.elements() > 0) {
    kernels::Apply(in.x.dtype, g, in.x.data, k_mean.data(), k_a.data(), k_b.data(), out.y.data);
  }
  // As FusedBatchNorm: read each input before writing (outputs may alias mean/variance).
  for (size_t c = 0; c < uc; ++c) {
    const double var = m2[c] / n;
    const double unbiased = var * bessel;
    if (blend) {
      batch_mean[c] = static_cast<U>((1.0 - f) * static_cast<double>(old_mean[c]) + f * mean[c]);
      batch_var[c] = static_cast<U>((1.0 - f) * static_cast<double>(old_var[c]) + f * unbiased);
    } else {
      batch_mean[c] = static_cast<U>(mean[c]);
      batch_var[c] = static_cast<U>(unbiased);
    }
    rs1[c] = static_cast<U>(mean[c]);
    rs2[c] = static_cast<U>(var);
  }
  return Status::Ok();
}

template <typename U>
Status RunGrad(Communicator& comm, const FusedBatchNormGradInputs& in,
               const FusedBatchNormGradAttrs& attrs, const FusedBatchNormGradOutputs& out,
               uint64_t tag) {
  const kernels::Geometry g = ops::MakeGeometry(in.x.shape, attrs.data_format);
  const int64_t C = g.c;
  const size_t uc = static_cast<size_t>(C);
  const int64_t local = g.per_channel();
  const U* scale = static_cast<const U*>(in.scale.data);
  const U* mean = static_cast<const U*>(in.reserve_space_1.data);
  const U* var = static_cast<const U*>(in.reserve_space_2.data);
  const double eps = static_cast<double>(attrs.epsilon);
  std::vector<double> inv(uc), partials(2 * uc, 0.0), sum_dy(uc), sum_dy_xc(uc);
  std::vector<U> k_mean(uc), k1(uc), k2(uc), k0(uc);
  for (size_t c = 0; c < uc; ++c) {
    inv[c] = 1.0 / std::sqrt(static_cast<double>(var[c]) + eps);
    k_mean[c] = mean[c];
    k1[c] = static_cast<U>(static_cast<double>(scale[c]) * inv[c]);
  }
  if (g.elements() > 0) {
    kernels::BackwardReduce(in.x.dtype, g, in.y_backprop.data, in.x.data, k_mean.data(),
                            partials.data(), partials.data() + uc);
  }
  Gathered gathered;
  Status s = distributed::Exchange(comm, PassInfo{Pass::kBackward, in.x.dtype, C, tag}, local,
                                   partials.data(), &gathered);
  if (!s.ok()) return s;
  int64_t total = 0;
  distributed::SumPartials(gathered, sum_dy.data(), sum_dy_xc.data(), &total);
  U* scale_bp = static_cast<U*>(out.scale_backprop.data);
  U* offset_bp = static_cast<U*>(out.offset_backprop.data);
  if (g.elements() > 0) {
    const double n = static_cast<double>(total);
    for (size_t c = 0; c < uc; ++c) {
      const double a = static_cast<double>(k1[c]);
      k0[c] = static_cast<U>(-a * sum_dy[c] / n);
      k2[c] = static_cast<U>(-a * inv[c] * inv[c] * sum_dy_xc[c] / n);
    }
    kernels::BackwardApply(in.x.dtype, g, in.y_backprop.data, in.x.data, k_mean.data(), k1.data(),
                           k2.data(), k0.data(), out.x_backprop.data);
  }
  // This rank's parameter gradients.
  for (size_t c = 0; c < uc; ++c) {
    offset_bp[c] = static_cast<U>(partials[c]);
    scale_bp[c] = static_cast<U>(partials[uc + c] * inv[c]);
  }
  return Status::Ok();
}

}  // namespace

Status SyncFusedBatchNorm(Communicator& comm, OpVersion version, const FusedBatchNormInputs& inputs,
                          const FusedBatchNormAttrs& attrs, const FusedBatchNormOutputs& outputs,
                          uint64_t tag) noexcept {
  return ops::Guarded([&]() -> Status {
    if (!attrs.is_training || comm.size() == 1) {
      return FusedBatchNorm(version, inputs, attrs, outputs);
    }
    TensorSpec specs[kMaxOpOutputs];
    Status s = ops::CheckForwardOutputs(version, inputs, attrs, outputs, specs);
    if (!s.ok()) {
      distributed::ExchangeFailure(comm, PassInfo{Pass::kForward, inputs.x.dtype, 0, tag},
                                   s.message());
      return s;
    }
    if (ops::StatsType(inputs.x.dtype) == DataType::kFloat64) {
      return RunForward<double>(comm, version, inputs, attrs, outputs, tag);
    }
    return RunForward<float>(comm, version, inputs, attrs, outputs, tag);
  });
}

Status SyncFusedBatchNormGrad(Communicator& comm, OpVersion version,
                              const FusedBatchNormGradInputs& inputs,
                              const FusedBatchNormGradAttrs& attrs,
                              const FusedBatchNormGradOutputs& outputs, uint64_t tag) noexcept {
  return ops::Guarded([&]() -> Status {
    if (!attrs.is_training || comm.size() == 1) {
      return FusedBatchNormGrad(version, inputs, attrs, outputs);
    }
    TensorSpec specs[kMaxOpOutputs];
    Status s = ops::CheckGradOutputs(version, inputs, attrs, outputs, specs);
    if (!s.ok()) {
      distributed::ExchangeFailure(comm, PassInfo{Pass::kBackward, inputs.x.dtype, 0, tag},
                                   s.message());
      return s;
    }
    if (inputs.scale.dtype == DataType::kFloat64) {
      return RunGrad<double>(comm, inputs, attrs, outputs, tag);
    }
    return RunGrad<float>(comm, inputs, attrs, outputs, tag);
  });
}

}  // namespace fbn
