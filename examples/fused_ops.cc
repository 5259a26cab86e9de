// A first look at fbn's C++ API: one training step of FusedBatchNormV3 forward and gradient on an
// NHWC batch, then inference with the running statistics. Buffers belong to the caller; every
// call returns an fbn::Status whose message is TensorFlow's text for the same mistake.
#include <cstdio>
#include <random>
#include <vector>

#include "fbn/fbn.h"

int main() {
  const int64_t n = 8, h = 14, w = 14, c = 32;
  std::vector<float> x(n * h * w * c), y(x.size()), dy(x.size()), dx(x.size());
  std::mt19937 rng(42);
  std::normal_distribution<float> noise(3.0f, 2.0f);
  for (float& v : x) v = noise(rng);
  for (float& v : dy) v = noise(rng) - 3.0f;
  std::vector<float> scale(c, 1.0f), offset(c, 0.0f), empty;
  std::vector<float> batch_mean(c), batch_var(c), saved_mean(c), saved_var(c), rs3(1);
  fbn::SetNumThreads(2);

  const fbn::Shape xs{n, h, w, c}, vs{c}, none{0};
  const fbn::DataType f32 = fbn::DataType::kFloat32;
  fbn::FusedBatchNormAttrs attrs;  // NHWC, training, epsilon 1e-4, as TensorFlow's defaults
  fbn::FusedBatchNormInputs in{{x.data(), f32, xs},
                               {scale.data(), f32, vs},
                               {offset.data(), f32, vs},
                               {empty.data(), f32, none},
                               {empty.data(), f32, none}};
  fbn::FusedBatchNormOutputs out{{y.data(), f32, xs},         {batch_mean.data(), f32, vs},
                                 {batch_var.data(), f32, vs}, {saved_mean.data(), f32, vs},
                                 {saved_var.data(), f32, vs}, {rs3.data(), f32, fbn::Shape{}}};
  fbn::Status s = fbn::FusedBatchNorm(fbn::OpVersion::kV3, in, attrs, out);
  if (!s.ok()) {
    std::fprintf(stderr, "forward failed: %s\n", s.ToString().c_str());
    return 1;
  }
  std::printf("channel 0: batch mean %.4f, Bessel-corrected variance %.4f\n", batch_mean[0],
              batch_var[0]);

  std::vector<float> dscale(c), doffset(c), p0, p1;
  fbn::FusedBatchNormGradInputs gin{{dy.data(), f32, xs},        {x.data(), f32, xs},
                                    {scale.data(), f32, vs},     {saved_mean.data(), f32, vs},
                                    {saved_var.data(), f32, vs}, {rs3.data(), f32, fbn::Shape{}}};
  fbn::FusedBatchNormGradOutputs gout{{dx.data(), f32, xs},
                                      {dscale.data(), f32, vs},
                                      {doffset.data(), f32, vs},
                                      {p0.data(), f32, none},
                                      {p1.data(), f32, none}};
  s = fbn::FusedBatchNormGrad(fbn::OpVersion::kV3, gin, fbn::FusedBatchNormGradAttrs{}, gout);
  if (!s.ok()) {
    std::fprintf(stderr, "gradient failed: %s\n", s.ToString().c_str());
    return 1;
  }
  std::printf("channel 0: d scale %.4f, d offset %.4f\n", dscale[0], doffset[0]);

  // Inference with the running statistics; then a mistake, reported with TensorFlow's text.
  attrs.is_training = false;
  in.mean = {batch_mean.data(), f32, vs};
  in.variance = {batch_var.data(), f32, vs};
  s = fbn::FusedBatchNorm(fbn::OpVersion::kV3, in, attrs, out);
  std::printf("inference: %s, y[0] = %.4f\n", s.ToString().c_str(), y[0]);
  in.scale.shape = fbn::Shape{c - 1};
  s = fbn::FusedBatchNorm(fbn::OpVersion::kV3, in, attrs, out);
  std::printf("bad scale: %s\n", s.ToString().c_str());
  return s.ok() ? 1 : 0;
}
