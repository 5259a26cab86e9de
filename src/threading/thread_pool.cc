#include "threading/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "fbn/threading.h"
#include "hwy/cache_control.h"

namespace fbn::threading {
namespace {

// Below this much memory traffic one thread finishes before a second could help.
constexpr int64_t kMinBytesPerExtraThread = 96 * 1024;
// An idle worker polls for the next run this long before it sleeps. Waking a sleeping thread
// costs tens of microseconds on a VM (futex plus an inter-processor interrupt), more than a whole
// batch-1 layer takes, so back-to-back calls must find the workers awake, as OpenMP runtimes'
// spin-wait (GOMP_SPINCOUNT) does for oneDNN.
constexpr auto kSpinTime = std::chrono::microseconds(500);
// The caller waits for the workers of its run with this many polls before yielding.
constexpr int kSpinPolls = 20000;

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}
// SetNumThreads() and FBN_NUM_THREADS are clamped to this: a run publishes its worker count in 16
// bits, and nobody has use for more threads than this.
constexpr int kMaxThreads = 1024;

thread_local bool t_inside_pool_task = false;

class Pool {
 public:
  explicit Pool(int requested) : requested_(std::max(1, requested)) {
    workers_.reserve(static_cast<size_t>(requested_ - 1));
    for (int i = 1; i < requested_; ++i) {
      try {
        workers_.emplace_back([this, i] { WorkerLoop(i); });
      } catch (const std::exception&) {
        // The system refuses more threads (std::system_error, std::bad_alloc): run with those
        // that started. Throwing here would destroy wake_cv_ under waiting workers (a hang) and
        // then joinable std::threads (std::terminate).
        break;
      }
    }
    num_threads_ = 1 + static_cast<int>(workers_.size());
    claimed_ = std::make_unique<std::atomic<uint64_t>[]>(static_cast<size_t>(num_threads_));
    for (int b = 0; b < num_threads_; ++b) claimed_[b].store(0, std::memory_order_relaxed);
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(wake_mutex_);
      stop_ = true;
      Publish(0);
    }
    wake_cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  int requested() const { return requested_; }
  int num_threads() const { return num_threads_; }

  // Requires run_mutex_ held by the caller.
  void Run(int64_t num_tasks, int threads, TaskFn fn, void* context) {
    fn_ = fn;
    context_ = context;
    num_tasks_ = num_tasks;
    done_.store(0, std::memory_order_relaxed);
    uint64_t run;
    {
      std::lock_guard<std::mutex> lock(wake_mutex_);
      run = Publish(threads - 1);
    }
    wake_cv_.notify_all();
    DrainTasks(run, threads, 0);
    // Wait for the blocks that workers claimed, not for the workers: one that the system has not
    // scheduled yet finds every block claimed when it comes (the caller took them) and goes back
    // to waiting. Waiting for each worker to check in cost up to a scheduler time slice per run
    // while other processes held the cores (two busy loops beside fbn_bench: batch-1 calls of
    // 9-54 us took 0.5-0.6 ms).
    for (int spin = 0; done_.load(std::memory_order_acquire) != threads; ++spin) {
      if (spin > kSpinPolls) std::this_thread::yield();
    }
  }

  std::mutex run_mutex_;

 private:
  // Tasks are split into one contiguous block per thread of the run, and thread k runs block k:
  // repeated calls on the same shape then find their part of the data in their own core's cache
  // (as OpenMP's static schedule does for oneDNN); with dynamic claiming, rows migrated between
  // cores on every call and two threads were slower than one on cache-resident tensors. A thread
  // that finishes its block takes any block not yet claimed, so a late worker never stalls a run.
  //
  // Block b is claimed for run `run` by raising claimed_[b] from an older run's number to `run`.
  // That fails once the run has claimed it, and after the run completed (each of its blocks then
  // holds its number or a newer one), so a worker that comes late never runs a block twice or a
  // later run's block under its own run's shape; fn_, context_ and num_tasks_ are read only after
  // a claim succeeded, while the run waits for that block.
  void DrainTasks(uint64_t run, int threads, int self) {
    const bool was_inside = t_inside_pool_task;
    t_inside_pool_task = true;
    int ran = 0;
    for (int k = 0; k < threads; ++k) {
      const int b = (self + k) % threads;
      if (!Claim(b, run)) continue;
      const int64_t t0 = num_tasks_ * b / threads, t1 = num_tasks_ * (b + 1) / threads;
      for (int64_t t = t0; t < t1; ++t) fn_(context_, t);
      ++ran;
    }
    if (ran > 0) {
      hwy::FlushStream();  // see ParallelForRaw
      done_.fetch_add(ran, std::memory_order_acq_rel);
    }
    t_inside_pool_task = was_inside;
  }

  bool Claim(int block, uint64_t run) {
    std::atomic<uint64_t>& c = claimed_[block];
    uint64_t seen = c.load(std::memory_order_acquire);
    while (seen < run) {
      if (c.compare_exchange_weak(seen, run, std::memory_order_acq_rel)) return true;
    }
    return false;
  }

