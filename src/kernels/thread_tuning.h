// Per-shape choice between one thread and all threads for small calls, by their measured times.
#ifndef FBN_SRC_KERNELS_THREAD_TUNING_H_
#define FBN_SRC_KERNELS_THREAD_TUNING_H_

#include <chrono>
#include <cstdint>

#include "kernels/batch_norm_kernels.h"

namespace fbn::kernels {

// Whether a small call gains from a second thread depends on what the threads' hand-over costs
// (cache lines moving between cores, waking a worker), and on a shared VM that changes from second
// to second with the host. Batch-1 ResNet-50 calls of 0.1-2.4 MB took 1.5-3x as long on two
// threads as on one in some stretches of time and half as long in others, even within one process
// (fbn_bench, 2-vCPU Zen 4 VM: 1x7x7x512 float training forward 17 or 6 us on two threads, a
// steady 5.2 us on one; 1x7x7x2048 bfloat16 inference 18-22 or 7.4 us on two, 9.2 on one).
//
// So such calls time themselves: per shape, each calling thread keeps how long the call lately
// took on one thread and on all threads, runs the faster, and retries the other now and then. The
// first calls after a switch are not timed: they move the data between the cores' caches. Task
// partitions depend on the shape only, so the choice never changes a result; FBN_TUNE_THREADS=0
// turns it off (always all threads).
class ThreadTuning {
 public:
  // Calls moving more than this use all threads without timing.
  static constexpr int64_t kMaxTraffic = 4 << 20;

  // The public kernel entries, told apart in a shape's key.
  enum class Entry {
    kStats,
    kApply,
    kBackwardReduce,
    kFrozenBackward,
    kBackwardApply,
    kForwardTraining,
    kBackwardTraining,
  };

  // Opens a tuned call at `entry` on g; calls nested in it (a transposed layout's recursion) take
  // part in the outer one.
  ThreadTuning(Entry entry, DataType dtype, const Geometry& g);
  ~ThreadTuning();
  ThreadTuning(const ThreadTuning&) = delete;
  ThreadTuning& operator=(const ThreadTuning&) = delete;

  // The threads a part of the current call uses, given the count it would use untuned and its
  // memory traffic. Outside a tuned call: `threads`.
  static int Threads(int threads, int64_t traffic);

  struct Shape;  // what a calling thread remembers of a shape (thread_tuning.cc)

 private:
  Shape& Begin();

  uint64_t key_ = 0;        // the shape's; 0: not the outermost tuned call, or tuning off
  Shape* shape_ = nullptr;  // set by the call's first part that would use several threads
  std::chrono::steady_clock::time_point start_;
};

}  // namespace fbn::kernels

#endif  // FBN_SRC_KERNELS_THREAD_TUNING_H_
