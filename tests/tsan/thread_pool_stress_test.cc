// Stress test of the internal thread pool (src/threading): back-to-back ParallelFor runs whose
// thread counts alternate, from one or several caller threads, with the pool resized in between.
// Each run must have finished every one of its tasks, exactly once, when ParallelFor returns.
// A watchdog turns a hang into a failure with a message.
#include <gtest/gtest.h>
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "fbn/threading.h"
#include "threading/thread_pool.h"

namespace {

// Aborts the process if `progress` stops moving for `seconds`.
class Watchdog {
 public:
  Watchdog(const std::atomic<int64_t>* progress, int seconds)
      : thread_([this, progress, seconds] {
          int64_t last = progress->load();
          int idle = 0;
          while (!done_.load()) {
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
            const int64_t now = progress->load();
            idle = now == last ? idle + 1 : 0;
            last = now;
            if (idle > seconds * 10) {
              std::fprintf(stderr,
                           "thread pool stress: no progress for %d s at iteration %lld: hang\n",
                           seconds, static_cast<long long>(now));
              std::abort();
            }
          }
        }) {}
  ~Watchdog() {
    done_.store(true);
    thread_.join();
  }

 private:
  std::atomic<bool> done_{false};
  std::thread thread_;
};

#if defined(__SANITIZE_THREAD__)
constexpr int kSanitizerSlowdown = 10;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
constexpr int kSanitizerSlowdown = 10;
#else
constexpr int kSanitizerSlowdown = 1;
#endif
#else
constexpr int kSanitizerSlowdown = 1;
#endif

// `normal` iterations, scaled by FBN_STRESS_ROUNDS / 6, and cut under ThreadSanitizer (which
// reports a race on the first bad interleaving instead of needing thousands to hit a hang).
int Iterations(int normal) {
  const char* env = std::getenv("FBN_STRESS_ROUNDS");
  const int rounds = env ? std::atoi(env) : 0;
  return (rounds > 0 ? normal * rounds / 6 : normal) / kSanitizerSlowdown;
}

// Runs ParallelFor with thread counts cycling through `counts`; every task bumps its own slot.
void AlternatingRuns(int iterations, const std::vector<int>& counts, std::atomic<int64_t>* progress,
                     std::atomic<int>* failures) {
  std::vector<std::atomic<int>> hits(64);
  for (int it = 0; it < iterations; ++it) {
    const int threads = counts[static_cast<size_t>(it) % counts.size()];
    const int64_t tasks = 1 + (it % 3 == 0 ? threads * 3 : threads);
    for (int64_t t = 0; t < tasks; ++t)
      hits[static_cast<size_t>(t)].store(0, std::memory_order_relaxed);
    fbn::threading::ParallelFor(tasks, threads, [&](int64_t t) {
      // A little work so that workers overlap with the caller.
      volatile int sink = 0;
      for (int k = 0; k < 50; ++k) sink = sink + k;
      hits[static_cast<size_t>(t)].fetch_add(1, std::memory_order_relaxed);
    });
    for (int64_t t = 0; t < tasks; ++t) {
      const int h = hits[static_cast<size_t>(t)].load(std::memory_order_relaxed);
      if (h != 1) {
        if (failures->fetch_add(1) < 5) {
          std::fprintf(stderr,
                       "iteration %d (threads %d, tasks %lld): task %lld ran %d times when "
                       "ParallelFor returned\n",
                       it, threads, static_cast<long long>(tasks), static_cast<long long>(t), h);
        }
      }
    }
    progress->fetch_add(1);
  }
}

TEST(ThreadPoolStress, AlternatingThreadCountsOneCaller) {
  fbn::SetNumThreads(8);
  std::atomic<int64_t> progress{0};
  std::atomic<int> failures{0};
  {
    Watchdog watchdog(&progress, 30);
    AlternatingRuns(Iterations(40000), {2, 8, 1, 5, 3, 8}, &progress, &failures);
  }
  fbn::SetNumThreads(0);
  EXPECT_EQ(failures.load(), 0);
}

TEST(ThreadPoolStress, SeveralCallersShareThePool) {
  fbn::SetNumThreads(6);
  std::atomic<int64_t> progress{0};
  std::atomic<int> failures{0};
  {
    Watchdog watchdog(&progress, 30);
    std::vector<std::thread> callers;
    for (int c = 0; c < 3; ++c) {
      callers.emplace_back([&, c] {
        AlternatingRuns(Iterations(15000),
                        c == 0 ? std::vector<int>{2, 6} : std::vector<int>{6, 3, 1}, &progress,
                        &failures);
      });
    }
    for (auto& t : callers) t.join();
  }
  fbn::SetNumThreads(0);
  EXPECT_EQ(failures.load(), 0);
}

TEST(ThreadPoolStress, ResizeBetweenRuns) {
  std::atomic<int64_t> progress{0};
  std::atomic<int> failures{0};
  {
    Watchdog watchdog(&progress, 30);
    std::atomic<bool> stop{false};
    std::thread resizer([&] {
      for (int k = 0; !stop.load(); ++k) {
        fbn::SetNumThreads(1 + k % 7);
        std::this_thread::sleep_for(std::chrono::microseconds(300));
      }
    });
    AlternatingRuns(Iterations(20000), {2, 7, 4}, &progress, &failures);
    stop.store(true);
    resizer.join();
  }
  fbn::SetNumThreads(0);
  EXPECT_EQ(failures.load(), 0);
}

// Nested ParallelFor from inside a task runs inline and completes.
TEST(ThreadPoolStress, NestedCallsRunInline) {
  fbn::SetNumThreads(4);
  std::atomic<int> inner{0};
  fbn::threading::ParallelFor(8, 4, [&](int64_t) {
    fbn::threading::ParallelFor(5, 4, [&](int64_t) { inner.fetch_add(1); });
  });
  fbn::SetNumThreads(0);
  EXPECT_EQ(inner.load(), 40);
}

// A worker the system does not schedule (here: held in a signal handler) must not hold up a run:
// the caller takes its block and the run completes without it.
std::atomic<bool> g_hold_worker{false};
std::atomic<bool> g_worker_held{false};
extern "C" void HoldWorker(int) {
  g_worker_held.store(true);
  while (g_hold_worker.load()) {
  }
}

TEST(ThreadPoolStress, RunsCompleteWithoutAnAbsentWorker) {
  fbn::SetNumThreads(2);
  const pthread_t caller = pthread_self();
  pthread_t worker{};
  std::atomic<bool> found{false};
  for (int i = 0; i < 2000 && !found.load(); ++i) {
    fbn::threading::ParallelFor(2, 2, [&](int64_t) {
      if (!pthread_equal(pthread_self(), caller) && !found.exchange(true)) worker = pthread_self();
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(50);
      while (std::chrono::steady_clock::now() < until) {
      }
    });
  }
  ASSERT_TRUE(found.load()) << "no task of 2000 runs ran on the worker";

  struct sigaction hold {
  }, previous{};
  hold.sa_handler = HoldWorker;
  sigemptyset(&hold.sa_mask);
  ASSERT_EQ(sigaction(SIGUSR1, &hold, &previous), 0);
  g_hold_worker.store(true);
  ASSERT_EQ(pthread_kill(worker, SIGUSR1), 0);
  for (int ms = 0; ms < 10000 && !g_worker_held.load(); ++ms) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const bool held = g_worker_held.load();

  std::atomic<int64_t> progress{0};
  int on_caller = 0, runs = 0;
  if (held) {
    Watchdog watchdog(&progress, 10);
    for (; runs < 200; ++runs) {
      int hits[4] = {0, 0, 0, 0};
      fbn::threading::ParallelFor(4, 2, [&](int64_t t) {
        ++hits[t];
        on_caller += pthread_equal(pthread_self(), caller) ? 1 : 0;
      });
      for (const int h : hits) EXPECT_EQ(h, 1) << "run " << runs;
      progress.fetch_add(1);
    }
  }
  g_hold_worker.store(false);
  sigaction(SIGUSR1, &previous, nullptr);
  fbn::SetNumThreads(0);
  ASSERT_TRUE(held) << "the worker did not take the signal within 10 s";
  EXPECT_EQ(on_caller, 4 * runs);
}

}  // namespace