  // A run is published as one word, (generation << 16) | workers wanted, so a worker never pairs
  // one run's generation with another run's thread count. Returns the generation.
  uint64_t Publish(int workers) {
    const uint64_t generation = (state_.load(std::memory_order_relaxed) >> 16) + 1;
    state_.store((generation << 16) | static_cast<uint64_t>(workers), std::memory_order_release);
    return generation;
  }

  void WorkerLoop(int index) {
    // Start from the constructor's state (0), not a fresh load: a Run() may already have
    // published before this thread got scheduled, and must not be missed.
    uint64_t seen = 0;
    for (;;) {
      uint64_t now = seen;
      const auto spin_until = std::chrono::steady_clock::now() + kSpinTime;
      for (int poll = 1;; ++poll) {
        now = state_.load(std::memory_order_acquire);
        if (now != seen) break;
        CpuRelax();
        if (poll % 64 == 0 && std::chrono::steady_clock::now() >= spin_until) break;
      }
      if (now == seen) {
        std::unique_lock<std::mutex> lock(wake_mutex_);
        wake_cv_.wait(lock, [&] { return state_.load(std::memory_order_acquire) != seen; });
        now = state_.load(std::memory_order_acquire);
        if (stop_) return;
      }
      seen = now;
      if (static_cast<int>(now & 0xFFFF) < index) {
        // Not wanted by this run (or the pool is stopping).
        std::lock_guard<std::mutex> lock(wake_mutex_);
        if (stop_) return;
        continue;
      }
      DrainTasks(now >> 16, static_cast<int>(now & 0xFFFF) + 1, index);
    }
  }

  const int requested_;
  int num_threads_ = 1;  // the caller's thread and the workers that started
  std::vector<std::thread> workers_;
  std::mutex wake_mutex_;
  std::condition_variable wake_cv_;
  std::atomic<uint64_t> state_{0};
  bool stop_ = false;  // guarded by wake_mutex_

  TaskFn fn_ = nullptr;
  void* context_ = nullptr;
  int64_t num_tasks_ = 0;
  std::unique_ptr<std::atomic<uint64_t>[]> claimed_;  // per block: the run that claimed it last
  std::atomic<int> done_{0};                          // blocks of the current run completed
};

int DefaultThreadCount() {
  if (const char* env = std::getenv("FBN_NUM_THREADS")) {
    const int n = std::atoi(env);
    if (n > 0) return std::min(n, kMaxThreads);
  }
  const unsigned hardware = std::thread::hardware_concurrency();
  return static_cast<int>(std::clamp(hardware, 1u, static_cast<unsigned>(kMaxThreads)));
}

std::mutex g_config_mutex;
std::shared_ptr<Pool> g_pool;  // guarded by g_config_mutex
int g_num_threads = 0;         // 0: not yet decided

std::shared_ptr<Pool> CurrentPool() {
  std::lock_guard<std::mutex> lock(g_config_mutex);
  if (g_num_threads == 0) g_num_threads = DefaultThreadCount();
  if (!g_pool || g_pool->requested() != g_num_threads) {
    g_pool = std::make_shared<Pool>(g_num_threads);
  }
  return g_pool;
}

}  // namespace

void ParallelForRaw(int64_t num_tasks, int max_threads, TaskFn fn, void* context) {
  if (num_tasks <= 0) return;
  const int threads = static_cast<int>(std::min<int64_t>(max_threads, num_tasks));
  if (threads > 1 && !t_inside_pool_task) {
    std::shared_ptr<Pool> pool = CurrentPool();
    std::unique_lock<std::mutex> lock(pool->run_mutex_, std::try_to_lock);
    if (lock.owns_lock()) {
      pool->Run(num_tasks, std::min(threads, pool->num_threads()), fn, context);
      return;
    }
  }
  const bool was_inside = t_inside_pool_task;
  t_inside_pool_task = true;
  for (int64_t t = 0; t < num_tasks; ++t) fn(context, t);
  // Tasks may end in streaming (non-temporal) stores, which are weakly ordered: each thread fences
  // them once per run, before the run completes, rather than each task after its last store (an
  // sfence per 64 KB task, or per plane in the fused channels-first paths, waits for the
  // write-combining buffers to drain).
  hwy::FlushStream();
  t_inside_pool_task = was_inside;
}

int NumThreads() {
  std::lock_guard<std::mutex> lock(g_config_mutex);
  if (g_num_threads == 0) g_num_threads = DefaultThreadCount();
  return g_num_threads;
}

int ThreadsForWork(int64_t bytes) {
  const int n = NumThreads();
  const int64_t useful = std::max<int64_t>(1, bytes / kMinBytesPerExtraThread);
  return static_cast<int>(std::min<int64_t>(n, useful));
}

}  // namespace fbn::threading

namespace fbn {

void SetNumThreads(int n) {
  std::lock_guard<std::mutex> lock(threading::g_config_mutex);
  threading::g_num_threads =
      n > 0 ? std::min(n, threading::kMaxThreads) : threading::DefaultThreadCount();
}

int GetNumThreads() { return threading::NumThreads(); }

}  // namespace fbn
