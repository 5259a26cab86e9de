// Determinism and thread safety: outputs are bit-identical for any thread count (reductions run
// over chunks fixed by the shape and merge in chunk order), and concurrent calls from several
// caller threads give exactly the serial results.
#include <gtest/gtest.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <atomic>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "fbn/fbn.h"
#include "test_util.h"

namespace fbn_test {
namespace {

using fbn::DataType;
using fbn::OpVersion;
using fbn::Shape;
using fbn::TensorFormat;

// Shapes large enough to split every phase into many tasks: channels-last rows in many chunks;
// channels-first channels grouped several to a task; a channels-first channel above 2 MB (also in
// bfloat16: 1.08M elements) split into pieces merged in order.
struct Workload {
  const char* name;
  TensorFormat format;
  std::vector<int64_t> dims;
};

const Workload kWorkloads[] = {
    {"nhwc_c32", TensorFormat::kNHWC, {8, 48, 48, 32}},
    {"nhwc_c3", TensorFormat::kNHWC, {8, 128, 128, 3}},
    {"nchw_grouped", TensorFormat::kNCHW, {8, 32, 48, 48}},
    {"nchw_pieces", TensorFormat::kNCHW, {2, 1, 768, 704}},
    // Too few rows to split: the reductions split the channels into groups (with a tail).
    {"nhwc_channel_groups", TensorFormat::kNHWC, {1, 7, 7, 2051}},
    // Few rows (at most 256) of a small tensor: channel groups over all rows too.
    {"nhwc_short_rows", TensorFormat::kNHWC, {1, 14, 14, 1000}},
    // Channels-first small planes: channels-last copies, and 1x1 planes as channels-last memory.
    {"nchw_2x2_planes", TensorFormat::kNCHW, {64, 512, 2, 2}},
    {"nchw_1x1_planes", TensorFormat::kNCHW, {256, 2048, 1, 1}},
    // 4 KB float rows in a 17.8 MB tensor: over half a victim L3 (Zen 4), so its statistics read
    // as from DRAM, in 16-row blocks.
    {"nhwc_dram_page_rows", TensorFormat::kNHWC, {17, 16, 16, 1024}},
    // 160 channels in 1.5-2.9 MB: beyond one thread's L2 (wide strips), within seven threads' L2s
    // (four-vector strips); the strip width must not change a value.
    {"nhwc_strip_widths", TensorFormat::kNHWC, {8, 24, 24, 160}},
    // Channels-first tensors of several images reduce in image order: 14.6 MB of float, over the
    // 13 MB from which the statistics do too (three image ranges, each in 19 channel groups), and
    // 7x7 planes read four channels at a time (67 channels: a tail of three).
    {"nchw_image_order", TensorFormat::kNCHW, {3, 1501, 30, 27}},
    {"nchw_image_order_7x7", TensorFormat::kNCHW, {32, 67, 7, 7}},
    // 2-4 MB of rows of at least 512 bytes: statistics in two sweeps of four row ranges (where
    // the L3 is a victim cache), with a channel tail.
    {"nhwc_two_sweeps", TensorFormat::kNHWC, {8, 16, 16, 520}},
};

// All outputs of forward training and both gradients, as raw bytes.
struct Outputs {
  std::vector<std::vector<unsigned char>> bytes;
  bool operator==(const Outputs& o) const { return bytes == o.bytes; }
};

struct Inputs {
  HostTensor x, dy, scale, offset, mean, variance;
};

Inputs MakeInputs(DataType t, const Workload& w, uint32_t seed) {
  std::mt19937 rng(seed);
  const Shape xs(w.dims.data(), static_cast<int>(w.dims.size()));
  const int64_t C = ChannelsLast(w.format) ? w.dims.back() : w.dims[1];
  const DataType u = StatsType(t);
  Inputs in;
  in.x = RandomTensor(t, xs, -2, 4, &rng);
  in.dy = RandomTensor(t, xs, -1, 1, &rng);
  in.scale = RandomTensor(u, Shape{C}, 0.5, 1.5, &rng);
  in.offset = RandomTensor(u, Shape{C}, -1, 1, &rng);
  in.mean = RandomTensor(u, Shape{C}, -1, 1, &rng);
  in.variance = RandomTensor(u, Shape{C}, 0.5, 2, &rng);
  return in;
}

// The forward op's inputs taken from `in` (outputs not allocated).
ForwardIO ForwardInputs(const Inputs& in) {
  ForwardIO f;
  f.x = in.x;
  f.scale = in.scale;
  f.offset = in.offset;
  f.mean = in.mean;
  f.variance = in.variance;
  return f;
}

// Evicts [p, p + bytes) from every cache level (x86 only; elsewhere returns false).
bool EvictFromCaches(const void* p, size_t bytes) {
#if defined(__x86_64__) || defined(__i386__)
  const char* c = static_cast<const char*>(p);
  for (size_t off = 0; off < bytes; off += 64) _mm_clflush(c + off);
  _mm_mfence();
  return true;
#else
  (void)p;
  (void)bytes;
  return false;
#endif
}

// Runs forward training (with running-average blending), the training gradient on its saved
// statistics and the inference gradient; returns every output. Fails the test on an error.
// `evict`: each op's operands leave the caches first (the ops may then stream their outputs).
Outputs RunAll(const Inputs& in, TensorFormat format, bool evict = false) {
  Outputs out;
  ForwardIO f = ForwardInputs(in);
  fbn::FusedBatchNormAttrs attrs;
  attrs.data_format = format;
  attrs.exponential_avg_factor = 0.1f;
  f.AllocateOutputs(OpVersion::kV3, attrs);
  if (evict) {
    EvictFromCaches(f.x.data(), f.x.bytes());
    EvictFromCaches(f.y.data(), f.y.bytes());
  }
  fbn::Status s = fbn::FusedBatchNorm(OpVersion::kV3, f.Inputs(), attrs, f.Outputs());
  EXPECT_TRUE(s.ok()) << s.ToString();
  for (const HostTensor* t : {&f.y, &f.batch_mean, &f.batch_variance, &f.rs1, &f.rs2}) {
    out.bytes.push_back(t->RawBytes());
  }
  for (bool training : {true, false}) {
    GradIO g;
    g.dy = in.dy;
    g.x = in.x;
    g.scale = in.scale;
    g.rs1 = training ? f.rs1 : in.mean;
    g.rs2 = training ? f.rs2 : in.variance;
    g.rs3 = f.rs3;
    fbn::FusedBatchNormGradAttrs gattrs;
    gattrs.data_format = format;
    gattrs.is_training = training;
    g.AllocateOutputs(OpVersion::kV3, gattrs);
    if (evict) {
      for (HostTensor* t : {&g.dy, &g.x, &g.dx}) EvictFromCaches(t->data(), t->bytes());
    }
    s = fbn::FusedBatchNormGrad(OpVersion::kV3, g.Inputs(), gattrs, g.Outputs());
    EXPECT_TRUE(s.ok()) << s.ToString();
    for (const HostTensor* t : {&g.dx, &g.dscale, &g.doffset}) out.bytes.push_back(t->RawBytes());
  }
  return out;
}

class ThreadCountTest : public ::testing::TestWithParam<std::tuple<DataType, int>> {
 protected:
  void TearDown() override { fbn::SetNumThreads(0); }
};

TEST_P(ThreadCountTest, BitIdenticalForAnyThreadCount) {
  const auto [t, w] = GetParam();
  const Workload& work = kWorkloads[w];
  const Inputs in = MakeInputs(t, work, 42);
  fbn::SetNumThreads(1);
  ASSERT_EQ(fbn::GetNumThreads(), 1);
  const Outputs serial = RunAll(in, work.format);
  for (int threads : {2, 3, 7}) {
    SCOPED_TRACE("threads " + std::to_string(threads));
    fbn::SetNumThreads(threads);
    ASSERT_EQ(fbn::GetNumThreads(), threads);
    const Outputs parallel = RunAll(in, work.format);
    ASSERT_EQ(parallel.bytes.size(), serial.bytes.size());
    for (size_t i = 0; i < serial.bytes.size(); ++i) {
      EXPECT_TRUE(parallel.bytes[i] == serial.bytes[i]) << "output " << i << " differs";
    }
  }
}

// Small calls choose between one thread and all threads by their own recent times
// (kernels/call_tuning.h), so repeated calls of one shape run both ways: every repetition must
// give the first call's bits.
TEST(ThreadCount, RepeatedSmallCallsKeepTheirBits) {
  for (const Workload& w : {kWorkloads[4], kWorkloads[5]}) {
    SCOPED_TRACE(w.name);
    const Inputs in = MakeInputs(DataType::kFloat32, w, 5);
    fbn::SetNumThreads(2);
    const Outputs first = RunAll(in, w.format);
    for (int rep = 0; rep < 150; ++rep) {
      const Outputs again = RunAll(in, w.format);
      ASSERT_EQ(again.bytes.size(), first.bytes.size());
      for (size_t i = 0; i < first.bytes.size(); ++i) {
        ASSERT_TRUE(again.bytes[i] == first.bytes[i]) << "repetition " << rep << " output " << i;
      }
    }
  }
  fbn::SetNumThreads(0);
}

// Channels-last 16-bit forward passes whose x and y fit the two L3s of a host that splits the
// cores keep y or stream it by the shape's own recent times (kernels/call_tuning.h), so repeated
// calls write y both ways: every repetition must give the first call's bits.
TEST(ThreadCount, RepeatedL3SizedForwardsKeepTheirBits) {
  const Workload w{"nhwc_l3_sized", TensorFormat::kNHWC, {32, 56, 56, 128}};
  const Inputs in = MakeInputs(DataType::kBFloat16, w, 9);
  fbn::SetNumThreads(2);
  for (bool training : {true, false}) {
    SCOPED_TRACE(training ? "training" : "inference");
    fbn::FusedBatchNormAttrs attrs;
    attrs.data_format = w.format;
    attrs.is_training = training;
    ForwardIO f = ForwardInputs(in);
    f.AllocateOutputs(OpVersion::kV3, attrs);
    ASSERT_TRUE(fbn::FusedBatchNorm(OpVersion::kV3, f.Inputs(), attrs, f.Outputs()).ok());
    const std::vector<unsigned char> first = f.y.RawBytes();
    for (int rep = 0; rep < 60; ++rep) {
      ASSERT_TRUE(fbn::FusedBatchNorm(OpVersion::kV3, f.Inputs(), attrs, f.Outputs()).ok());
      ASSERT_TRUE(f.y.RawBytes() == first) << "repetition " << rep;
    }
  }
  fbn::SetNumThreads(0);
}

// TensorFlow passes an empty mean and variance to training with factor 1, which does not read
// them: null data then, which no channel task may offset (the fuzzer's UBSan finding). Channels
// split into tasks in both layouts; same bits as with the running statistics given.
TEST(ThreadCount, TrainingWithoutRunningStatistics) {
  for (const Workload& w : {kWorkloads[2], kWorkloads[4], kWorkloads[6]}) {
    SCOPED_TRACE(w.name);
    const Inputs in = MakeInputs(DataType::kFloat32, w, 3);
    fbn::FusedBatchNormAttrs attrs;
    attrs.data_format = w.format;
    ForwardIO want = ForwardInputs(in);
    want.AllocateOutputs(OpVersion::kV3, attrs);
    fbn::SetNumThreads(1);
    ASSERT_TRUE(fbn::FusedBatchNorm(OpVersion::kV3, want.Inputs(), attrs, want.Outputs()).ok());
    for (int threads : {1, 2, 3, 7}) {
      SCOPED_TRACE("threads " + std::to_string(threads));
      fbn::SetNumThreads(threads);
      ForwardIO f = ForwardInputs(in);
      f.mean = f.variance = HostTensor(DataType::kFloat32, Shape{0});
      f.AllocateOutputs(OpVersion::kV3, attrs);
      fbn::FusedBatchNormInputs inputs = f.Inputs();
      inputs.mean.data = nullptr;
      inputs.variance.data = nullptr;
      const fbn::Status s = fbn::FusedBatchNorm(OpVersion::kV3, inputs, attrs, f.Outputs());
      ASSERT_TRUE(s.ok()) << s.ToString();
      EXPECT_TRUE(f.y.RawBytes() == want.y.RawBytes());
      EXPECT_TRUE(f.batch_mean.RawBytes() == want.batch_mean.RawBytes());
      EXPECT_TRUE(f.batch_variance.RawBytes() == want.batch_variance.RawBytes());
      EXPECT_TRUE(f.rs1.RawBytes() == want.rs1.RawBytes());
      EXPECT_TRUE(f.rs2.RawBytes() == want.rs2.RawBytes());
    }
  }
  fbn::SetNumThreads(0);
}

INSTANTIATE_TEST_SUITE_P(
    All, ThreadCountTest,
    ::testing::Combine(::testing::Values(DataType::kFloat32, DataType::kBFloat16),
                       ::testing::Range(0, static_cast<int>(std::size(kWorkloads)))),
    [](const ::testing::TestParamInfo<std::tuple<DataType, int>>& p) {
      return DTypeTag(std::get<0>(p.param)) + "_" + kWorkloads[std::get<1>(p.param)].name;
    });

// Outputs of tensors that fit the caches stream when their inputs are not cached (a timed probe),
// and small calls take a second thread then: neither the store kind nor the thread count may
// change a value. Shapes above the probing sizes (32 KB, and 512 KB for 16-bit single-sweep
// passes), small ones, both layouts, the channel-group path, short planes.
TEST(CacheResidency, SameOutputsWithInputsEvicted) {
  HostTensor probe(DataType::kFloat32, Shape{16});
  if (!EvictFromCaches(probe.data(), probe.bytes())) GTEST_SKIP() << "no cache flush here";
  const Workload workloads[] = {
      {"nhwc_rows", TensorFormat::kNHWC, {1, 28, 28, 256}},
      {"nhwc_wide", TensorFormat::kNHWC, {1, 28, 28, 512}},
      {"nhwc_groups", TensorFormat::kNHWC, {1, 7, 7, 2048}},
      // Evicted float statistics read rows in order (RowRead::kFlushed), cached ones in strips.
      {"nhwc_images", TensorFormat::kNHWC, {8, 14, 14, 160}},
      // Two-sweep statistics: the first sweep reads evicted rows in order, cached ones in strips.
      {"nhwc_two_sweeps", TensorFormat::kNHWC, {8, 16, 16, 520}},
      // Small enough for one thread when cached, two when not.
      {"nhwc_small", TensorFormat::kNHWC, {1, 7, 7, 512}},
      {"nchw_small", TensorFormat::kNCHW, {1, 512, 7, 7}},
      {"nchw", TensorFormat::kNCHW, {1, 256, 28, 28}},
      // Evicted batch-1 fused paths take 4 KB chunks; 14x14 planes keep regular stores.
      {"nchw_14x14_planes", TensorFormat::kNCHW, {1, 256, 14, 14}},
      {"nchw_images", TensorFormat::kNCHW, {16, 64, 16, 16}},
      // Planes shorter than 512 bytes: the fused training paths stream their whole lines.
      {"nchw_short_planes", TensorFormat::kNCHW, {16, 64, 8, 8}},
      {"nchw_7x7_planes", TensorFormat::kNCHW, {16, 64, 7, 7}},
      // Evicted fused paths rewrite in slices while prefetching the next chunk: odd planes that
      // put slice and plane ends anywhere in a line, and a last chunk narrower than the others.
      {"nchw_overlap_slices", TensorFormat::kNCHW, {4, 27, 27, 29}},
      {"nchw_overlap_long_planes", TensorFormat::kNCHW, {3, 13, 61, 67}},
  };
  for (DataType t : {DataType::kFloat32, DataType::kBFloat16}) {
    for (const Workload& w : workloads) {
      SCOPED_TRACE(DTypeTag(t) + " " + w.name);
      const Inputs in = MakeInputs(t, w, 7);
      const Outputs cached = RunAll(in, w.format);
      for (int rep = 0; rep < 3; ++rep) {
        EXPECT_TRUE(RunAll(in, w.format, /*evict=*/true) == cached) << "run " << rep;
      }
    }
  }
}

// A new pool is made whenever the thread count changes; a run must not be lost to a worker that
// has not started yet, nor to a pool being replaced.
TEST(ThreadPool, FreshPoolsNeverMissARun) {
  // 300 KB: enough for several threads, small enough for many fresh pools.
  const Workload small{"small", TensorFormat::kNHWC, {4, 24, 24, 32}};
  const Inputs in = MakeInputs(DataType::kFloat32, small, 1);
  fbn::SetNumThreads(1);
  const Outputs want = RunAll(in, small.format);
  for (int i = 0; i < 40; ++i) {
    fbn::SetNumThreads(2 + i % 3);
    ASSERT_TRUE(RunAll(in, small.format) == want) << "iteration " << i;
  }
  fbn::SetNumThreads(0);
}

// Several caller threads at once (one holds the pool, the others run inline) give exactly the
// serial results, also while another thread keeps changing the thread count.
TEST(ThreadPool, ConcurrentCallersMatchSerialResults) {
  struct Job {
    DataType dtype;
    int workload;
    Inputs in;
    Outputs want;
  };
  std::vector<Job> jobs;
  const std::pair<DataType, int> mix[] = {{DataType::kFloat32, 0},
                                          {DataType::kBFloat16, 2},
                                          {DataType::kFloat32, 2},
                                          {DataType::kBFloat16, 1},
                                          {DataType::kFloat32, 0}};
  fbn::SetNumThreads(2);
  for (const auto& [t, w] : mix) {
    Job j{t, w, MakeInputs(t, kWorkloads[w], static_cast<uint32_t>(7 + w)), {}};
    j.want = RunAll(j.in, kWorkloads[w].format);
    jobs.push_back(std::move(j));
  }
  std::atomic<bool> done{false};
  std::thread toggler([&] {
    int n = 1;
    while (!done.load()) {
      fbn::SetNumThreads(1 + n++ % 4);
      std::this_thread::yield();
    }
  });
  std::vector<std::thread> callers;
  std::vector<int> mismatches(jobs.size(), 0);
  for (size_t k = 0; k < jobs.size(); ++k) {
    callers.emplace_back([&, k] {
      for (int rep = 0; rep < 2; ++rep) {
        if (!(RunAll(jobs[k].in, kWorkloads[jobs[k].workload].format) == jobs[k].want)) {
          ++mismatches[k];
        }
      }
    });
  }
  for (auto& c : callers) c.join();
  done = true;
  toggler.join();
  for (size_t k = 0; k < jobs.size(); ++k) EXPECT_EQ(mismatches[k], 0) << "job " << k;
  fbn::SetNumThreads(0);
}

TEST(ThreadPool, SetNumThreadsDefaults) {
  fbn::SetNumThreads(5);
  EXPECT_EQ(fbn::GetNumThreads(), 5);
  // n <= 0 restores the default: FBN_NUM_THREADS if set, else the hardware concurrency.
  ASSERT_EQ(setenv("FBN_NUM_THREADS", "3", 1), 0);
  fbn::SetNumThreads(0);
  EXPECT_EQ(fbn::GetNumThreads(), 3);
  ASSERT_EQ(unsetenv("FBN_NUM_THREADS"), 0);
  fbn::SetNumThreads(-1);
  const int hw = static_cast<int>(std::thread::hardware_concurrency());
  EXPECT_EQ(fbn::GetNumThreads(), hw > 0 ? hw : 1);
}

}  // namespace
}  // namespace fbn_test
