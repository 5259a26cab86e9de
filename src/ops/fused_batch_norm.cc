// FusedBatchNorm / V2 / V3 forward: validation in TensorFlow's order, then the kernels.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "fbn/ops.h"
#include "kernels/batch_norm_kernels.h"
#include "kernels/channel_math.h"
#include "ops/op_common.h"
#include "ops/validation.h"

namespace fbn {
namespace {

using ops::CheckInputType;
using ops::CheckOutput;
using ops::CheckTensor;

Status ValidateForward(OpVersion version, const FusedBatchNormInputs& in,
                       const FusedBatchNormAttrs& attrs) {
  Status s = ops::CheckVersion("FusedBatchNorm", version);
  if (!s.ok()) return s;
  const char* op = FusedBatchNormOpName(version);
  // Argument types, as TensorFlow's op registration checks them.
  s = ops::CheckOpTypes(op, version, in.x.dtype,
                        {in.scale.dtype, in.offset.dtype, in.mean.dtype, in.variance.dtype});
  if (!s.ok()) return s;
  if (!(s = ops::CheckFormat(attrs.data_format, version)).ok()) return s;
  const std::pair<const ConstTensorView*, const char*> tensors[] = {{&in.x, "x"},
                                                                    {&in.scale, "scale"},
                                                                    {&in.offset, "offset"},
                                                                    {&in.mean, "mean"},
                                                                    {&in.variance, "variance"}};
  for (const auto& [t, name] : tensors) {
    if (!(s = CheckTensor(*t, name)).ok()) return s;
  }
  // The kernel's checks, in its order and with its texts.
  const int rank = in.x.shape.rank();
  if (rank != 4 && rank != 5) {
    return InvalidArgument("input must be 4 or 5-dimensional" + in.x.shape.DebugString());
  }
  if (in.scale.shape.rank() != 1) {
    return InvalidArgument("scale must be 1-dimensional" + in.scale.shape.DebugString());
  }
  if (in.offset.shape.rank() != 1) {
    return InvalidArgument("offset must be 1-dimensional" + in.offset.shape.DebugString());
  }
  if (in.mean.shape.rank() != 1) {
    return InvalidArgument("estimated_mean must be 1-dimensional" + in.mean.shape.DebugString());
  }
  if (in.variance.shape.rank() != 1) {
    return InvalidArgument("estimated_variance must be 1-dimensional" +
                           in.variance.shape.DebugString());
  }
  const int64_t C = ops::ChannelCount(in.x.shape, attrs.data_format);
  auto count_error = [&](const char* what, int64_t got) {
    return InvalidArgument(std::string(what) +
                           " must have the same number of elements as the channels of x, got " +
                           std::to_string(got) + " and " + std::to_string(C));
  };
  if (in.scale.shape.num_elements() != C)
    return count_error("scale", in.scale.shape.num_elements());
  if (in.offset.shape.num_elements() != C) {
    return count_error("offset", in.offset.shape.num_elements());
  }
  const bool use_running = !attrs.is_training || attrs.exponential_avg_factor != 1.0f;
  if (use_running) {
    const std::string prefix =
        !attrs.is_training ? "When is_training=false, " : "When exponential_avg_factor != 1, ";
    if (in.mean.shape.num_elements() != C) {
      return count_error((prefix + "mean").c_str(), in.mean.shape.num_elements());
    }
    if (in.variance.shape.num_elements() != C) {
      return count_error((prefix + "variance").c_str(), in.variance.shape.num_elements());
    }
  }
  return Status::Ok();
}

// Per-channel work in double, stored to the outputs' type U (float or double).
template <typename U>
void RunForward(OpVersion version, const FusedBatchNormInputs& in, const FusedBatchNormAttrs& attrs,
                const FusedBatchNormOutputs& out) {
  const kernels::Geometry g = ops::MakeGeometry(in.x.shape, attrs.data_format);
  const int64_t C = g.c;
  const size_t uc = static_cast<size_t>(C);
  const U* scale = static_cast<const U*>(in.scale.data);
  const U* offset = static_cast<const U*>(in.offset.data);
  const U* old_mean = static_cast<const U*>(in.mean.data);
  const U* old_var = static_cast<const U*>(in.variance.data);
  U* batch_mean = static_cast<U*>(out.batch_mean.data);
  U* batch_var = static_cast<U*>(out.batch_variance.data);
  U* rs1 = static_cast<U*>(out.reserve_space_1.data);
  U* rs2 = static_cast<U*>(out.reserve_space_2.data);
  if (version == OpVersion::kV3) *static_cast<U*>(out.reserve_space_3.data) = U(0);

  if (g.elements() == 0) {
    // TensorFlow: NaN statistics for an empty batch, in training and inference alike.
    for (size_t c = 0; c < uc; ++c) {
      batch_mean[c] = batch_var[c] = std::numeric_limits<U>::quiet_NaN();
      rs1[c] = rs2[c] = U(0);
    }
    return;
  }

  // Scratch: stats (2·C doubles) and the kernel's per-channel arrays (3·C of U).
  thread_local std::vector<double> scratch;
  if (scratch.size() < 5 * uc) scratch.resize(5 * uc);
  double* mean_d = scratch.data();
  double* var_d = mean_d + uc;
  U* k_mean = reinterpret_cast<U*>(var_d + uc);
  U* k_a = k_mean + uc;
  U* k_b = k_a + uc;
  const double eps = static_cast<double>(attrs.epsilon);

  if (attrs.is_training) {
    const double n = static_cast<double>(g.per_channel());
    const double bessel = n / std::max(n - 1.0, 1.0);
    // Run by the kernel in the tasks that own the channels (see kernels::ChannelStep).
    // With factor 1 the old statistics are not read and may be empty (null): no offset then.
    const bool blend = attrs.exponential_avg_factor != 1.0f;
    auto outputs = [&](int64_t c0, int64_t c1) {
      kernels::TrainingOutputs(std::is_same_v<U, double>, c1 - c0, mean_d + c0, var_d + c0,
                               blend ? old_mean + c0 : nullptr, blend ? old_var + c0 : nullptr,
                               bessel, static_cast<double>(attrs.exponential_avg_factor), blend,
                               batch_mean + c0, batch_var + c0, rs1 + c0, rs2 + c0);
    };
    kernels::ForwardTraining(in.x.dtype, g, in.x.data, scale, offset, eps, mean_d, var_d, k_mean,
                             k_a, k_b, out.y.data, kernels::StepFor(outputs));
    return;
  } else {
    kernels::ScaleOverStdOfU(std::is_same_v<U, double>, C, old_var, scale, eps, k_a);
    const size_t bytes = uc * sizeof(U);
    const U* apply_mean = old_mean;
    const U* apply_offset = offset;
    const U* var_src = old_var;
    const auto overlaps = [bytes](const void* p, const void* q) {
      const auto a = reinterpret_cast<uintptr_t>(p), b = reinterpret_cast<uintptr_t>(q);
      return a < b + bytes && b < a + bytes;
    };
    bool aliased = false;
    for (const void* o : {static_cast<void*>(batch_mean), static_cast<void*>(batch_var),
                          static_cast<void*>(rs1), static_cast<void*>(rs2)}) {
      for (const void* i : {static_cast<const void*>(old_mean), static_cast<const void*>(old_var),
                            static_cast<const void*>(offset)}) {
        aliased = aliased || overlaps(o, i);
      }
    }
    if (aliased) {
      // Outputs may alias the mean/variance (or offset) inputs: those are copied to scratch
      // before any output is written.
      U* var_copy = reinterpret_cast<U*>(var_d);
      std::memcpy(k_mean, old_mean, bytes);
      std::memcpy(var_copy, old_var, bytes);
      std::memcpy(k_b, offset, bytes);
      apply_mean = k_mean;
      apply_offset = k_b;
      var_src = var_copy;
    }
    std::memcpy(batch_mean, apply_mean, bytes);
    std::memcpy(rs1, apply_mean, bytes);
    std::memcpy(batch_var, var_src, bytes);
    std::memcpy(rs2, var_src, bytes);
    kernels::Apply(in.x.dtype, g, in.x.data, apply_mean, k_a, apply_offset, out.y.data);
  }
}

}  // namespace

Status FusedBatchNormOutputSpecs(OpVersion version, const FusedBatchNormInputs& inputs,
                                 const FusedBatchNormAttrs& attrs, TensorSpec specs[kMaxOpOutputs],
                                 int* num_outputs) noexcept {
  return ops::Guarded([&]() -> Status {
    Status s = ValidateForward(version, inputs, attrs);
    if (!s.ok()) return s;
    const DataType u = ops::StatsType(inputs.x.dtype);
    const Shape vec{ops::ChannelCount(inputs.x.shape, attrs.data_format)};
    specs[0] = {inputs.x.dtype, inputs.x.shape};
    for (int i = 1; i < 5; ++i) specs[i] = {u, vec};
    *num_outputs = 5;
    if (version == OpVersion::kV3) {
      specs[5] = {u, Shape{}};
      *num_outputs = 6;
    }
    return Status::Ok();
  });
}

namespace ops {

Status CheckForwardOutputs(OpVersion version, const FusedBatchNormInputs& in,
                           const FusedBatchNormAttrs& attrs, const FusedBatchNormOutputs& out,
                           TensorSpec specs[kMaxOpOutputs]) {
  int n = 0;
  Status s = FusedBatchNormOutputSpecs(version, in, attrs, specs, &n);
  if (!s.ok()) return s;
  const std::pair<const TensorView*, const char*> outs[] = {
      {&out.y, "y"},
      {&out.batch_mean, "batch_mean"},
      {&out.batch_variance, "batch_variance"},
      {&out.reserve_space_1, "reserve_space_1"},
      {&out.reserve_space_2, "reserve_space_2"},
      {&out.reserve_space_3, "reserve_space_3"}};
  for (int i = 0; i < n; ++i) {
    if (!(s = CheckOutput(*outs[i].first, specs[i], outs[i].second)).ok()) return s;
  }
  return Status::Ok();
}

}  // namespace ops

Status FusedBatchNorm(OpVersion version, const FusedBatchNormInputs& inputs,
                      const FusedBatchNormAttrs& attrs,
                      const FusedBatchNormOutputs& outputs) noexcept {
  return ops::Guarded([&]() -> Status {
    TensorSpec specs[kMaxOpOutputs];
    const Status s = ops::CheckForwardOutputs(version, inputs, attrs, outputs, specs);
    if (!s.ok()) return s;
    if (specs[1].dtype == DataType::kFloat64) {
      RunForward<double>(version, inputs, attrs, outputs);
    } else {
      RunForward<float>(version, inputs, attrs, outputs);
    }
    return Status::Ok();
  });
}

}  // namespace fbn
