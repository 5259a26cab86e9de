// Runs one op through fbn's public API: TensorFlow's FusedBatchNormOpTest.Training case.
#include <cmath>
#include <cstdio>

#include "fbn/fbn.h"

int main() {
  // x is [1,1,6,2] (NHWC): both channels hold 5, 7, ..., 15.
  float x[12], y[12];
  for (int i = 0; i < 6; ++i) x[2 * i] = x[2 * i + 1] = 5.0f + 2.0f * static_cast<float>(i);
  float scale[2] = {4, 4}, offset[2] = {2, 2};
  float batch_mean[2], batch_var[2], rs1[2], rs2[2], rs3[1];
  const fbn::Shape xs{1, 1, 6, 2}, cs{2};
  fbn::FusedBatchNormInputs in;
  in.x = {x, fbn::DataType::kFloat32, xs};
  in.scale = {scale, fbn::DataType::kFloat32, cs};
  in.offset = {offset, fbn::DataType::kFloat32, cs};
  in.mean = {nullptr, fbn::DataType::kFloat32, fbn::Shape{0}};
  in.variance = {nullptr, fbn::DataType::kFloat32, fbn::Shape{0}};
  fbn::FusedBatchNormOutputs out;
  out.y = {y, fbn::DataType::kFloat32, xs};
  out.batch_mean = {batch_mean, fbn::DataType::kFloat32, cs};
  out.batch_variance = {batch_var, fbn::DataType::kFloat32, cs};
  out.reserve_space_1 = {rs1, fbn::DataType::kFloat32, cs};
  out.reserve_space_2 = {rs2, fbn::DataType::kFloat32, cs};
  out.reserve_space_3 = {rs3, fbn::DataType::kFloat32, fbn::Shape{}};
  fbn::FusedBatchNormAttrs attrs;
  attrs.epsilon = 0.001f;
  const fbn::Status s = fbn::FusedBatchNorm(fbn::OpVersion::kV3, in, attrs, out);
  if (!s.ok()) {
    std::fprintf(stderr, "FusedBatchNormV3 failed: %s\n", s.ToString().c_str());
    return 1;
  }
  const float want[6] = {-3.86f, -1.51f, 0.83f, 3.17f, 5.51f, 7.86f};
  for (int i = 0; i < 6; ++i) {
    if (std::fabs(y[2 * i] - want[i]) > 0.01f || std::fabs(y[2 * i + 1] - want[i]) > 0.01f) {
      std::fprintf(stderr, "y[%d] = %g, want %g\n", i, static_cast<double>(y[2 * i]),
                   static_cast<double>(want[i]));
      return 1;
    }
  }
  if (std::fabs(batch_mean[0] - 10.0f) > 1e-4f || std::fabs(batch_var[0] - 14.0f) > 1e-3f) {
    std::fprintf(stderr, "statistics %g %g, want 10 14\n", static_cast<double>(batch_mean[0]),
                 static_cast<double>(batch_var[0]));
    return 1;
  }
  std::printf("fbn %s consumer OK\n", FBN_VERSION_STRING);
  return 0;
}
