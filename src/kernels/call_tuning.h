// Per-shape choices between a call's default and one alternative, by the calls' measured times:
// one thread instead of all for small calls, regular stores instead of streaming ones for outputs
// near the size of the L3.
#ifndef FBN_SRC_KERNELS_CALL_TUNING_H_
#define FBN_SRC_KERNELS_CALL_TUNING_H_

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
// Likewise whether a call that touches one to two L3s' worth of memory, and would stream its
// output (beyond the share of the L3 it may keep, or with its input found partly out of cache),
// does better keeping it with regular stores depends on what the L3s hold and whether the two
// cores share one, which a few timed loads cannot tell (KeepOutput; TunedKeep in the driver).
//
// So such calls time themselves: per shape, each calling thread keeps how long the call lately
// took with the default and with the alternative, runs the faster, and retries the other now and
// then. The first calls after a switch are not timed: they move the data between the cores'
// caches. Task partitions depend on the shape only and stores write the same values either way,
// so a choice never changes a result; FBN_TUNE_THREADS=0 turns the thread choice off (always all
// threads), FBN_TUNE_STORES=0 the store choice (always streaming).
class CallTuning {
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
  CallTuning(Entry entry, DataType dtype, const Geometry& g);
  ~CallTuning();
  CallTuning(const CallTuning&) = delete;
  CallTuning& operator=(const CallTuning&) = delete;

  // The threads a part of the current call uses, given the count it would use untuned and its
  // memory traffic. Outside a tuned call: `threads`.
  static int Threads(int threads, int64_t traffic);

  // Whether the current call keeps an output that it would otherwise stream (regular stores);
  // asked only of outputs the caller could keep in cache. Outside a tuned call, or once the call
  // asked the thread question: false.
  static bool KeepOutput();

  // What a call chooses: its threads (Threads) or its stores (KeepOutput).
  enum class Question { kThreads, kStores };
  struct Shape;  // what a calling thread remembers of a shape (call_tuning.cc)

 private:
  Shape& Begin(Question question);
  // The current call's choice for `question`: true for the alternative.
  static bool Alternative(Question question);

  uint64_t key_ = 0;        // the shape's; 0: not the outermost tuned call, or tuning off
  Shape* shape_ = nullptr;  // set by the call's first question
  std::chrono::steady_clock::time_point start_;
};

}  // namespace fbn::kernels

#endif  // FBN_SRC_KERNELS_CALL_TUNING_H_
