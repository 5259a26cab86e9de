// libFuzzer harness: the batch-normalization layer (fbn::layers::BatchNormalization) with hostile
// configurations (axes out of range or duplicated, NaN/Inf/negative momentum and epsilon, renorm
// clipping, virtual batch sizes, fused on/off, both behaviours, hostile initializers and
// adjustments) and hostile inputs (shapes, dtypes, null data), then a second call with another
// input and a backward pass with a right or wrong dy.
//
// Checks: the layer throws nothing but fbn::Error; a failed call leaves every variable as it was;
// a successful call returns the input's shape and writes finite-or-NaN values only where the
// input allows (no check on values); Backward returns the input's shape for dx.
#include <cmath>
#include <limits>
#include <string>
#include <typeinfo>

#include "fbn/graph.h"
#include "fbn/layer.h"
#include "fuzz_common.h"

namespace {

using fbn::DataType;
using fbn_fuzz::Tensor;

double ConsumeAttrDouble(FuzzedDataProvider& fdp, double usual) {
  static constexpr double kEdges[] = {0.0,
                                      1.0,
                                      -1.0,
                                      0.5,
                                      0.99,
                                      2.0,
                                      1e-3,
                                      -1e-3,
                                      1e-300,
                                      1e300,
                                      std::numeric_limits<double>::infinity(),
                                      -std::numeric_limits<double>::infinity(),
                                      std::numeric_limits<double>::quiet_NaN()};
  switch (fdp.ConsumeIntegralInRange<int>(0, 4)) {
    case 0:
    case 1:
    case 2:
      return usual;
    case 3:
      return fdp.PickValueInArray(kEdges);
    default:
      return fdp.ConsumeFloatingPoint<double>();
  }
}

std::optional<double> ConsumeOptionalDouble(FuzzedDataProvider& fdp, double usual) {
  if (fdp.ConsumeBool()) return std::nullopt;
  return ConsumeAttrDouble(fdp, usual);
}

fbn::Initializer ConsumeInitializer(FuzzedDataProvider& fdp, fbn::Initializer usual) {
  switch (fdp.ConsumeIntegralInRange<int>(0, 9)) {
    case 0:
      return fbn::Initializer::Constant(ConsumeAttrDouble(fdp, 1.0));
    case 1:
      // Returns a tensor of the wrong shape: the layer must report it.
      return fbn::Initializer(
          [](const fbn::Shape& shape, DataType dtype) {
            return fbn::Tensor(dtype, fbn::Shape{shape.rank() > 0 ? shape.dim(0) + 1 : 2});
          },
          "wrong_shape");
    case 2:
      return fbn::Initializer::RandomNormal(0.0, 1.0, 7);
    default:
      return usual;
  }
}

// Bitwise snapshot of every variable of the layer.
std::vector<std::vector<unsigned char>> Snapshot(const fbn::layers::BatchNormalization& bn) {
  std::vector<std::vector<unsigned char>> out;
  for (const auto& v : bn.variables()) {
    const fbn::Tensor& t = v->value();
    const auto* p = static_cast<const unsigned char*>(t.data());
    out.emplace_back(p, p + t.num_bytes());
  }
  return out;
}

template <typename F>
bool CallLayer(F&& f, std::string* error) {
  try {
    f();
    return true;
  } catch (const fbn::Error& e) {
    *error = e.what();
    FBN_FUZZ_CHECK(e.code() != fbn::StatusCode::kOk, "fbn::Error with code OK");
    FBN_FUZZ_CHECK(e.code() != fbn::StatusCode::kInternal,
                   std::string("internal error: ") + e.what());
    return false;
  } catch (const std::exception& e) {
    fbn_fuzz::Fail("the layer threw something other than fbn::Error",
                   std::string(typeid(e).name()) + ": " + e.what());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider fdp(data, size);

  // Input first: the axes are drawn relative to its rank.
  int64_t dims[16];
  int rank = 0;
  fbn_fuzz::ConsumeShape(fdp, fdp.ConsumeIntegralInRange<int>(1, 5), dims, &rank);
  const DataType x_type =
      fbn_fuzz::ConsumeDtype(fdp, static_cast<DataType>(fdp.ConsumeIntegralInRange<int>(0, 3)));
  Tensor x(x_type, dims, rank);
  if (fdp.ConsumeIntegralInRange<int>(0, 31) == 0) x.set_null_data(true);

  fbn::BatchNormalizationOptions opt;
  const int naxes =
      fdp.ConsumeIntegralInRange<int>(0, 7) == 0 ? fdp.ConsumeIntegralInRange<int>(0, 4) : 1;
  opt.axis.clear();
  for (int i = 0; i < naxes; ++i) {
    opt.axis.push_back(
        fdp.ConsumeIntegralInRange<int>(0, 15) == 0
            ? fdp.ConsumeIntegral<int>()
            : fdp.ConsumeIntegralInRange<int>(-std::max(rank, 1) - 1, std::max(rank, 1)));
  }
  opt.momentum = ConsumeAttrDouble(fdp, 0.99);
  opt.epsilon = ConsumeAttrDouble(fdp, 1e-3);
  opt.center = fdp.ConsumeIntegralInRange<int>(0, 3) != 0;
  opt.scale = fdp.ConsumeIntegralInRange<int>(0, 3) != 0;
  opt.renorm = fdp.ConsumeIntegralInRange<int>(0, 3) == 0;
  if (opt.renorm) {
    opt.renorm_clipping.rmax = ConsumeOptionalDouble(fdp, 3.0);
    opt.renorm_clipping.rmin = ConsumeOptionalDouble(fdp, 1.0 / 3.0);
    opt.renorm_clipping.dmax = ConsumeOptionalDouble(fdp, 5.0);
    opt.renorm_momentum = ConsumeAttrDouble(fdp, 0.99);
  }
  switch (fdp.ConsumeIntegralInRange<int>(0, 3)) {
    case 0:
      opt.fused = true;
      break;
    case 1:
      opt.fused = false;
      break;
    default:
      break;
  }
  opt.trainable = fdp.ConsumeIntegralInRange<int>(0, 5) != 0;
  if (fdp.ConsumeIntegralInRange<int>(0, 5) == 0) {
    opt.virtual_batch_size = fdp.ConsumeIntegralInRange<int>(0, 3) == 0
                                 ? fdp.ConsumeIntegral<int64_t>()
                                 : fdp.ConsumeIntegralInRange<int64_t>(-1, 4);
  }
  opt.behavior = fdp.ConsumeBool() ? fbn::LayerBehavior::kV1 : fbn::LayerBehavior::kKerasV2;
  opt.gamma_initializer = ConsumeInitializer(fdp, opt.gamma_initializer);
  opt.moving_variance_initializer = ConsumeInitializer(fdp, opt.moving_variance_initializer);
  if (fdp.ConsumeIntegralInRange<int>(0, 7) == 0) {
    const bool broadcastable = fdp.ConsumeBool();
    opt.adjustment = [broadcastable](const fbn::Shape& shape) {
      fbn::AdjustmentResult r;
      const int64_t last = shape.rank() > 0 ? shape.dim(shape.rank() - 1) : 1;
      r.scale =
          fbn::Tensor::Filled(DataType::kFloat32, fbn::Shape{broadcastable ? last : last + 2}, 1.5);
      r.bias = fbn::Tensor::Filled(DataType::kFloat32, fbn::Shape{1}, -0.25);
      return r;
    };
  }
  if (fdp.ConsumeIntegralInRange<int>(0, 7) == 0) opt.name = fdp.ConsumeRandomLengthString(12);
  const int training_mode = fdp.ConsumeIntegralInRange<int>(0, 2);
  const int second_mode = fdp.ConsumeIntegralInRange<int>(0, 3);
  const int backward_mode = fdp.ConsumeIntegralInRange<int>(0, 3);
  const std::vector<uint8_t> pattern = fdp.ConsumeRemainingBytes<uint8_t>();
  if (x.too_big()) return 0;
  // An empty input can still declare huge axis sizes ([0, 2^40]): the layer then allocates
  // variables of that size, as TensorFlow would. That amplification is reported separately
  // (docs/bad-input.md); the harness keeps every axis product within its memory cap.
  if (x.info().nonzero_product > static_cast<int64_t>(fbn_fuzz::kMaxTensorBytes / 8)) return 0;
  x.Fill(pattern);

  std::unique_ptr<fbn::layers::BatchNormalization> bn;
  std::string error;
  if (!CallLayer([&] { bn = std::make_unique<fbn::layers::BatchNormalization>(opt); }, &error)) {
    return 0;
  }
  auto flag = std::make_shared<fbn::TrainingFlag>(true);
  const fbn::Training training =
      training_mode == 2 ? fbn::Training(flag) : fbn::Training(training_mode == 1);

  // First call: builds the layer.
  const std::vector<unsigned char> x_snapshot = x.Snapshot();
  fbn::Tensor y;
  const bool first_ok = CallLayer([&] { y = bn->Call(x.cview(), training); }, &error);
  FBN_FUZZ_CHECK(x.Equals(x_snapshot), "the layer wrote its input");
  if (first_ok) {
    FBN_FUZZ_CHECK(!x.must_reject() && !x.null_with_elements(),
                   "accepted an invalid input " + fbn_fuzz::ShapeText(x));
    FBN_FUZZ_CHECK(y.shape() == x.shape(), "output shape " + y.shape().DebugString() +
                                               " for input " + x.shape().DebugString());
  }
  if (!bn->built()) return 0;

  // Second call: the same input, or another shape / dtype; a failure must leave the variables.
  Tensor x2;
  if (second_mode == 0) {
    x2.Reset(x.dtype(), x.shape().dims(), x.shape().rank());
  } else {
    int64_t d2[16];
    int r2 = x.shape().rank();
    for (int i = 0; i < r2; ++i) d2[i] = x.shape().dim(i);
    if (second_mode == 1 && r2 > 0) d2[0] = d2[0] + 1;            // another batch size
    if (second_mode == 2 && r2 > 0) d2[r2 - 1] = d2[r2 - 1] + 1;  // another channel count
    if (second_mode == 3) d2[r2++] = 1;                           // another rank
    x2.Reset(second_mode == 1 ? DataType::kFloat64 : x.dtype(), d2, r2);
  }
  if (x2.too_big()) return 0;
  x2.Fill(pattern);
  const auto before = Snapshot(*bn);
  fbn::Tensor y2;
  const bool second_ok = CallLayer([&] { y2 = bn->Call(x2.cview(), training); }, &error);
  if (second_ok) {
    FBN_FUZZ_CHECK(y2.shape() == x2.shape(), "second output shape");
  } else {
    FBN_FUZZ_CHECK(Snapshot(*bn) == before, "a failed call changed the variables: " + error);
    return 0;
  }

  // Backward for the last call.
  fbn::Shape dy_shape = y2.shape();
  if (backward_mode == 3 && dy_shape.rank() > 0) dy_shape.set_dim(0, dy_shape.dim(0) + 1);
  const DataType dy_type = backward_mode == 1 ? DataType::kFloat64 : y2.dtype();
  Tensor dy(dy_type, dy_shape.dims(), dy_shape.rank());
  if (dy.too_big()) return 0;
  dy.Fill(std::vector<uint8_t>(pattern.rbegin(), pattern.rend()));
  const auto before_backward = Snapshot(*bn);
  fbn::BatchNormalizationGradients grads;
  const bool backward_ok = CallLayer([&] { grads = bn->Backward(dy.cview()); }, &error);
  FBN_FUZZ_CHECK(Snapshot(*bn) == before_backward, "Backward changed the variables");
  if (backward_ok) {
    FBN_FUZZ_CHECK(backward_mode != 3 || dy_shape == y2.shape(),
                   "Backward accepted a wrong dy shape");
    FBN_FUZZ_CHECK(grads.dx.shape() == x2.shape(), "dx shape");
  }
  return 0;
}
