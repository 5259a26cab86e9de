// libFuzzer harness: fbn::FusedBatchNormGrad (V1/V2/V3) and fbn::FusedBatchNormGradOutputSpecs
// with hostile versions, formats, dtypes, shapes, epsilons, null pointers and wrong output views.
// See fuzz_common.h for what every run checks.
#include <string>

#include "fuzz_common.h"

namespace {

using fbn::DataType;
using fbn::OpVersion;
using fbn::Status;
using fbn::TensorSpec;
using fbn_fuzz::SameResults;
using fbn_fuzz::Tensor;

constexpr unsigned char kCanaryA = 0xA5;
constexpr unsigned char kCanaryB = 0x5A;

bool ValidVersion(OpVersion v) { return static_cast<int>(v) >= 1 && static_cast<int>(v) <= 3; }

bool AllZero(const Tensor& t) {
  for (int64_t i = 0; i < t.info().elements; ++i) {
    if (fbn_fuzz::LoadAsDouble(t.data(), t.dtype(), i) != 0.0) return false;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider fdp(data, size);

  const int vpick = fdp.ConsumeIntegralInRange<int>(0, 15);
  const OpVersion version = vpick < 15 ? static_cast<OpVersion>(1 + vpick % 3)
                                       : static_cast<OpVersion>(fdp.ConsumeIntegral<int>());
  fbn::FusedBatchNormGradAttrs attrs;
  attrs.epsilon = fbn_fuzz::ConsumeAttrFloat(fdp, 1e-3f);
  const int fpick = fdp.ConsumeIntegralInRange<int>(0, 8);
  attrs.data_format =
      static_cast<fbn::TensorFormat>(fpick < 8 ? fpick % 4 : fdp.ConsumeIntegral<int>());
  attrs.is_training = fdp.ConsumeBool();
  const int format_code = static_cast<int>(attrs.data_format);
  const bool format_ok = format_code >= 0 && format_code <= (version == OpVersion::kV3 ? 3 : 1);

  const bool rank5 =
      format_code == 2 || format_code == 3 || fdp.ConsumeIntegralInRange<int>(0, 5) == 0;
  DataType t_preferred = static_cast<DataType>(fdp.ConsumeIntegralInRange<int>(0, 3));
  if (version == OpVersion::kV1 && fdp.ConsumeIntegralInRange<int>(0, 3) != 0) {
    t_preferred = fdp.ConsumeBool() ? DataType::kFloat32 : DataType::kFloat64;
  }
  int64_t dims[16];
  int rank = 0;
  fbn_fuzz::ConsumeShape(fdp, rank5 ? 5 : 4, dims, &rank);
  Tensor x(fbn_fuzz::ConsumeDtype(fdp, t_preferred), dims, rank);
  // y_backprop: x's shape most of the time.
  Tensor dy;
  if (fdp.ConsumeIntegralInRange<int>(0, 7) != 0) {
    dy.Reset(fbn_fuzz::ConsumeDtype(fdp, t_preferred), dims, rank);
  } else {
    int64_t ddims[16];
    int drank = 0;
    fbn_fuzz::ConsumeShape(fdp, rank5 ? 5 : 4, ddims, &drank);
    dy.Reset(fbn_fuzz::ConsumeDtype(fdp, t_preferred), ddims, drank);
  }
  int64_t channels = 1;
  if (rank >= 2 && rank <= 8) {
    const bool last = format_code == 0 || format_code == 2;
    channels = last ? dims[rank - 1] : dims[1];
  }
  const DataType t = dy.dtype();
  const DataType u_preferred =
      version == OpVersion::kV1 || !fbn_fuzz::ValidDtypeCode(t)
          ? t
          : (t == DataType::kFloat64 ? DataType::kFloat64 : DataType::kFloat32);
  Tensor vec[4];  // scale, reserve_space_1, reserve_space_2, reserve_space_3
  for (int i = 0; i < 3; ++i) {
    fbn_fuzz::ConsumeVectorShape(fdp, channels, dims, &rank);
    vec[i].Reset(fbn_fuzz::ConsumeDtype(fdp, u_preferred), dims, rank);
  }
  // reserve_space_3 is never read: any shape (often [0], as TensorFlow's CPU op leaves it).
  fbn_fuzz::ConsumeShape(fdp, 1, dims, &rank);
  if (fdp.ConsumeBool()) {
    rank = 1;
    dims[0] = 0;
  }
  vec[3].Reset(fbn_fuzz::ConsumeDtype(fdp, u_preferred), dims, rank);
  if (fdp.ConsumeIntegralInRange<int>(0, 15) == 0) {
    const int which = fdp.ConsumeIntegralInRange<int>(0, 4);
    (which == 0 ? x : which == 1 ? dy : vec[which - 2]).set_null_data(true);
  }
  const int output_mode = fdp.ConsumeIntegralInRange<int>(0, 15);
  const int output_pick = fdp.ConsumeIntegralInRange<int>(0, 4);
  const int threads1 = fdp.ConsumeIntegralInRange<int>(1, 4);
  const int threads2 = threads1 == 1 ? fdp.ConsumeIntegralInRange<int>(2, 4) : 1;
  const std::vector<uint8_t> pattern = fdp.ConsumeRemainingBytes<uint8_t>();
  x.Fill(pattern);
  dy.Fill(std::vector<uint8_t>(pattern.rbegin(), pattern.rend()));
  for (Tensor& v : vec) v.Fill(pattern);

  const fbn::FusedBatchNormGradInputs in{dy.cview(),     x.cview(),      vec[0].cview(),
                                         vec[1].cview(), vec[2].cview(), vec[3].cview()};
  TensorSpec specs[fbn::kMaxOpOutputs];
  int num_outputs = -1;
  const Status spec_status =
      fbn::FusedBatchNormGradOutputSpecs(version, in, attrs, specs, &num_outputs);

  bool must_reject = !format_ok;
  for (const Tensor* v : {&dy, &x}) {
    must_reject = must_reject || v->must_reject() || v->null_with_elements() ||
                  (v->shape().rank() != 4 && v->shape().rank() != 5);
  }
  for (int i = 0; i < 3; ++i) {
    must_reject = must_reject || vec[i].must_reject() || vec[i].null_with_elements() ||
                  vec[i].shape().rank() != 1;
  }
  if (version == OpVersion::kV3) {
    must_reject = must_reject || vec[3].must_reject();
  }
  must_reject = must_reject || dy.shape() != x.shape();
  if (!ValidVersion(version)) {
    // An invalid version is rejected first, naming the argument.
    FBN_FUZZ_CHECK(
        !spec_status.ok() && spec_status.code() == fbn::StatusCode::kInvalidArgument &&
            spec_status.message().find("FusedBatchNormGrad: argument version must be") == 0,
        "invalid version " + std::to_string(static_cast<int>(version)) + ": " +
            spec_status.ToString());
  }
  if (must_reject) {
    FBN_FUZZ_CHECK(!spec_status.ok(), "accepted: x " + fbn_fuzz::ShapeText(x) + " dy " +
                                          fbn_fuzz::ShapeText(dy) + " format " +
                                          std::to_string(format_code));
  }

  Tensor out[5];
  if (spec_status.ok()) {
    FBN_FUZZ_CHECK(num_outputs == 5, std::to_string(num_outputs));
    FBN_FUZZ_CHECK(specs[0].dtype == x.dtype() && specs[0].shape == x.shape(), "x_backprop spec");
    for (int i = 1; i < 3; ++i) {
      FBN_FUZZ_CHECK(specs[i].shape.rank() == 1 && specs[i].shape.dim(0) == channels,
                     "vector spec");
    }
    for (int i = 3; i < 5; ++i) {
      FBN_FUZZ_CHECK(specs[i].shape == fbn::Shape{0}, "placeholder spec must be [0]");
    }
    for (int i = 0; i < 5; ++i) {
      out[i].Reset(specs[i].dtype, specs[i].shape.dims(), specs[i].shape.rank());
    }
  } else {
    const int64_t c1[1] = {channels < 0 ? 0 : channels};
    const int64_t zero[1] = {0};
    out[0].Reset(x.dtype(), x.shape().dims(), x.shape().rank());
    for (int i = 1; i < 3; ++i) out[i].Reset(u_preferred, c1, 1);
    for (int i = 3; i < 5; ++i) out[i].Reset(u_preferred, zero, 1);
  }

  bool expect_ok = spec_status.ok();
  if (expect_ok && output_mode >= 12 && output_mode <= 14) {
    const int i = output_pick % num_outputs;
    Tensor& o = out[i];
    if (output_mode == 12) {
      const DataType other =
          o.dtype() == DataType::kFloat32 ? DataType::kBFloat16 : DataType::kFloat32;
      o.Reset(other, specs[i].shape.dims(), specs[i].shape.rank());
      expect_ok = false;
    } else if (output_mode == 13) {
      int64_t d[fbn::Shape::kMaxRank + 1];
      const int r = specs[i].shape.rank();
      for (int k = 0; k < r; ++k) d[k] = specs[i].shape.dim(k);
      d[r] = 1;
      o.Reset(specs[i].dtype, d, r + 1);
      expect_ok = false;
    } else if (o.info().elements > 0) {
      o.set_null_data(true);
      expect_ok = false;
    }
  }

  bool runnable = true;
  for (const Tensor* v : {&dy, &x, &vec[0], &vec[1], &vec[2], &out[0], &out[1], &out[2]}) {
    runnable = runnable && !v->too_big();
  }
  if (!runnable && spec_status.ok()) return 0;

  const std::vector<unsigned char> snapshots[5] = {dy.Snapshot(), x.Snapshot(), vec[0].Snapshot(),
                                                   vec[1].Snapshot(), vec[2].Snapshot()};
  auto run = [&](Tensor* o, unsigned char canary, int threads) {
    for (int i = 0; i < 5; ++i) o[i].FillByte(canary);
    fbn_fuzz::UseThreads(threads);
    const fbn::FusedBatchNormGradOutputs outputs{o[0].view(), o[1].view(), o[2].view(), o[3].view(),
                                                 o[4].view()};
    return fbn::FusedBatchNormGrad(version, in, attrs, outputs);
  };
  const Status s1 = run(out, kCanaryA, threads1);
  const Tensor* inputs[5] = {&dy, &x, &vec[0], &vec[1], &vec[2]};
  for (int i = 0; i < 5; ++i) {
    FBN_FUZZ_CHECK(inputs[i]->Equals(snapshots[i]), "FusedBatchNormGrad wrote an input");
  }
  if (!spec_status.ok()) {
    FBN_FUZZ_CHECK(
        !s1.ok() && s1.code() == spec_status.code() && s1.message() == spec_status.message(),
        "op: " + s1.ToString() + " spec: " + spec_status.ToString());
  }
  if (!expect_ok) {
    FBN_FUZZ_CHECK(!s1.ok(), "accepted a wrong output view, mode " + std::to_string(output_mode));
    for (int i = 0; i < 5; ++i) {
      FBN_FUZZ_CHECK(out[i].AllBytesAre(kCanaryA), "failed op wrote output " + std::to_string(i));
    }
    return 0;
  }
  FBN_FUZZ_CHECK(s1.ok(), s1.ToString());
  if (x.info().elements == 0) {
    FBN_FUZZ_CHECK(AllZero(out[1]) && AllZero(out[2]), "empty x must give zero scale/offset grads");
  }

  Tensor again[5];
  for (int i = 0; i < 5; ++i) {
    again[i].Reset(out[i].dtype(), out[i].shape().dims(), out[i].shape().rank());
  }
  const Status s2 = run(again, kCanaryB, threads2);
  FBN_FUZZ_CHECK(s2.ok(), s2.ToString());
  for (int i = 0; i < 3; ++i) {
    FBN_FUZZ_CHECK(SameResults(out[i], again[i]),
                   "output " + std::to_string(i) + " differs between runs (threads " +
                       std::to_string(threads1) + " vs " + std::to_string(threads2) +
                       ") or was not fully written");
  }
  return 0;
}
