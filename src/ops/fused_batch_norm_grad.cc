// FusedBatchNormGrad / V2 / V3: validation in TensorFlow's order, then the kernels.
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "fbn/ops.h"
#include "kernels/batch_norm_kernels.h"
#include "kernels/channel_math.h"
#include "ops/op_common.h"
#include "ops/validation.h"

namespace fbn {
namespace {

Status ValidateGrad(OpVersion version, const FusedBatchNormGradInputs& in,
                    const FusedBatchNormGradAttrs& attrs) {
  Status s = ops::CheckVersion("FusedBatchNormGrad", version);
  if (!s.ok()) return s;
  const char* op = FusedBatchNormGradOpName(version);
  const DataType t = in.y_backprop.dtype;
  // Registration: y_backprop and x share T; scale is T for V1 and float (double with double x)
  // after; the reserve spaces are U.
  s = ops::CheckOpTypes(op, version, t, {}, 0);
  if (!s.ok()) return s;
  if (!(s = ops::CheckInputType(op, 1, in.x.dtype, t)).ok()) return s;
  const DataType u = version == OpVersion::kV1 ? t : ops::StatsType(t);
  if (!(s = ops::CheckInputType(op, 2, in.scale.dtype, u)).ok()) return s;
  if (version == OpVersion::kV1) {
    if (!(s = ops::CheckInputType(op, 3, in.reserve_space_1.dtype, t)).ok()) return s;
    if (!(s = ops::CheckInputType(op, 4, in.reserve_space_2.dtype, t)).ok()) return s;
  } else {
    if (in.reserve_space_1.dtype != u) {
      return ops::AttrTypeError("U", in.reserve_space_1.dtype,
                                u == DataType::kFloat64 ? "double" : "float");
    }
    if (!(s = ops::CheckInputType(op, 4, in.reserve_space_2.dtype, u)).ok()) return s;
    if (version == OpVersion::kV3) {
      if (!(s = ops::CheckInputType(op, 5, in.reserve_space_3.dtype, u)).ok()) return s;
    }
  }
  if (!(s = ops::CheckFormat(attrs.data_format, version)).ok()) return s;
  const std::pair<const ConstTensorView*, const char*> tensors[] = {
      {&in.y_backprop, "y_backprop"},
      {&in.x, "x"},
      {&in.scale, "scale"},
      {&in.reserve_space_1, "reserve_space_1"},
      {&in.reserve_space_2, "reserve_space_2"}};
  for (const auto& [tensor, name] : tensors) {
    if (!(s = ops::CheckTensor(*tensor, name)).ok()) return s;
  }
  // reserve_space_3 is never read; only its shape must be sane.
  if (version == OpVersion::kV3) {
    if (!(s = in.reserve_space_3.shape.Validate("reserve_space_3")).ok()) return s;
  }

  // The kernel's checks, in its order and with its texts.
  for (const ConstTensorView* v : {&in.y_backprop, &in.x}) {
    const int rank = v->shape.rank();
    if (rank != 4 && rank != 5) {
      return InvalidArgument("input must be 4 or 5-dimensional" + v->shape.DebugString());
    }
  }
  if (in.scale.shape.rank() != 1) {
    return InvalidArgument("scale must be 1-dimensional" + in.scale.shape.DebugString());
  }
  if (in.reserve_space_1.shape.rank() != 1) {
    return InvalidArgument("saved mean must be 1-dimensional" +
                           in.reserve_space_1.shape.DebugString());
  }
  if (in.reserve_space_2.shape.rank() != 1) {
    return InvalidArgument("saved variance must be 1-dimensional" +
                           in.reserve_space_2.shape.DebugString());
  }
  if (in.x.shape != in.y_backprop.shape) {
    return InvalidArgument("x and y_backprop must have same shape, but x has shape " +
                           in.x.shape.DebugString() + " and y_backprop has shape " +
                           in.y_backprop.shape.DebugString());
  }
  const int64_t C = ops::ChannelCount(in.x.shape, attrs.data_format);
  auto count_error = [&](const char* what, int64_t got) {
    return InvalidArgument(std::string(what) +
                           " must have the same number of elements as the channels of x, got " +
                           std::to_string(got) + " and " + std::to_string(C));
  };
  if (in.scale.shape.num_elements() != C)
    return count_error("scale", in.scale.shape.num_elements());
  if (in.reserve_space_1.shape.num_elements() != C) {
    return count_error("reserve_space_1", in.reserve_space_1.shape.num_elements());
  }
  if (in.reserve_space_2.shape.num_elements() != C) {
    return count_error("reserve_space_2", in.reserve_space_2.shape.num_elements());
  }
  return Status::Ok();
}

template <typename U>
void RunGrad(const FusedBatchNormGradInputs& in, const FusedBatchNormGradAttrs& attrs,
             const FusedBatchNormGradOutputs& out) {
  const kernels::Geometry g = ops::MakeGeometry(in.x.shape, attrs.data_format);
  const size_t uc = static_cast<size_t>(g.c);
  const U* scale = static_cast<const U*>(in.scale.data);
  const U* mean = static_cast<const U*>(in.reserve_space_1.data);
  const U* var = static_cast<const U*>(in.reserve_space_2.data);
  U* scale_bp = static_cast<U*>(out.scale_backprop.data);
  U* offset_bp = static_cast<U*>(out.offset_backprop.data);
  if (g.elements() == 0) {
    for (size_t c = 0; c < uc; ++c) scale_bp[c] = offset_bp[c] = U(0);
    return;
  }
  // Scratch: sums (2·C doubles), inverse std (C doubles), kernel arrays (4·C of U).
  thread_local std::vector<double> scratch;
  if (scratch.size() < 7 * uc) scratch.resize(7 * uc);
  double* sum_dy = scratch.data();
  double* sum_dy_xc = sum_dy + uc;
  double* inv = sum_dy_xc + uc;
  U* k_mean = reinterpret_cast<U*>(inv + uc);
  U* k1 = k_mean + uc;
  U* k2 = k1 + uc;
  U* k0 = k2 + uc;
  const double eps = static_cast<double>(attrs.epsilon);
  const bool wide = std::is_same_v<U, double>;
  // Run by the kernel in the tasks that own the channels where it can (see kernels::ChannelStep).
  auto prepare = [&](int64_t c0, int64_t c1) {
    kernels::InverseStd(wide, c1 - c0, var + c0, scale + c0, eps, inv + c0, k1 + c0);
    std::memcpy(k_mean + c0, mean + c0, static_cast<size_t>(c1 - c0) * sizeof(U));
  };
  auto outputs = [&](int64_t c0, int64_t c1) {
    kernels::GradientOutputs(wide, c1 - c0, sum_dy + c0, sum_dy_xc + c0, inv + c0, offset_bp + c0,
                             scale_bp + c0);
  };
  if (attrs.is_training) {
    kernels::BackwardTraining(in.x.dtype, g, in.y_backprop.data, in.x.data, k_mean, inv, k1, k2, k0,
                              sum_dy, sum_dy_xc, out.x_backprop.data, kernels::StepFor(prepare),
                              kernels::StepFor(outputs));
  } else {
    kernels::FrozenBackward(in.x.dtype, g, in.y_backprop.data, in.x.data, k_mean, k1,
                            out.x_backprop.data, sum_dy, sum_dy_xc, kernels::StepFor(prepare),
                            kernels::StepFor(outputs));
  }
}

}  // namespace

Status FusedBatchNormGradOutputSpecs(OpVersion version, const FusedBatchNormGradInputs& inputs,
                                     const FusedBatchNormGradAttrs& attrs,
                                     TensorSpec specs[kMaxOpOutputs], int* num_outputs) noexcept {
  return ops::Guarded([&]() -> Status {
    Status s = ValidateGrad(version, inputs, attrs);
    if (!s.ok()) return s;
    const DataType u = inputs.scale.dtype;
    const Shape vec{ops::ChannelCount(inputs.x.shape, attrs.data_format)};
    specs[0] = {inputs.x.dtype, inputs.x.shape};
    specs[1] = specs[2] = {u, vec};
    specs[3] = specs[4] = {u, Shape{0}};
    *num_outputs = 5;
    return Status::Ok();
  });
}

namespace ops {

Status CheckGradOutputs(OpVersion version, const FusedBatchNormGradInputs& in,
                        const FusedBatchNormGradAttrs& attrs, const FusedBatchNormGradOutputs& out,
                        TensorSpec specs[kMaxOpOutputs]) {
  int n = 0;
  Status s = FusedBatchNormGradOutputSpecs(version, in, attrs, specs, &n);
  if (!s.ok()) return s;
  const bool v3 = version == OpVersion::kV3;
  const std::pair<const TensorView*, const char*> outs[] = {
      {&out.x_backprop, "x_backprop"},
      {&out.scale_backprop, "scale_backprop"},
      {&out.offset_backprop, "offset_backprop"},
      {&out.reserve_space_a, v3 ? "reserve_space_4" : "reserve_space_3"},
      {&out.reserve_space_b, v3 ? "reserve_space_5" : "reserve_space_4"}};
  for (int i = 0; i < n; ++i) {
    if (!(s = CheckOutput(*outs[i].first, specs[i], outs[i].second)).ok()) return s;
  }
  return Status::Ok();
}

}  // namespace ops

Status FusedBatchNormGrad(OpVersion version, const FusedBatchNormGradInputs& inputs,
                          const FusedBatchNormGradAttrs& attrs,
                          const FusedBatchNormGradOutputs& outputs) noexcept {
  return ops::Guarded([&]() -> Status {
    TensorSpec specs[kMaxOpOutputs];
    const Status s = ops::CheckGradOutputs(version, inputs, attrs, outputs, specs);
    if (!s.ok()) return s;
    if (specs[1].dtype == DataType::kFloat64) {
      RunGrad<double>(inputs, attrs, outputs);
    } else {
      RunGrad<float>(inputs, attrs, outputs);
    }
    return Status::Ok();
  });
}

}  // namespace fbn
