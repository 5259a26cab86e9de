// libFuzzer harness: fbn::FusedBatchNorm (V1/V2/V3), fbn::FusedBatchNormOutputSpecs and
// fbn::ParseDataFormat with hostile versions, formats, dtypes, shapes, attributes, null pointers,
// wrong output views and aliased outputs. See fuzz_common.h for what every run checks.
#include <cmath>
#include <string>

#include "fuzz_common.h"

namespace {

using fbn::DataType;
using fbn::OpVersion;
using fbn::Status;
using fbn::TensorSpec;
using fbn_fuzz::SameBytes;
using fbn_fuzz::SameResults;
using fbn_fuzz::Tensor;

constexpr unsigned char kCanaryA = 0xA5;
constexpr unsigned char kCanaryB = 0x5A;

bool ValidVersion(OpVersion v) { return static_cast<int>(v) >= 1 && static_cast<int>(v) <= 3; }

// Checks that every element of a float/double vector output is NaN.
bool AllNaN(const Tensor& t) {
  const int64_t n = t.info().elements;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isnan(fbn_fuzz::LoadAsDouble(t.data(), t.dtype(), i))) return false;
  }
  return true;
}

void CheckParseDataFormat(FuzzedDataProvider& fdp, OpVersion version) {
  static const char* const kNames[] = {"NHWC",  "NCHW", "NDHWC",   "NCDHW", "nhwc",
                                       "NHWC ", "",     "NCHW\0x", "HWNC",  "NDHWCX"};
  std::string text = fdp.ConsumeBool() ? std::string(fdp.PickValueInArray(kNames))
                                       : fdp.ConsumeRandomLengthString(12);
  fbn::TensorFormat format = static_cast<fbn::TensorFormat>(-7);
  const Status s = fbn::ParseDataFormat(text, version, &format);
  if (!ValidVersion(version)) {
    FBN_FUZZ_CHECK(!s.ok() && s.message().find("ParseDataFormat: argument version must be") == 0,
                   "ParseDataFormat with version " + std::to_string(static_cast<int>(version)) +
                       ": " + s.ToString());
  }
  if (s.ok()) {
    FBN_FUZZ_CHECK(text == fbn::TensorFormatName(format), "ParseDataFormat accepted " + text);
    FBN_FUZZ_CHECK(static_cast<int>(version) == 3 || static_cast<int>(format) <= 1,
                   "a 3-D format accepted by a V1/V2 op: " + text);
  } else {
    FBN_FUZZ_CHECK(static_cast<int>(format) == -7, "ParseDataFormat wrote on failure");
    FBN_FUZZ_CHECK(s.code() == fbn::StatusCode::kInvalidArgument, s.ToString());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider fdp(data, size);

  // Version: mostly 1-3, sometimes any int.
  const int vpick = fdp.ConsumeIntegralInRange<int>(0, 15);
  const OpVersion version = vpick < 15 ? static_cast<OpVersion>(1 + vpick % 3)
                                       : static_cast<OpVersion>(fdp.ConsumeIntegral<int>());
  CheckParseDataFormat(fdp, version);

  fbn::FusedBatchNormAttrs attrs;
  attrs.epsilon = fbn_fuzz::ConsumeAttrFloat(fdp, 1e-3f);
  attrs.exponential_avg_factor = fbn_fuzz::ConsumeAttrFloat(fdp, 1.0f);
  const int fpick = fdp.ConsumeIntegralInRange<int>(0, 8);
  attrs.data_format =
      static_cast<fbn::TensorFormat>(fpick < 8 ? fpick % 4 : fdp.ConsumeIntegral<int>());
  attrs.is_training = fdp.ConsumeBool();
  const int format_code = static_cast<int>(attrs.data_format);
  const bool format_ok = format_code >= 0 && format_code <= (version == OpVersion::kV3 ? 3 : 1);

  // x, then the per-channel tensors.
  const bool rank5 =
      format_code == 2 || format_code == 3 || fdp.ConsumeIntegralInRange<int>(0, 5) == 0;
  DataType x_type_preferred = static_cast<DataType>(fdp.ConsumeIntegralInRange<int>(0, 3));
  if (version == OpVersion::kV1 && fdp.ConsumeIntegralInRange<int>(0, 3) != 0) {
    x_type_preferred = fdp.ConsumeBool() ? DataType::kFloat32 : DataType::kFloat64;
  }
  const DataType x_type = fbn_fuzz::ConsumeDtype(fdp, x_type_preferred);
  int64_t dims[16];
  int rank = 0;
  fbn_fuzz::ConsumeShape(fdp, rank5 ? 5 : 4, dims, &rank);
  Tensor x(x_type, dims, rank);
  int64_t channels = 1;
  if (rank >= 2 && rank <= 8) {
    const bool last = format_code == 0 || format_code == 2;
    channels = last ? dims[rank - 1] : dims[1];
  }
  const DataType u_preferred =
      version == OpVersion::kV1 || !fbn_fuzz::ValidDtypeCode(x_type)
          ? x_type
          : (x_type == DataType::kFloat64 ? DataType::kFloat64 : DataType::kFloat32);
  Tensor vec[4];  // scale, offset, mean, variance
  for (int i = 0; i < 4; ++i) {
    fbn_fuzz::ConsumeVectorShape(fdp, channels, dims, &rank);
    // Training with factor 1 does not read mean/variance: TensorFlow passes empty ones.
    if (i >= 2 && attrs.is_training && fdp.ConsumeIntegralInRange<int>(0, 3) == 0) {
      rank = 1;
      dims[0] = 0;
    }
    vec[i].Reset(fbn_fuzz::ConsumeDtype(fdp, u_preferred), dims, rank);
  }
  // Occasionally a null data pointer.
  if (fdp.ConsumeIntegralInRange<int>(0, 15) == 0) {
    const int which = fdp.ConsumeIntegralInRange<int>(0, 4);
    (which == 0 ? x : vec[which - 1]).set_null_data(true);
  }
  const int output_mode = fdp.ConsumeIntegralInRange<int>(0, 15);
  const int output_pick = fdp.ConsumeIntegralInRange<int>(0, 5);
  const int threads1 = fdp.ConsumeIntegralInRange<int>(1, 4);
  const int threads2 = threads1 == 1 ? fdp.ConsumeIntegralInRange<int>(2, 4) : 1;
  const std::vector<uint8_t> pattern = fdp.ConsumeRemainingBytes<uint8_t>();
  x.Fill(pattern);
  for (Tensor& t : vec) t.Fill(pattern);

  const fbn::FusedBatchNormInputs in{x.cview(), vec[0].cview(), vec[1].cview(), vec[2].cview(),
                                     vec[3].cview()};
  TensorSpec specs[fbn::kMaxOpOutputs];
  int num_outputs = -1;
  const Status spec_status =
      fbn::FusedBatchNormOutputSpecs(version, in, attrs, specs, &num_outputs);

  // What the harness knows must be rejected, independently of fbn.
  bool must_reject = !format_ok || x.must_reject() || x.null_with_elements() ||
                     (x.shape().rank() != 4 && x.shape().rank() != 5);
  for (const Tensor& t : vec) {
    must_reject = must_reject || t.must_reject() || t.null_with_elements() || t.shape().rank() != 1;
  }
  if (!ValidVersion(version)) {
    // An invalid version is rejected first, naming the argument.
    FBN_FUZZ_CHECK(!spec_status.ok() && spec_status.code() == fbn::StatusCode::kInvalidArgument &&
                       spec_status.message().find("FusedBatchNorm: argument version must be") == 0,
                   "invalid version " + std::to_string(static_cast<int>(version)) + ": " +
                       spec_status.ToString());
  }
  if (must_reject) {
    FBN_FUZZ_CHECK(!spec_status.ok(), "accepted: x " + fbn_fuzz::ShapeText(x) + " format " +
                                          std::to_string(format_code));
  }

  // Outputs: the spec's when there is one, else a plausible guess (the op must fail anyway).
  Tensor out[6];
  if (spec_status.ok()) {
    FBN_FUZZ_CHECK(num_outputs == (version == OpVersion::kV3 ? 6 : 5), std::to_string(num_outputs));
    FBN_FUZZ_CHECK(specs[0].dtype == x.dtype() && specs[0].shape == x.shape(), "y spec");
    for (int i = 1; i < 5; ++i) {
      FBN_FUZZ_CHECK(specs[i].shape.rank() == 1 && specs[i].shape.dim(0) == channels,
                     "vector spec");
    }
    for (int i = 0; i < num_outputs; ++i) {
      FBN_FUZZ_CHECK(specs[i].shape.Validate("spec").ok(), "invalid spec shape");
      out[i].Reset(specs[i].dtype, specs[i].shape.dims(), specs[i].shape.rank());
    }
    // V1/V2 ignore reserve_space_3 entirely: give it a garbage view.
    if (num_outputs == 5) {
      const int64_t junk[1] = {-5};
      out[5].Reset(static_cast<DataType>(99), junk, 1);
    }
  } else {
    FBN_FUZZ_CHECK(spec_status.code() != fbn::StatusCode::kOk, "error status without a code");
    const int64_t c1[1] = {channels < 0 ? 0 : channels};
    out[0].Reset(x.dtype(), x.shape().dims(), x.shape().rank());
    for (int i = 1; i < 5; ++i) out[i].Reset(u_preferred, c1, 1);
    out[5].Reset(u_preferred, c1, 0);
  }

  bool expect_ok = spec_status.ok();
  if (expect_ok && output_mode >= 12 && output_mode <= 14) {
    // A wrong output view: dtype, shape or null data.
    const int i = output_pick % num_outputs;
    Tensor& o = out[i];
    if (output_mode == 12) {
      const DataType other =
          o.dtype() == DataType::kFloat32 ? DataType::kFloat16 : DataType::kFloat32;
      o.Reset(other, specs[i].shape.dims(), specs[i].shape.rank());
      expect_ok = false;
    } else if (output_mode == 13) {
      int64_t d[fbn::Shape::kMaxRank + 1];
      const int r = specs[i].shape.rank();
      for (int k = 0; k < r; ++k) d[k] = specs[i].shape.dim(k);
      d[r] = 1;  // one extra trailing dim of 1: same element count, different shape
      o.Reset(specs[i].dtype, d, r + 1);
      expect_ok = false;
    } else if (o.info().elements > 0) {
      o.set_null_data(true);
      expect_ok = false;
    }
  }

  bool runnable = true;
  for (const Tensor* t : {&x, &vec[0], &vec[1], &vec[2], &vec[3], &out[0], &out[1], &out[2],
                          &out[3], &out[4], &out[5]}) {
    runnable = runnable && !t->too_big();
  }
  // A call that fails validation must fail without reading anything, so it runs even then.
  if (!runnable && spec_status.ok()) return 0;

  std::vector<unsigned char> input_snapshots[5] = {
      x.Snapshot(), vec[0].Snapshot(), vec[1].Snapshot(), vec[2].Snapshot(), vec[3].Snapshot()};
  auto run = [&](Tensor* o, unsigned char canary, int threads) {
    for (int i = 0; i < 6; ++i) o[i].FillByte(canary);
    fbn_fuzz::UseThreads(threads);
    const fbn::FusedBatchNormOutputs outputs{o[0].view(), o[1].view(), o[2].view(),
                                             o[3].view(), o[4].view(), o[5].view()};
    return fbn::FusedBatchNorm(version, in, attrs, outputs);
  };
  const Status s1 = run(out, kCanaryA, threads1);
  FBN_FUZZ_CHECK(x.Equals(input_snapshots[0]), "FusedBatchNorm wrote x");
  for (int i = 0; i < 4; ++i) {
    FBN_FUZZ_CHECK(vec[i].Equals(input_snapshots[i + 1]), "FusedBatchNorm wrote an input");
  }
  if (!spec_status.ok()) {
    FBN_FUZZ_CHECK(
        !s1.ok() && s1.code() == spec_status.code() && s1.message() == spec_status.message(),
        "op: " + s1.ToString() + " spec: " + spec_status.ToString());
  }
  if (!expect_ok) {
    FBN_FUZZ_CHECK(!s1.ok(), "accepted a wrong output view, mode " + std::to_string(output_mode));
    for (int i = 0; i < 6; ++i) {
      FBN_FUZZ_CHECK(out[i].AllBytesAre(kCanaryA), "failed op wrote output " + std::to_string(i));
    }
    return 0;
  }
  FBN_FUZZ_CHECK(s1.ok(), s1.ToString());

  // Invariants of a successful run.
  const bool empty = x.info().elements == 0;
  if (empty) {
    FBN_FUZZ_CHECK(AllNaN(out[1]) && AllNaN(out[2]), "empty x must give NaN statistics");
  } else if (!attrs.is_training) {
    FBN_FUZZ_CHECK(SameBytes(out[1], vec[2]) && SameBytes(out[2], vec[3]),
                   "inference must echo mean and variance");
  } else if (attrs.exponential_avg_factor == 1.0f) {
    FBN_FUZZ_CHECK(SameBytes(out[1], out[3]), "batch_mean != reserve_space_1");
  }
  if (version == OpVersion::kV3) {
    FBN_FUZZ_CHECK(fbn_fuzz::LoadAsDouble(out[5].data(), out[5].dtype(), 0) == 0.0,
                   "reserve_space_3 must hold 0");
  }

  // Second run: another canary and thread count; every byte must come out the same.
  Tensor again[6];
  for (int i = 0; i < 6; ++i) {
    again[i].Reset(out[i].dtype(), out[i].shape().dims(), out[i].shape().rank());
  }
  const Status s2 = run(again, kCanaryB, threads2);
  FBN_FUZZ_CHECK(s2.ok(), s2.ToString());
  for (int i = 0; i < num_outputs; ++i) {
    FBN_FUZZ_CHECK(SameResults(out[i], again[i]),
                   "output " + std::to_string(i) + " differs between runs (threads " +
                       std::to_string(threads1) + " vs " + std::to_string(threads2) +
                       ") or was not fully written");
  }

  // Outputs aliasing the mean/variance inputs (the running statistics updated in place).
  if (output_mode == 15 && vec[2].shape() == specs[1].shape && vec[2].dtype() == specs[1].dtype &&
      vec[3].shape() == specs[2].shape && vec[3].dtype() == specs[2].dtype) {
    Tensor mean_io(vec[2].dtype(), vec[2].shape().dims(), 1);
    Tensor var_io(vec[3].dtype(), vec[3].shape().dims(), 1);
    if (vec[2].bytes()) std::memcpy(mean_io.data(), vec[2].data(), vec[2].bytes());
    if (vec[3].bytes()) std::memcpy(var_io.data(), vec[3].data(), vec[3].bytes());
    const fbn::FusedBatchNormInputs aliased_in{x.cview(), vec[0].cview(), vec[1].cview(),
                                               mean_io.cview(), var_io.cview()};
    for (int i = 0; i < 6; ++i) again[i].FillByte(kCanaryB);
    const fbn::FusedBatchNormOutputs aliased_out{again[0].view(), mean_io.view(),  var_io.view(),
                                                 again[3].view(), again[4].view(), again[5].view()};
    const Status s3 = fbn::FusedBatchNorm(version, aliased_in, attrs, aliased_out);
    FBN_FUZZ_CHECK(s3.ok(), s3.ToString());
    FBN_FUZZ_CHECK(SameResults(out[0], again[0]), "aliased run: y differs");
    FBN_FUZZ_CHECK(SameResults(out[1], mean_io), "aliased run: batch_mean differs");
    FBN_FUZZ_CHECK(SameResults(out[2], var_io), "aliased run: batch_variance differs");
    FBN_FUZZ_CHECK(SameResults(out[3], again[3]) && SameResults(out[4], again[4]),
                   "aliased run: reserve spaces differ");
  }
  return 0;
}
