// The per-shape choice between one thread and all threads (kernels/thread_tuning.h): it follows
// the measured times, retries the slower choice now and then, and stays out of calls it does not
// tune. Calls here are simulated: each "call" spins for the time its choice is given.
#include "kernels/thread_tuning.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>

namespace fbn_test {
namespace {

using fbn::DataType;
using fbn::kernels::Geometry;
using fbn::kernels::ThreadTuning;
using Entry = ThreadTuning::Entry;

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
    const ThreadTuning tuning(Entry::kApply, DataType::kFloat32, Geometry{true, 1, shape_c, 49});
    const int threads = ThreadTuning::Threads(4, 1 << 20);
    EXPECT_TRUE(threads == 1 || threads == 4) << threads;
    SpinFor(std::chrono::microseconds(threads == 1 ? one_us : all_us));
    if (i >= calls - counted) ++(threads == 1 ? counts.one : counts.all);
  }
  return counts;
}

TEST(ThreadTuning, SettlesOnTheFasterChoiceAndRetriesTheOther) {
  // One thread 4x faster: mostly one thread, with retries of all threads.
  const Counts a = Simulate(1001, 600, 400, 25, 100);
  EXPECT_GT(a.one, 340);
  EXPECT_GT(a.all, 0);
  // All threads 4x faster: mostly all threads.
  const Counts b = Simulate(1002, 600, 400, 100, 25);
  EXPECT_GT(b.all, 340);
  EXPECT_GT(b.one, 0);
}

TEST(ThreadTuning, FollowsAChangeOfSpeed) {
  // All threads faster for a while, then one thread: the shape's choice moves over.
  const Counts before = Simulate(1003, 300, 100, 100, 25);
  EXPECT_GT(before.all, 80);
  const Counts after = Simulate(1003, 900, 200, 25, 100);
  EXPECT_GT(after.one, 170);
}

TEST(ThreadTuning, LeavesUntunedCallsAlone) {
  // Outside a tuned call, for one-thread parts and for large traffic: the count given.
  EXPECT_EQ(ThreadTuning::Threads(4, 1 << 20), 4);
  for (int i = 0; i < 200; ++i) {
    const ThreadTuning tuning(Entry::kStats, DataType::kFloat32, Geometry{true, 1, 7, 7});
    EXPECT_EQ(ThreadTuning::Threads(1, 1 << 20), 1);
    EXPECT_EQ(ThreadTuning::Threads(4, ThreadTuning::kMaxTraffic + 1), 4);
  }
}

TEST(ThreadTuning, NestedCallsTakeTheOuterChoice) {
  for (int i = 0; i < 100; ++i) {
    const ThreadTuning outer(Entry::kForwardTraining, DataType::kFloat32, Geometry{true, 1, 9, 9});
    const int threads = ThreadTuning::Threads(4, 1 << 20);
    {
      const ThreadTuning inner(Entry::kBackwardTraining, DataType::kFloat32,
                               Geometry{false, 1, 9, 9});
      EXPECT_EQ(ThreadTuning::Threads(4, 1 << 20), threads);
    }
    EXPECT_EQ(ThreadTuning::Threads(4, 1 << 20), threads);
  }
}

}  // namespace
}  // namespace fbn_test
