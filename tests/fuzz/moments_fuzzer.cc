// libFuzzer harness: fbn::Moments and fbn::MomentsOutputSpec with hostile shapes (any rank,
// negative, zero and huge dims), axes (out of range, duplicated, INT_MIN, a null array, a negative
// count), dtypes and wrong output views; small finite inputs are also checked against a float64
// reference. See fuzz_common.h for what every run checks.
#include <algorithm>
#include <climits>
#include <cmath>
#include <string>

#include "fuzz_common.h"

namespace {

using fbn::DataType;
using fbn::Status;
using fbn::TensorSpec;
using fbn_fuzz::SameResults;
using fbn_fuzz::Tensor;

constexpr unsigned char kCanaryA = 0xA5;
constexpr unsigned char kCanaryB = 0x5A;

// True when `got` is what a float64 computation rounded to `t` can give for `want`.
bool Close(double got, double want, DataType t, double scale) {
  if (std::isnan(want)) return std::isnan(got);
  if (std::fabs(want) > fbn_fuzz::MaxFinite(t)) return true;  // may round to Inf
  return std::fabs(got - want) <= fbn_fuzz::Tolerance(t) * scale + fbn_fuzz::SubnormalStep(t);
}

// Mean and biased variance of x over the reduced axes, in float64.
void Reference(const Tensor& x, const bool reduced[], std::vector<double>* mean,
               std::vector<double>* var) {
  const int rank = x.shape().rank();
  int64_t out_size = 1;
  for (int i = 0; i < rank; ++i) {
    if (!reduced[i]) out_size *= x.shape().dim(i);
  }
  mean->assign(static_cast<size_t>(out_size), 0.0);
  var->assign(static_cast<size_t>(out_size), 0.0);
  std::vector<int64_t> count(static_cast<size_t>(out_size), 0);
  std::vector<int64_t> out_index(static_cast<size_t>(x.info().elements));
  for (int64_t e = 0; e < x.info().elements; ++e) {
    int64_t rest = e, o = 0, ostride = 1;
    for (int i = rank - 1; i >= 0; --i) {
      const int64_t d = x.shape().dim(i);
      const int64_t idx = rest % d;
      rest /= d;
      if (!reduced[i]) {
        o += idx * ostride;
        ostride *= d;
      }
    }
    out_index[static_cast<size_t>(e)] = o;
    (*mean)[static_cast<size_t>(o)] += fbn_fuzz::LoadAsDouble(x.data(), x.dtype(), e);
    ++count[static_cast<size_t>(o)];
  }
  for (size_t o = 0; o < mean->size(); ++o) (*mean)[o] /= static_cast<double>(count[o]);
  for (int64_t e = 0; e < x.info().elements; ++e) {
    const size_t o = static_cast<size_t>(out_index[static_cast<size_t>(e)]);
    const double d = fbn_fuzz::LoadAsDouble(x.data(), x.dtype(), e) - (*mean)[o];
    (*var)[o] += d * d;
  }
  for (size_t o = 0; o < var->size(); ++o) (*var)[o] /= static_cast<double>(count[o]);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider fdp(data, size);
  int64_t dims[16];
  int rank = 0;
  fbn_fuzz::ConsumeShape(fdp, fdp.ConsumeIntegralInRange<int>(0, 6), dims, &rank);
  const DataType x_type =
      fbn_fuzz::ConsumeDtype(fdp, static_cast<DataType>(fdp.ConsumeIntegralInRange<int>(0, 3)));
  Tensor x(x_type, dims, rank);
  if (fdp.ConsumeIntegralInRange<int>(0, 15) == 0) x.set_null_data(true);

  // Axes: mostly in [-rank, rank), sometimes anything.
  const int count_pick = fdp.ConsumeIntegralInRange<int>(0, 15);
  const int num_axes = count_pick < 14 ? fdp.ConsumeIntegralInRange<int>(0, std::max(rank, 0) + 1)
                                       : fdp.ConsumeIntegralInRange<int>(-3, 12);
  std::vector<int> axes(static_cast<size_t>(std::max(num_axes, 0)) + 1);
  for (int& a : axes) {
    switch (fdp.ConsumeIntegralInRange<int>(0, 9)) {
      case 8:
        a = fdp.PickValueInArray({INT_MIN, INT_MAX, -9, 8, 9, -1});
        break;
      case 9:
        a = fdp.ConsumeIntegral<int>();
        break;
      default:
        a = fdp.ConsumeIntegralInRange<int>(-std::max(rank, 1), std::max(rank, 1) - 1);
    }
  }
  const bool null_axes = fdp.ConsumeIntegralInRange<int>(0, 31) == 0;
  const int* axes_ptr = null_axes ? nullptr : axes.data();
  const bool keepdims = fdp.ConsumeBool();
  const int output_mode = fdp.ConsumeIntegralInRange<int>(0, 15);
  const std::vector<uint8_t> pattern = fdp.ConsumeRemainingBytes<uint8_t>();
  x.Fill(pattern);

  // The harness's own reading of the axes.
  const int shape_rank = x.shape().rank();
  bool reduced[fbn::Shape::kMaxRank + 2] = {};  // shape_rank may be kMaxRank + 1 (invalid)
  bool axes_ok = num_axes >= 0 && !(num_axes > 0 && null_axes);
  for (int i = 0; axes_ok && i < num_axes; ++i) {
    const int64_t a = axes[static_cast<size_t>(i)];
    if (a < -shape_rank || a >= shape_rank) {
      axes_ok = false;
      break;
    }
    const int k = static_cast<int>(a < 0 ? a + shape_rank : a);
    if (reduced[k]) axes_ok = false;
    reduced[k] = true;
  }

  TensorSpec spec;
  spec.dtype = static_cast<DataType>(-3);
  const Status spec_status = fbn::MomentsOutputSpec(x.cview(), axes_ptr, num_axes, keepdims, &spec);
  const bool must_reject = x.must_reject() || x.null_with_elements() || !axes_ok;
  if (must_reject) {
    FBN_FUZZ_CHECK(!spec_status.ok(), "accepted x " + fbn_fuzz::ShapeText(x) + " with " +
                                          std::to_string(num_axes) + " axes");
  }
  if (num_axes < 0 && !x.must_reject() && !x.null_with_elements()) {
    FBN_FUZZ_CHECK(spec_status.message().find("argument num_axes") != std::string::npos,
                   "num_axes " + std::to_string(num_axes) + ": " + spec_status.ToString());
  }
  if (spec_status.ok()) {
    FBN_FUZZ_CHECK(spec.dtype == x.dtype(), "moments output dtype");
    int expect_rank = 0;
    for (int i = 0; i < shape_rank; ++i) {
      if (!reduced[i]) {
        FBN_FUZZ_CHECK(spec.shape.dim(expect_rank) == x.shape().dim(i), "kept dim");
        ++expect_rank;
      } else if (keepdims) {
        FBN_FUZZ_CHECK(spec.shape.dim(expect_rank) == 1, "keepdims dim");
        ++expect_rank;
      }
    }
    FBN_FUZZ_CHECK(spec.shape.rank() == expect_rank, "moments output rank");
  } else {
    FBN_FUZZ_CHECK(spec.dtype == static_cast<DataType>(-3), "MomentsOutputSpec wrote on failure");
    spec.dtype = x.dtype();
    spec.shape = x.shape();
  }

  Tensor mean(spec.dtype, spec.shape.dims(), spec.shape.rank());
  Tensor var(spec.dtype, spec.shape.dims(), spec.shape.rank());
  bool expect_ok = spec_status.ok();
  if (expect_ok && output_mode >= 13) {
    Tensor& o = output_mode == 15 ? var : mean;
    if (output_mode == 13) {
      const DataType other =
          o.dtype() == DataType::kFloat64 ? DataType::kFloat32 : DataType::kFloat64;
      o.Reset(other, spec.shape.dims(), spec.shape.rank());
      expect_ok = false;
    } else {
      int64_t d[fbn::Shape::kMaxRank + 1];
      for (int k = 0; k < spec.shape.rank(); ++k) d[k] = spec.shape.dim(k);
      d[spec.shape.rank()] = 1;
      o.Reset(spec.dtype, d, spec.shape.rank() + 1);
      expect_ok = false;
    }
  }
  if (spec_status.ok() && (x.too_big() || mean.too_big() || var.too_big())) return 0;

  const std::vector<unsigned char> x_snapshot = x.Snapshot();
  auto run = [&](Tensor& m, Tensor& v, unsigned char canary) {
    m.FillByte(canary);
    v.FillByte(canary);
    return fbn::Moments(x.cview(), axes_ptr, num_axes, keepdims, m.view(), v.view());
  };
  const Status s1 = run(mean, var, kCanaryA);
  FBN_FUZZ_CHECK(x.Equals(x_snapshot), "Moments wrote x");
  if (!spec_status.ok()) {
    FBN_FUZZ_CHECK(
        !s1.ok() && s1.code() == spec_status.code() && s1.message() == spec_status.message(),
        "op: " + s1.ToString() + " spec: " + spec_status.ToString());
  }
  if (!expect_ok) {
    FBN_FUZZ_CHECK(!s1.ok(), "accepted a wrong output view");
    FBN_FUZZ_CHECK(mean.AllBytesAre(kCanaryA) && var.AllBytesAre(kCanaryA), "failed op wrote");
    return 0;
  }
  FBN_FUZZ_CHECK(s1.ok(), s1.ToString());

  Tensor mean2(spec.dtype, spec.shape.dims(), spec.shape.rank());
  Tensor var2(spec.dtype, spec.shape.dims(), spec.shape.rank());
  const Status s2 = run(mean2, var2, kCanaryB);
  FBN_FUZZ_CHECK(s2.ok(), s2.ToString());
  FBN_FUZZ_CHECK(SameResults(mean, mean2) && SameResults(var, var2),
                 "Moments differs between runs or left output bytes unwritten");

  // Float64 reference for small inputs with modest finite values.
  if (x.info().elements > 0 && x.info().elements <= 4096) {
    double max_abs = 0;
    for (int64_t e = 0; e < x.info().elements; ++e) {
      const double v = fbn_fuzz::LoadAsDouble(x.data(), x.dtype(), e);
      if (!std::isfinite(v)) return 0;
      max_abs = std::max(max_abs, std::fabs(v));
    }
    if (max_abs > 1e4) return 0;
    std::vector<double> ref_mean, ref_var;
    Reference(x, reduced, &ref_mean, &ref_var);
    for (size_t o = 0; o < ref_mean.size(); ++o) {
      const int64_t i = static_cast<int64_t>(o);
      const double got_mean = fbn_fuzz::LoadAsDouble(mean.data(), mean.dtype(), i);
      const double got_var = fbn_fuzz::LoadAsDouble(var.data(), var.dtype(), i);
      FBN_FUZZ_CHECK(Close(got_mean, ref_mean[o], x.dtype(), max_abs),
                     "mean " + std::to_string(got_mean) + " vs " + std::to_string(ref_mean[o]));
      FBN_FUZZ_CHECK(Close(got_var, ref_var[o], x.dtype(), max_abs * max_abs),
                     "variance " + std::to_string(got_var) + " vs " + std::to_string(ref_var[o]));
    }
  }
  return 0;
}
