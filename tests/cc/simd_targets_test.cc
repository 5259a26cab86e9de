// Every SIMD target compiled into fbn and supported by this CPU, one at a time: the kernels re-read
// Highway's dispatch on every call, so hwy::SetSupportedTargetsForTest caps what the public ops
// run. For each target the ops must agree with the float64 reference, and the 16-bit loads and
// stores must be exact: loads widen every bit pattern exactly, stores round to nearest even, keep
// NaN a NaN and overflow to infinity.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "fbn/fbn.h"
#include "hwy/targets.h"
#include "kernels/channel_math.h"
#include "kernels/kernel_table.h"
#include "op_checks.h"
#include "reference.h"
#include "test_util.h"

namespace fbn_test {
namespace {

using fbn::DataType;
using fbn::OpVersion;
using fbn::Shape;
using fbn::Status;
using fbn::TensorFormat;

// The targets this CPU supports and fbn was compiled for, best first (Highway gives better
// targets lower bits). A target is compiled in when capping dispatch to it makes fbn's kernel
// table report that target; otherwise dispatch falls back to another one.
std::vector<int64_t> ReachableTargets() {
  std::vector<int64_t> targets;
  for (int64_t bits = hwy::SupportedTargets(); bits != 0; bits &= bits - 1) {
    const int64_t target = bits & -bits;
    hwy::SetSupportedTargetsForTest(target);
    if (std::string(fbn::kernels::ActiveKernels().target_name) == hwy::TargetName(target)) {
      targets.push_back(target);
    }
  }
  hwy::SetSupportedTargetsForTest(0);
  return targets;
}

class SimdTargetTest : public ::testing::TestWithParam<int64_t> {
 protected:
  void SetUp() override {
    hwy::SetSupportedTargetsForTest(GetParam());
    ASSERT_STREQ(fbn::kernels::ActiveKernels().target_name, hwy::TargetName(GetParam()));
  }
  void TearDown() override { hwy::SetSupportedTargetsForTest(0); }
};

constexpr DataType kAllDtypes[] = {DataType::kFloat16, DataType::kBFloat16, DataType::kFloat32,
                                   DataType::kFloat64};

// Shapes whose channel counts hit full vectors and tails for every lane count (1, 4, 8, 16), and
// enough rows for several blocks and tasks.
TEST_P(SimdTargetTest, OpsMatchReference) {
  struct Case {
    int64_t n, c;
    std::vector<int64_t> spatial;
  };
  const Case cases[] = {{2, 1, {3, 5}},  {3, 3, {7, 1}},   {2, 17, {5, 3}},
                        {2, 67, {3, 3}}, {2, 16, {9, 17}}, {3, 5, {13, 11}}};
  uint32_t seed = 1;
  for (DataType t : kAllDtypes) {
    for (TensorFormat f : {TensorFormat::kNHWC, TensorFormat::kNCHW}) {
      for (const Case& c : cases) {
        const Shape xs = MakeShape(f, c.n, c.c, c.spatial);
        SCOPED_TRACE(DTypeTag(t) + " " + FormatTag(f) + " " + xs.DebugString());
        CheckForwardTraining(t, f, xs, seed++);
        CheckForwardInference(t, f, xs, seed++);
        CheckGrad(t, f, xs, true, seed++);
        CheckGrad(t, f, xs, false, seed++);
      }
    }
  }
}

// Float values that probe round-to-nearest-even into half and bfloat16: exact ties (to even down
// and up), just past ties, the largest finite values and what overflows, subnormal results,
// negative values rounding to -0, infinities, NaN, and random floats of every magnitude.
std::vector<float> TrickyFloats(DataType t) {
  const float h = std::ldexp(1.0f, -11), b = std::ldexp(1.0f, -8);  // half an ulp at 1
  std::vector<float> v;
  if (t == DataType::kFloat16) {
    v = {1 + h,          1 + 3 * h,      1 + h + std::ldexp(1.0f, -20),
         1 - h / 2,      -(1 + 3 * h),   65504.0f,
         65519.0f,       65520.0f,       -65520.0f,
         1e6f,           6.1035156e-05f, 6.0e-05f,
         2.9802322e-08f, 8.9406967e-08f, 1.0e-7f,
         -1e-9f,         3.0e-8f,        1234.567f,
         0.3333333f};
  } else {
    v = {1 + b,
         1 + 3 * b,
         1 + b + std::ldexp(1.0f, -20),
         -(1 + 3 * b),
         3.3895314e38f,
         std::numeric_limits<float>::max(),
         -std::numeric_limits<float>::max(),
         std::numeric_limits<float>::denorm_min(),
         1.0e-40f,
         -3.0e-39f,
         1.1754944e-38f,
         1234.567f,
         0.3333333f};
  }
  v.push_back(std::numeric_limits<float>::infinity());
  v.push_back(-std::numeric_limits<float>::infinity());
  v.push_back(std::numeric_limits<float>::quiet_NaN());
  v.push_back(-std::numeric_limits<float>::quiet_NaN());
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> mantissa(1.0, 2.0);
  std::uniform_int_distribution<int> exponent(t == DataType::kFloat16 ? -27 : -135,
                                              t == DataType::kFloat16 ? 16 : 127);
  while (v.size() < 67) {
    const double m = mantissa(rng) * ((v.size() % 2) ? -1 : 1);
    v.push_back(static_cast<float>(std::ldexp(m, exponent(rng))));
  }
  return v;
}

::testing::AssertionResult SameHalfOrBf16(DataType t, uint16_t got, double want_value) {
  const uint16_t want = t == DataType::kFloat16 ? HalfBits(want_value) : BFloat16Bits(want_value);
  const double got_value = t == DataType::kFloat16 ? HalfFromBits(got) : BFloat16FromBits(got);
  if (std::isnan(want_value)) {
    if (std::isnan(got_value)) return ::testing::AssertionSuccess();
  } else if (got == want) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure()
         << "for " << want_value << ": got bits 0x" << std::hex << got << ", want 0x" << want;
}

uint16_t Bits16(const HostTensor& t, int64_t i) {
  uint16_t b;
  std::memcpy(&b, static_cast<const unsigned char*>(t.data()) + 2 * i, 2);
  return b;
}

// Inference with x = 0, mean 0, variance 1, epsilon 0 and scale 1 makes y = offset exactly in
// float, so y is the store's rounding of the chosen offsets. The gradient with dy = 1 and frozen
// statistics gives dx = scale likewise. Channels-last (C = 67) stores through whole vectors and
// the channel tail; channels-first (37 per plane) through both as well.
// Inference (y = offset) and the frozen gradient (dx = scale) store `values`, one per channel,
// through the 16-bit type t; every stored value must be rounded to nearest even.
void ExpectStoresRoundToNearestEven(DataType t, const std::vector<float>& values) {
  {
    const int64_t C = static_cast<int64_t>(values.size());
    for (TensorFormat f : {TensorFormat::kNHWC, TensorFormat::kNCHW}) {
      SCOPED_TRACE(DTypeTag(t) + " " + FormatTag(f));
      const Shape xs = MakeShape(f, 2, C, {1, 37});
      const RefLayout l = LayoutOf(xs, f);
      HostTensor special(DataType::kFloat32, Shape{C});
      for (int64_t c = 0; c < C; ++c) special.Set(c, static_cast<double>(values[c]));
      HostTensor ones(DataType::kFloat32, Shape{C}), zeros(DataType::kFloat32, Shape{C});
      for (int64_t c = 0; c < C; ++c) ones.Set(c, 1.0);

      ForwardIO io;
      io.x = HostTensor(t, xs);  // all +0
      io.scale = ones;
      io.offset = special;
      io.mean = zeros;
      io.variance = ones;
      fbn::FusedBatchNormAttrs attrs;
      attrs.epsilon = 0.0f;
      attrs.is_training = false;
      attrs.data_format = f;
      ASSERT_NO_FATAL_FAILURE(io.AllocateOutputs(OpVersion::kV3, attrs));
      Status s = fbn::FusedBatchNorm(OpVersion::kV3, io.Inputs(), attrs, io.Outputs());
      ASSERT_TRUE(s.ok()) << s.ToString();
      int failures = 0;
      for (int64_t i = 0; i < io.y.size() && failures < 10; ++i) {
        const auto r =
            SameHalfOrBf16(t, Bits16(io.y, i), static_cast<double>(values[l.ChannelOf(i)]));
        EXPECT_TRUE(r) << "y[" << i << "]";
        failures += !r;
      }

      GradIO g;
      g.dy = HostTensor(t, xs);
      for (int64_t i = 0; i < g.dy.size(); ++i) g.dy.Set(i, 1.0);
      g.x = HostTensor(t, xs);
      g.scale = special;
      g.rs1 = zeros;
      g.rs2 = ones;
      g.rs3 = HostTensor(DataType::kFloat32, Shape{});
      fbn::FusedBatchNormGradAttrs gattrs;
      gattrs.epsilon = 0.0f;
      gattrs.is_training = false;
      gattrs.data_format = f;
      ASSERT_NO_FATAL_FAILURE(g.AllocateOutputs(OpVersion::kV3, gattrs));
      s = fbn::FusedBatchNormGrad(OpVersion::kV3, g.Inputs(), gattrs, g.Outputs());
      ASSERT_TRUE(s.ok()) << s.ToString();
      failures = 0;
      for (int64_t i = 0; i < g.dx.size() && failures < 10; ++i) {
        const auto r =
            SameHalfOrBf16(t, Bits16(g.dx, i), static_cast<double>(values[l.ChannelOf(i)]));
        EXPECT_TRUE(r) << "dx[" << i << "]";
        failures += !r;
      }
    }
  }
}

TEST_P(SimdTargetTest, SixteenBitStoresRoundToNearestEven) {
  for (DataType t : {DataType::kFloat16, DataType::kBFloat16})
    ExpectStoresRoundToNearestEven(t, TrickyFloats(t));
}

// bfloat16 stores may round whole vectors in hardware (AVX512-BF16) when no lane is subnormal:
// 2,048 normal values, a quarter of them exact ties, with infinities and NaNs, and one subnormal
// only in the last 64 channels, so most vectors take that path.
TEST_P(SimdTargetTest, BFloat16VectorsWithoutSubnormalsRoundToNearestEven) {
  std::mt19937 rng(13);
  std::uniform_int_distribution<uint32_t> bits(0, 0xFFFFFFFFu);
  std::vector<float> values;
  while (values.size() < 2048) {
    uint32_t u = bits(rng);
    if (values.size() % 4 == 0) u = (u & 0xFFFF0000u) | 0x8000u;  // an exact tie
    float f;
    std::memcpy(&f, &u, sizeof(f));
    if (std::fpclassify(f) == FP_SUBNORMAL) continue;
    values.push_back(f);
  }
  values[100] = std::numeric_limits<float>::infinity();
  values[301] = -std::numeric_limits<float>::quiet_NaN();
  values[2040] = 1.0e-40f;
  ExpectStoresRoundToNearestEven(DataType::kBFloat16, values);
}

// Every 16-bit pattern as x, with mean 0, variance 1, epsilon 0: y = x·scale exactly in float, so
// with scale 1 and 0.5 y must be the correctly rounded x·scale (the reference's rounding). This
// checks that loads widen every pattern exactly: subnormals, infinities (x·0.5 stays infinite)
// and NaNs (which must stay NaN).
TEST_P(SimdTargetTest, SixteenBitLoadsAreExact) {
  for (DataType t : {DataType::kFloat16, DataType::kBFloat16}) {
    for (TensorFormat f : {TensorFormat::kNHWC, TensorFormat::kNCHW}) {
      for (double scale : {1.0, 0.5}) {
        SCOPED_TRACE(DTypeTag(t) + " " + FormatTag(f) + " scale " + std::to_string(scale));
        const int64_t C = 16;
        const Shape xs = MakeShape(f, 1, C, {64, 64});  // 65536 elements
        ForwardIO io;
        io.x = HostTensor(t, xs);
        auto* bits = static_cast<uint16_t*>(io.x.data());
        for (int64_t i = 0; i < 65536; ++i) bits[i] = static_cast<uint16_t>(i);
        io.scale = io.variance = HostTensor(DataType::kFloat32, Shape{C});
        io.offset = io.mean = HostTensor(DataType::kFloat32, Shape{C});
        for (int64_t c = 0; c < C; ++c) {
          io.scale.Set(c, scale);
          io.variance.Set(c, 1.0);
        }
        fbn::FusedBatchNormAttrs attrs;
        attrs.epsilon = 0.0f;
        attrs.is_training = false;
        attrs.data_format = f;
        ASSERT_NO_FATAL_FAILURE(io.AllocateOutputs(OpVersion::kV3, attrs));
        const Status s = fbn::FusedBatchNorm(OpVersion::kV3, io.Inputs(), attrs, io.Outputs());
        ASSERT_TRUE(s.ok()) << s.ToString();
        int failures = 0;
        for (int64_t i = 0; i < 65536; ++i) {
          const double x = io.x.Get(i), y = io.y.Get(i);
          const double want = RoundTo(t, x * scale);
          const bool ok = std::isnan(want) ? std::isnan(y) : y == want;  // -0 == +0: (-0)·a + 0
          if (!ok && ++failures <= 5) {
            ADD_FAILURE() << "bits 0x" << std::hex << i << std::dec << ": x " << x << ", y " << y
                          << ", want " << want;
          }
        }
        EXPECT_EQ(failures, 0) << "of 65536 bit patterns";
      }
    }
  }
}

// The channels-first kernels that reduce several channels at once (stats_runs, reduce_runs)
// interleave channels only to overlap their dependency chains: each channel's values must be
// bit-identical to those of the one-channel kernels (stats_run, reduce_run), which the unfused
// paths use, for channels in groups and in the remainder, single blocks and several.
#if defined(__linux__)
// Memory whose last byte is followed by an inaccessible page: any access past the end faults.
class GuardedBytes {
 public:
  explicit GuardedBytes(size_t bytes) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    size_ = ((bytes + page - 1) / page + 1) * page;
    void* base = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) return;
    base_ = static_cast<unsigned char*>(base);
    if (mprotect(base_ + size_ - page, page, PROT_NONE) != 0) return;
    data_ = base_ + size_ - page - bytes;
  }
  ~GuardedBytes() {
    if (base_ != nullptr) munmap(base_, size_);
  }
  GuardedBytes(const GuardedBytes&) = delete;
  GuardedBytes& operator=(const GuardedBytes&) = delete;
  unsigned char* data() const { return data_; }  // null if the mapping failed

