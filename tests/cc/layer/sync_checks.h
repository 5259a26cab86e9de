// Checks of synchronized batch normalization shared by the in-process test (ranks are threads,
// synchronized_test.cc) and the MPI test (ranks are processes under mpirun, tests/mpi). Every
// rank generates the same global batch from a seed, runs the synchronized layer or op on its part,
// and compares with the unsynchronized layer or op on the whole batch, which it also runs.
#ifndef FBN_TESTS_CC_LAYER_SYNC_CHECKS_H_
#define FBN_TESTS_CC_LAYER_SYNC_CHECKS_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "fbn/distributed.h"
#include "fbn/layer.h"
#include "fbn/tensor.h"

namespace fbn::sync_test {

// Ranks as threads of one process: Allgather is two barriers around a shared table. Byte counts
// that differ between ranks (undefined behaviour in MPI) and waits beyond a deadline are reported
// as errors, so a protocol bug fails a test instead of corrupting memory or hanging it.
class ThreadGroup {
 public:
  explicit ThreadGroup(int size);
  int size() const { return size_; }
  Status Allgather(int rank, const void* send, int64_t bytes, void* recv);

 private:
  Status Barrier(std::unique_lock<std::mutex>& lock);

  const int size_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  std::vector<std::vector<char>> slots_;
};

class ThreadCommunicator final : public Communicator {
 public:
  ThreadCommunicator(ThreadGroup* group, int rank) : group_(group), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  Status Allgather(const void* send, int64_t bytes, void* recv) noexcept override {
    return group_->Allgather(rank_, send, bytes, recv);
  }

 private:
  ThreadGroup* group_;
  int rank_;
};

// Runs body(comm) on `ranks` threads, each with its own ThreadCommunicator of one group.
void RunOnThreads(int ranks, const std::function<void(Communicator&)>& body);

// Forwards to another communicator and counts the collective calls.
class CountingCommunicator final : public Communicator {
 public:
  explicit CountingCommunicator(Communicator* inner) : inner_(inner) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  Status Allgather(const void* send, int64_t bytes, void* recv) noexcept override {
    ++calls_;
    return inner_->Allgather(send, bytes, recv);
  }
  int64_t calls() const { return calls_; }

 private:
  Communicator* inner_;
  int64_t calls_ = 0;
};

// Every rank's copy of `local` (same size everywhere), in rank order.
std::vector<double> AllgatherDoubles(Communicator& comm, const std::vector<double>& local);

// How the global batch is split: every rank the same size, different sizes, or with an empty
// part, or one sample per rank.
enum class Split { kEqual, kUnequal, kEmptyPart, kOnePerRank };
std::vector<int64_t> PartSizes(Split split, int ranks);
const char* SplitName(Split split);

struct LayerCase {
  std::string name;
  BatchNormalizationOptions options;  // synchronized and communicator are set by the check
  DataType dtype = DataType::kFloat32;
  Shape feature_shape;  // the input shape without the batch dimension
  double tol = 1e-5;    // |a - b| <= tol · (1 + |b|)
};

// The synchronized layer's cases: fused and general paths, ranks 2 to 5, channels first and last,
// multiple axes, float16/float32/float64, renorm, adjustment, ghost batches, no gamma/beta, and a
// channel count above kSyncInlineChannels (two collective calls per pass).
std::vector<LayerCase> LayerCases();

// Two training steps (forward and backward) and an inference call of a synchronized layer on
// this rank's part of the global batch, against the layer on the whole batch: outputs, dx, the
// rank-order sum of dgamma/dbeta, every moving statistic (bit-identical on every rank), and a
// bit-identical rerun. Also checks the number of collective calls per pass.
void CheckLayerCase(Communicator& comm, const LayerCase& c, Split split);

// SyncFusedBatchNorm / SyncFusedBatchNormGrad against FusedBatchNorm / FusedBatchNormGrad on the
// whole batch (V3 and V2, channels last and first, float32/float16/float64, with and without
// exponential_avg_factor).
void CheckOpCases(Communicator& comm, Split split);

// A group of one: the synchronized layer is the plain layer bit for bit, with no collective call.
void CheckSingleMember(Communicator& comm);

// Mismatches and failures: every rank gets an error (none waits forever), and the group goes on
// working afterwards.
void CheckChannelMismatch(Communicator& comm);
void CheckDtypeMismatch(Communicator& comm);
void CheckCallOrderMismatch(Communicator& comm);
void CheckLocalFailurePropagates(Communicator& comm);
void CheckOpFailurePropagates(Communicator& comm);

}  // namespace fbn::sync_test

#endif  // FBN_TESTS_CC_LAYER_SYNC_CHECKS_H_
