// The per-shape choices between one thread and all threads, and between keeping and streaming an
// output (kernels/call_tuning.h): they follow the measured times, retry the slower choice now and
// then, and stay out of calls they do not tune. Calls here are simulated: each "call" spins for the
// time its choice is given.
#include "kernels/call_tuning.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>

namespace fbn_test {
namespace {

using fbn::DataType;
using fbn::kernels::CallTuning;
using fbn::kernels::Geometry;
using Entry = CallTuning::Entry;

void SpinFor(std::chrono::microseconds d) {
  const auto until = std::chrono::steady_clock::now() + d;
  while (std::chrono::steady_clock::now() < until) {
  }
}

struct Counts {
  int one = 0, all = 0;
};

// `calls` simulated calls of one shape, `one_us` / `all_us` long on one / all (4) threads; counts
// the choices of the last `counted` calls.
Counts Simulate(int64_t shape_c, int calls, int counted, int one_us, int all_us) {
  Counts counts;
  for (int i = 0; i < calls; ++i) {
    const CallTuning tuning(Entry::kApply, DataType::kFloat32, Geometry{true, 1, shape_c, 49});
    const int threads = CallTuning::Threads(4, 1 << 20);
    EXPECT_TRUE(threads == 1 || threads == 4) << threads;
    SpinFor(std::chrono::microseconds(threads == 1 ? one_us : all_us));
    if (i >= calls - counted) ++(threads == 1 ? counts.one : counts.all);
  }
  return counts;
}

TEST(CallTuning, SettlesOnTheFasterChoiceAndRetriesTheOther) {
  // One thread 4x faster: mostly one thread, with retries of all threads.
  const Counts a = Simulate(1001, 600, 400, 25, 100);
  EXPECT_GT(a.one, 340);
  EXPECT_GT(a.all, 0);
  // All threads 4x faster: mostly all threads.
  const Counts b = Simulate(1002, 600, 400, 100, 25);
  EXPECT_GT(b.all, 340);
  EXPECT_GT(b.one, 0);
}

TEST(CallTuning, FollowsAChangeOfSpeed) {
  // All threads faster for a while, then one thread: the shape's choice moves over.
  const Counts before = Simulate(1003, 300, 100, 100, 25);
  EXPECT_GT(before.all, 80);
  const Counts after = Simulate(1003, 900, 200, 25, 100);
  EXPECT_GT(after.one, 170);
}

TEST(CallTuning, LeavesUntunedCallsAlone) {
  // Outside a tuned call, for one-thread parts and for large traffic: the count given.
  EXPECT_EQ(CallTuning::Threads(4, 1 << 20), 4);
  for (int i = 0; i < 200; ++i) {
    const CallTuning tuning(Entry::kStats, DataType::kFloat32, Geometry{true, 1, 7, 7});
    EXPECT_EQ(CallTuning::Threads(1, 1 << 20), 1);
    EXPECT_EQ(CallTuning::Threads(4, CallTuning::kMaxTraffic + 1), 4);
  }
}

TEST(CallTuning, NestedCallsTakeTheOuterChoice) {
  for (int i = 0; i < 100; ++i) {
    const CallTuning outer(Entry::kForwardTraining, DataType::kFloat32, Geometry{true, 1, 9, 9});
    const int threads = CallTuning::Threads(4, 1 << 20);
    {
      const CallTuning inner(Entry::kBackwardTraining, DataType::kFloat32,
                             Geometry{false, 1, 9, 9});
      EXPECT_EQ(CallTuning::Threads(4, 1 << 20), threads);
    }
    EXPECT_EQ(CallTuning::Threads(4, 1 << 20), threads);
  }
}

// The store question, simulated the same way: `keep_us` / `stream_us` long with the output kept /
// streamed; counts the calls that kept it among the last `counted`.
int SimulateStores(int64_t shape_c, int calls, int counted, int keep_us, int stream_us) {
  int kept = 0;
  for (int i = 0; i < calls; ++i) {
    const CallTuning tuning(Entry::kApply, DataType::kBFloat16, Geometry{true, 32, shape_c, 3136});
    const bool keep = CallTuning::KeepOutput();
    SpinFor(std::chrono::microseconds(keep ? keep_us : stream_us));
    if (i >= calls - counted) kept += keep;
  }
  return kept;
}

TEST(CallTuning, KeepsTheOutputWhenThatIsFaster) {
  // Keeping 3x faster: mostly kept, with retries of streaming.
  const int kept = SimulateStores(2001, 600, 400, 30, 90);
  EXPECT_GT(kept, 340);
  EXPECT_LT(kept, 400);
  // Streaming 3x faster: mostly streamed.
  const int kept_slow = SimulateStores(2002, 600, 400, 90, 30);
  EXPECT_LT(kept_slow, 60);
  EXPECT_GT(kept_slow, 0);
}

TEST(CallTuning, ACallAnswersOneQuestion) {
  for (int i = 0; i < 100; ++i) {
    // Asked the thread question first: the stores keep their default (streaming), and the thread
    // choice stays what it was.
    const CallTuning tuning(Entry::kApply, DataType::kFloat32, Geometry{true, 1, 2003, 49});
    const int threads = CallTuning::Threads(4, 1 << 20);
    EXPECT_FALSE(CallTuning::KeepOutput());
    EXPECT_EQ(CallTuning::Threads(4, 1 << 20), threads);
  }
  for (int i = 0; i < 100; ++i) {
    // And the other way round: all threads.
    const CallTuning tuning(Entry::kApply, DataType::kBFloat16, Geometry{true, 32, 2004, 3136});
    const bool keep = CallTuning::KeepOutput();
    EXPECT_EQ(CallTuning::Threads(4, 1 << 20), 4);
    EXPECT_EQ(CallTuning::KeepOutput(), keep);
  }
  // Outside a tuned call: streaming.
  EXPECT_FALSE(CallTuning::KeepOutput());
}

}  // namespace
}  // namespace fbn_test