 private:
  unsigned char* base_ = nullptr;
  unsigned char* data_ = nullptr;
  size_t size_ = 0;
};

// Channels-first planes and channels-last rows that are not a whole number of vectors end in masked
// loads and stores. With x, dy, y and dx ending where an inaccessible page begins, a byte read or
// written past the tensor faults; the results must equal those of ordinary buffers bit for bit.
// Sizes: small calls, and calls over 64 KB, which the training gradient applies in place.
TEST_P(SimdTargetTest, TailsTouchNothingPastTheTensor) {
  struct Case {
    int64_t n, c;
    std::vector<int64_t> spatial;
  };
  const Case cases[] = {{1, 5, {3, 3}},   {2, 2500, {3, 3}}, {3, 700, {5, 5}},
                        {2, 300, {7, 7}}, {8, 24, {9, 9}},   {4, 40, {28, 28}}};
  std::mt19937 rng(11);
  for (DataType t : kAllDtypes) {
    for (TensorFormat f : {TensorFormat::kNCHW, TensorFormat::kNHWC}) {
      for (const Case& k : cases) {
        const Shape xs = MakeShape(f, k.n, k.c, k.spatial);
        SCOPED_TRACE(DTypeTag(t) + " " + FormatTag(f) + " " + xs.DebugString());
        const int64_t C = k.c;
        const Shape cs{C};
        const DataType u = t == DataType::kFloat64 ? t : DataType::kFloat32;  // scale, offset, ...
        ForwardIO io;
        io.x = RandomTensor(t, xs, -3.0, 5.0, &rng);
        io.scale = RandomTensor(u, cs, 0.5, 1.5, &rng);
        io.offset = RandomTensor(u, cs, -1.0, 1.0, &rng);
        io.mean = RandomTensor(u, cs, 0.5, 1.5, &rng);
        io.variance = RandomTensor(u, cs, 0.5, 2.0, &rng);
        fbn::FusedBatchNormAttrs attrs;
        attrs.is_training = false;
        attrs.data_format = f;
        ASSERT_NO_FATAL_FAILURE(io.AllocateOutputs(OpVersion::kV3, attrs));
        Status s = fbn::FusedBatchNorm(OpVersion::kV3, io.Inputs(), attrs, io.Outputs());
        ASSERT_TRUE(s.ok()) << s.ToString();
        {
          GuardedBytes x(io.x.bytes()), y(io.y.bytes());
          ASSERT_TRUE(x.data() != nullptr && y.data() != nullptr);
          std::memcpy(x.data(), io.x.data(), io.x.bytes());
          fbn::FusedBatchNormInputs in = io.Inputs();
          fbn::FusedBatchNormOutputs out = io.Outputs();
          in.x.data = x.data();
          out.y.data = y.data();
          s = fbn::FusedBatchNorm(OpVersion::kV3, in, attrs, out);
          ASSERT_TRUE(s.ok()) << s.ToString();
          EXPECT_EQ(std::memcmp(y.data(), io.y.data(), io.y.bytes()), 0) << "inference y";
        }

        GradIO g;
        g.dy = RandomTensor(t, xs, -1.0, 1.0, &rng);
        g.x = io.x;
        g.scale = io.scale;
        g.rs1 = io.mean;
        g.rs2 = io.variance;
        g.rs3 = HostTensor(u, Shape{});
        fbn::FusedBatchNormGradAttrs gattrs;
        gattrs.is_training = true;
        gattrs.data_format = f;
        ASSERT_NO_FATAL_FAILURE(g.AllocateOutputs(OpVersion::kV3, gattrs));
        s = fbn::FusedBatchNormGrad(OpVersion::kV3, g.Inputs(), gattrs, g.Outputs());
        ASSERT_TRUE(s.ok()) << s.ToString();
        GuardedBytes x(g.x.bytes()), dy(g.dy.bytes()), dx(g.dx.bytes());
        ASSERT_TRUE(x.data() != nullptr && dy.data() != nullptr && dx.data() != nullptr);
        std::memcpy(x.data(), g.x.data(), g.x.bytes());
        std::memcpy(dy.data(), g.dy.data(), g.dy.bytes());
        fbn::FusedBatchNormGradInputs in = g.Inputs();
        fbn::FusedBatchNormGradOutputs out = g.Outputs();
        in.x.data = x.data();
        in.y_backprop.data = dy.data();
        out.x_backprop.data = dx.data();
        s = fbn::FusedBatchNormGrad(OpVersion::kV3, in, gattrs, out);
        ASSERT_TRUE(s.ok()) << s.ToString();
        EXPECT_EQ(std::memcmp(dx.data(), g.dx.data(), g.dx.bytes()), 0) << "training dx";
      }
    }
  }
}
#endif

