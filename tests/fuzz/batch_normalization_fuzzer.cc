// libFuzzer harness: fbn::BatchNormalization (tf.nn.batch_normalization) with hostile x shapes,
// broadcast and non-broadcastable mean/variance/offset/scale shapes, mixed dtypes, absent offset
// and scale (with garbage views that must be ignored), null pointers, wrong output views and
// hostile epsilons; finite inputs are also checked against a float64 evaluation of the formula.
// See fuzz_common.h for what every run checks.
#include <algorithm>
#include <cmath>
#include <string>

#include "fuzz_common.h"

namespace {

using fbn::DataType;
using fbn::Status;
using fbn_fuzz::SameResults;
using fbn_fuzz::Tensor;

constexpr unsigned char kCanaryA = 0xA5;
constexpr unsigned char kCanaryB = 0x5A;

// NumPy broadcasting of p against x with the result no larger than x.
bool Broadcastable(const fbn::Shape& x, const fbn::Shape& p) {
  if (p.rank() > x.rank()) return false;
  for (int j = 0; j < p.rank(); ++j) {
    const int i = j + x.rank() - p.rank();
    if (p.dim(j) != 1 && p.dim(j) != x.dim(i)) return false;
  }
  return true;
}

// Linear index into p of x's element `e` under broadcasting.
int64_t BroadcastIndex(const fbn::Shape& x, const fbn::Shape& p, int64_t e) {
  int64_t rest = e, index = 0, stride = 1;
  for (int i = x.rank() - 1; i >= 0; --i) {
    const int64_t idx = rest % x.dim(i);
    rest /= x.dim(i);
    const int j = i - (x.rank() - p.rank());
    if (j < 0) continue;
    if (p.dim(j) != 1) index += idx * stride;
    stride *= p.dim(j);
  }
  return index;
}

void ConsumeParamShape(FuzzedDataProvider& fdp, const fbn::Shape& x, int64_t dims[16], int* rank) {
  if (fdp.ConsumeIntegralInRange<int>(0, 7) == 0 || x.rank() > fbn::Shape::kMaxRank) {
    fbn_fuzz::ConsumeShape(fdp, fdp.ConsumeIntegralInRange<int>(0, 4), dims, rank);
    return;
  }
  // A broadcast-compatible shape: a suffix of x's dims, each kept or replaced by 1.
  *rank = fdp.ConsumeIntegralInRange<int>(0, x.rank());
  for (int j = 0; j < *rank; ++j) {
    const int i = j + x.rank() - *rank;
    dims[j] = fdp.ConsumeIntegralInRange<int>(0, 2) == 0 ? 1 : x.dim(i);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider fdp(data, size);
  int64_t dims[16];
  int rank = 0;
  fbn_fuzz::ConsumeShape(fdp, fdp.ConsumeIntegralInRange<int>(0, 5), dims, &rank);
  const DataType x_type =
      fbn_fuzz::ConsumeDtype(fdp, static_cast<DataType>(fdp.ConsumeIntegralInRange<int>(0, 3)));
  Tensor x(x_type, dims, rank);

  // mean, variance, offset, scale.
  Tensor p[4];
  bool given[4] = {true, true, fdp.ConsumeIntegralInRange<int>(0, 3) != 0,
                   fdp.ConsumeIntegralInRange<int>(0, 3) != 0};
  for (int k = 0; k < 4; ++k) {
    if (!given[k]) {
      // Absent: a null pointer, with a view that would be invalid if anybody looked at it.
      const int64_t junk[2] = {-3, std::numeric_limits<int64_t>::max()};
      p[k].Reset(static_cast<DataType>(77), junk, 2);
      p[k].set_null_data(true);
      continue;
    }
    ConsumeParamShape(fdp, x.shape(), dims, &rank);
    p[k].Reset(fbn_fuzz::ConsumeDtype(fdp, x_type), dims, rank);
  }
  if (fdp.ConsumeIntegralInRange<int>(0, 15) == 0) {
    const int which = fdp.ConsumeIntegralInRange<int>(0, 2);
    (which == 0 ? x : p[which - 1]).set_null_data(true);
  }
  const float epsilon = fbn_fuzz::ConsumeAttrFloat(fdp, 1e-3f);
  const int output_mode = fdp.ConsumeIntegralInRange<int>(0, 15);
  const std::vector<uint8_t> pattern = fdp.ConsumeRemainingBytes<uint8_t>();
  x.Fill(pattern);
  for (int k = 0; k < 4; ++k) {
    std::vector<uint8_t> rotated(pattern);
    if (!rotated.empty())
      std::rotate(rotated.begin(), rotated.begin() + (k * 3) % rotated.size(), rotated.end());
    p[k].Fill(rotated);
  }

  bool must_reject = x.must_reject() || x.null_with_elements();
  for (int k = 0; k < 4; ++k) {
    if (!given[k]) continue;
    must_reject = must_reject || p[k].must_reject() || p[k].dtype() != x.dtype() ||
                  !Broadcastable(x.shape(), p[k].shape());
    // mean and variance are required; a null offset/scale is "not given".
    if (k < 2) must_reject = must_reject || p[k].null_with_elements();
  }
  const bool valid_x = !x.must_reject();

  Tensor y(x.dtype(), x.shape().dims(), x.shape().rank());
  bool expect_ok = !must_reject;
  if (output_mode == 13) {
    const DataType other =
        x.dtype() == DataType::kFloat32 ? DataType::kFloat64 : DataType::kFloat32;
    y.Reset(other, x.shape().dims(), x.shape().rank());
    expect_ok = false;
  } else if (output_mode == 14 && valid_x) {
    int64_t d[fbn::Shape::kMaxRank + 1];
    for (int k = 0; k < x.shape().rank(); ++k) d[k] = x.shape().dim(k);
    d[x.shape().rank()] = 1;
    y.Reset(x.dtype(), d, x.shape().rank() + 1);
    expect_ok = false;
  } else if (output_mode == 15 && y.info().elements > 0) {
    y.set_null_data(true);
    expect_ok = false;
  }
  bool too_big = x.too_big() || y.too_big();
  for (int k = 0; k < 4; ++k) too_big = too_big || (given[k] && p[k].too_big());
  // Only calls that must fail validation run with buffers smaller than their shapes.
  if (too_big && !must_reject) return 0;

  std::vector<unsigned char> snaps[5] = {x.Snapshot(), p[0].Snapshot(), p[1].Snapshot(),
                                         p[2].Snapshot(), p[3].Snapshot()};
  auto run = [&](Tensor& out, unsigned char canary) {
    out.FillByte(canary);
    return fbn::BatchNormalization(x.cview(), p[0].cview(), p[1].cview(), p[2].cview(),
                                   p[3].cview(), epsilon, out.view());
  };
  const Status s1 = run(y, kCanaryA);
  FBN_FUZZ_CHECK(x.Equals(snaps[0]), "BatchNormalization wrote x");
  for (int k = 0; k < 4; ++k) FBN_FUZZ_CHECK(p[k].Equals(snaps[k + 1]), "wrote a parameter");
  if (!expect_ok) {
    FBN_FUZZ_CHECK(!s1.ok(), "accepted x " + fbn_fuzz::ShapeText(x) + " mean " +
                                 fbn_fuzz::ShapeText(p[0]) + " variance " +
                                 fbn_fuzz::ShapeText(p[1]) + " offset " +
                                 fbn_fuzz::ShapeText(p[2]) + " scale " + fbn_fuzz::ShapeText(p[3]) +
                                 " output mode " + std::to_string(output_mode));
    FBN_FUZZ_CHECK(s1.code() == fbn::StatusCode::kInvalidArgument, s1.ToString());
    FBN_FUZZ_CHECK(y.AllBytesAre(kCanaryA), "failed BatchNormalization wrote y");
    return 0;
  }
  FBN_FUZZ_CHECK(s1.ok(), s1.ToString());
  Tensor y2(x.dtype(), x.shape().dims(), x.shape().rank());
  const Status s2 = run(y2, kCanaryB);
  FBN_FUZZ_CHECK(s2.ok() && SameResults(y, y2),
                 "BatchNormalization left bytes unwritten or varies");

  // Float64 evaluation of the formula on finite inputs.
  const int64_t n = std::min<int64_t>(x.info().elements, 4096);
  for (int64_t e = 0; e < n; ++e) {
    double v[5];
    v[0] = fbn_fuzz::LoadAsDouble(x.data(), x.dtype(), e);
    for (int k = 0; k < 4; ++k) {
      v[k + 1] = given[k] ? fbn_fuzz::LoadAsDouble(p[k].data(), x.dtype(),
                                                   BroadcastIndex(x.shape(), p[k].shape(), e))
                          : (k == 2 ? 0.0 : 1.0);
    }
    bool finite = true;
    for (double d : v) finite = finite && std::isfinite(d);
    if (!finite) continue;
    const double inv = 1.0 / std::sqrt(v[2] + static_cast<double>(epsilon)) * v[4];
    const double want = v[0] * inv + (v[3] - v[1] * inv);
    const double scale = std::fabs(v[0] * inv) + std::fabs(v[3]) + std::fabs(v[1] * inv);
    if (!std::isfinite(scale) || !std::isfinite(want)) continue;
    if (std::fabs(want) > fbn_fuzz::MaxFinite(x.dtype())) continue;
    const double got = fbn_fuzz::LoadAsDouble(y.data(), y.dtype(), e);
    FBN_FUZZ_CHECK(
        std::fabs(got - want) <=
            fbn_fuzz::Tolerance(x.dtype()) * scale + fbn_fuzz::SubnormalStep(x.dtype()),
        "y[" + std::to_string(e) + "] = " + std::to_string(got) + ", want " + std::to_string(want));
  }
  return 0;
}