TEST_P(SimdTargetTest, MultiChannelRunsMatchSingleChannelRuns) {
  const fbn::kernels::KernelEntry* entries = fbn::kernels::ActiveKernels().entries;
  std::mt19937 rng(7);
  struct Case {
    int64_t images, c, s;
  };
  // C = 7: one group of four and three channels left; 2 x 3000 elements: more than one block.
  // Short planes over more than one block (90 x 49, 150 x 30) take the grouped statistics too.
  const Case cases[] = {{1, 7, 1},   {1, 7, 49},   {3, 7, 5},   {2, 9, 64},
                        {4, 6, 100}, {2, 5, 3000}, {90, 6, 49}, {150, 7, 30}};
  for (DataType t : kAllDtypes) {
    const DataType acc = t == DataType::kFloat64 ? DataType::kFloat64 : DataType::kFloat32;
    const fbn::kernels::KernelEntry& e = entries[static_cast<int>(t)];
    const size_t es = fbn::DataTypeSize(t);
    for (const Case& k : cases) {
      SCOPED_TRACE(DTypeTag(t) + " images " + std::to_string(k.images) + " C " +
                   std::to_string(k.c) + " S " + std::to_string(k.s));
      const Shape xs{k.images, k.c, k.s};
      const HostTensor x = RandomTensor(t, xs, 3.0, 5.0, &rng);
      const HostTensor dy = RandomTensor(t, xs, -1.0, 1.0, &rng);
      const HostTensor mean = RandomTensor(acc, Shape{k.c}, 3.5, 4.5, &rng);
      const HostTensor k1 = RandomTensor(acc, Shape{k.c}, 0.5, 1.5, &rng);
      const int64_t M = k.images * k.s;
      std::vector<double> m_all(k.c), q_all(k.c), s_all(k.c), t_all(k.c), fs_all(k.c), ft_all(k.c);
      HostTensor dx_all(t, xs), dx_one(t, xs);
      e.stats_runs(x.data(), k.c, k.s, k.images, 0, k.c, m_all.data(), q_all.data());
      e.reduce_runs(dy.data(), x.data(), k.c, k.s, k.images, 0, k.c, mean.data(), s_all.data(),
                    t_all.data(), nullptr, nullptr, false);
      // The frozen form, also writing dx = k1·dy.
      e.reduce_runs(dy.data(), x.data(), k.c, k.s, k.images, 0, k.c, mean.data(), fs_all.data(),
                    ft_all.data(), k1.data(), dx_all.data(), false);
      for (int64_t c = 0; c < k.c; ++c) {
        double m1 = 0, q1 = 0, s1 = 0, t1 = 0, fs1 = 0, ft1 = 0;
        const char* base = static_cast<const char*>(x.data()) + static_cast<size_t>(c * k.s) * es;
        e.stats_run(base, k.c * k.s, k.s, 0, M, &m1, &q1);
        e.reduce_run(dy.data(), x.data(), c * k.s, k.c * k.s, k.s, 0, M, mean.data(), c, &s1, &t1,
                     nullptr, nullptr, false);
        e.reduce_run(dy.data(), x.data(), c * k.s, k.c * k.s, k.s, 0, M, mean.data(), c, &fs1, &ft1,
                     k1.data(), dx_one.data(), false);
        EXPECT_EQ(std::memcmp(&m_all[c], &m1, 8), 0) << "mean of channel " << c;
        EXPECT_EQ(std::memcmp(&q_all[c], &q1, 8), 0) << "M2 of channel " << c;
        EXPECT_EQ(std::memcmp(&s_all[c], &s1, 8), 0) << "sum dy of channel " << c;
        EXPECT_EQ(std::memcmp(&t_all[c], &t1, 8), 0) << "sum dy(x - m) of channel " << c;
        EXPECT_EQ(std::memcmp(&fs_all[c], &fs1, 8), 0) << "frozen sum dy of channel " << c;
        EXPECT_EQ(std::memcmp(&ft_all[c], &ft1, 8), 0) << "frozen sum dy(x - m) of channel " << c;
      }
      EXPECT_TRUE(dx_all.BytesEqual(dx_one)) << "frozen dx";
    }
  }
}

// The per-channel math (channel_math.h) for float statistics: 1/sqrt may be a refined estimate
// instead of a correctly rounded sqrt and division, but it must stay within 2 ulp of double over
// the whole float range, give the exact expression's inf / NaN / 0 for special variances, and
// give each channel the same value wherever it sits in a call (vector body or tail).
TEST_P(SimdTargetTest, ChannelMathWithinTwoUlpOfDouble) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> exponent(-40.0, 38.0), mantissa(1.0, 10.0);
  const int n = 203;  // whole vectors and a tail on every target
  std::vector<float> var(n), scale(n), a(n), k1(n);
  std::vector<double> inv(n);
  for (int c = 0; c < n; ++c) {
    var[c] = static_cast<float>(mantissa(rng) * std::pow(10.0, exponent(rng)));
    scale[c] = static_cast<float>(mantissa(rng) - 5.5);
  }
  const float inf = std::numeric_limits<float>::infinity();
  var[3] = 0.0f;  // with eps 0: 1/sqrt(0) = inf
  var[4] = -1.0f;
  var[5] = inf;
  var[6] = std::numeric_limits<float>::quiet_NaN();
  var[n - 1] = 0.0f;  // in the tail
  for (double eps : {0.0, 1e-3}) {
    SCOPED_TRACE("eps " + std::to_string(eps));
    fbn::kernels::ScaleOverStdOfU(false, n, var.data(), scale.data(), eps, a.data());
    fbn::kernels::InverseStd(false, n, var.data(), scale.data(), eps, inv.data(), k1.data());
    for (int c = 0; c < n; ++c) {
      const double want_inv = 1.0 / std::sqrt(static_cast<double>(var[c]) + eps);
      const float want_a = static_cast<float>(static_cast<double>(scale[c]) * want_inv);
      if (std::isnan(want_inv) || std::isinf(want_inv) || want_inv == 0.0) {
        EXPECT_EQ(std::isnan(inv[c]), std::isnan(want_inv)) << c;
        if (!std::isnan(want_inv)) {
          EXPECT_EQ(inv[c], want_inv) << c;
        }
        continue;
      }
      EXPECT_LE(std::fabs(inv[c] - want_inv), 2 * std::ldexp(want_inv, -52)) << c;
      EXPECT_LE(std::fabs(a[c] - want_a),
                std::nextafter(std::fabs(want_a), inf) - std::fabs(want_a))
          << c;
      EXPECT_EQ(std::memcmp(&a[c], &k1[c], sizeof(float)), 0) << c;
    }
    // Channel by channel (every call a tail) gives the same bits as the whole call.
    for (int c = 0; c < n; ++c) {
      float one = 0;
      double one_inv = 0;
      float one_k1 = 0;
      fbn::kernels::ScaleOverStdOfU(false, 1, &var[c], &scale[c], eps, &one);
      fbn::kernels::InverseStd(false, 1, &var[c], &scale[c], eps, &one_inv, &one_k1);
      EXPECT_EQ(std::memcmp(&one, &a[c], sizeof(float)), 0) << c;
      EXPECT_EQ(std::memcmp(&one_inv, &inv[c], sizeof(double)), 0) << c;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Targets, SimdTargetTest, ::testing::ValuesIn(ReachableTargets()),
                         [](const ::testing::TestParamInfo<int64_t>& p) {
                           return std::string(hwy::TargetName(p.param));
                         });

// The portable fallback is always compiled in and reachable, and uncapped dispatch picks the best
// target; which targets ran is printed and recorded in the test's XML output.
TEST(SimdTargets, DispatchReachesCompiledTargets) {
  std::string list;
  std::vector<std::string> reached;
  for (int64_t target : ReachableTargets()) {
    reached.push_back(hwy::TargetName(target));
    list += reached.back() + " ";
  }
  RecordProperty("targets_reached", list);
  std::printf("SIMD targets exercised: %s\n", list.c_str());
  ASSERT_FALSE(reached.empty());
  const bool has_fallback = std::find(reached.begin(), reached.end(), "EMU128") != reached.end() ||
                            std::find(reached.begin(), reached.end(), "SCALAR") != reached.end();
  EXPECT_TRUE(has_fallback) << list;
  EXPECT_EQ(std::string(fbn::kernels::ActiveKernels().target_name), reached.front());
}

}  // namespace
}  // namespace fbn_test
