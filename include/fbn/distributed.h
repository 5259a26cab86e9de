// Synchronized (cross-process) batch normalization: each member of a group of processes holds part
// of one batch, and the batch statistics are those of the whole (global) batch.
//
//   Communicator            the group: rank, size, and an allgather of bytes. fbn::mpi (fbn/mpi.h,
//                           target fbn::mpi) provides one over an MPI_Comm; any engine can be
//                           plugged in by implementing the three methods.
//   SyncFusedBatchNorm      FusedBatchNorm over the global batch, each rank on its own part.
//   SyncFusedBatchNormGrad  FusedBatchNormGrad likewise.
//   BatchNormalizationOptions::synchronized (fbn/layer.h) uses the same exchange in the layer.
//
// Protocol. A synchronized pass makes one collective call: an allgather of a fixed-size record
// (kSyncRecordBytes) that holds a header (pass, dtype, channel count, tag, the rank's element count
// per channel) and the rank's per-channel partials (forward: mean and centred sum of squares;
// backward: Σdy and Σdy·(x - mean)). Every rank checks every header, so all ranks reach the same
// verdict: a mismatch (channel count, dtype, pass, tag) or a rank that failed before its exchange
// is an error on every rank, never a hang or a silent mix. Partials that do not fit the record
// (more than kSyncInlineChannels channels) follow in a second allgather whose size every rank takes
// from the headers it has already checked: a size computed from local shapes alone could differ
// between ranks, and MPI does not detect collectives with mismatched counts.
//
// Merging. Each rank merges the gathered partials in rank order with Chan's formula, weighted by
// each rank's count, so unequal and empty local batches are exact and every rank computes
// bit-identical statistics (an allreduce with a reduction op may combine in any order). One
// process (size() == 1) makes no collective call and gives the unsynchronized results bit for bit.
//
// Collective calls: every rank must make the same sequence of synchronized calls (training
// forward, training backward), as with any collective; a rank that skips one leaves the others
// waiting. The calls are made from the calling thread.
#ifndef FBN_DISTRIBUTED_H_
#define FBN_DISTRIBUTED_H_

#include <cstdint>
#include <memory>

#include "fbn/export.h"
#include "fbn/ops.h"
#include "fbn/status.h"

namespace fbn {

class FBN_API Communicator {
 public:
  virtual ~Communicator();
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Gathers `bytes` bytes from every member: `recv` (size()·bytes bytes) receives member r's at
  // offset r·bytes. A collective: every member calls it, in the same order, with the same `bytes`.
  virtual Status Allgather(const void* send, int64_t bytes, void* recv) noexcept = 0;
};

// A group of one: rank 0 of 1, no communication. What a synchronized layer in a single process
// needs when no communication library is at hand.
FBN_API std::shared_ptr<Communicator> SingleProcessCommunicator();

// The communicator of a synchronized layer built without one: the installed factory's, or null
// when none is installed. Linking fbn::mpi and including fbn/mpi.h installs MPI_COMM_WORLD.
using CommunicatorFactory = std::shared_ptr<Communicator> (*)();
FBN_API void SetDefaultCommunicatorFactory(CommunicatorFactory factory) noexcept;
// Throws fbn::Error (InvalidArgument) when no factory is installed; the factory's errors pass.
FBN_API std::shared_ptr<Communicator> DefaultCommunicator();

// Size of the record every synchronized pass gathers, and the channel count whose partials fit in
// it (two doubles per channel after a 128-byte header): up to this many channels a pass is one
// collective call, above it two. 3968 bytes stays below the 4 KiB eager limit of Open MPI's
// shared-memory transport (which counts its own header): a 4096-byte record takes the rendezvous
// protocol and costs about 40% more per allgather.
inline constexpr int64_t kSyncRecordBytes = 3968;
inline constexpr int64_t kSyncInlineChannels = (kSyncRecordBytes - 128) / 16;

// FusedBatchNorm (fbn/ops.h) over the concatenation of every rank's x along the batch dimension:
// this rank's y, and batch statistics of the global batch (batch_variance Bessel-corrected with the
// global count, blended with `variance` unless exponential_avg_factor == 1; reserve spaces as
// FusedBatchNormGrad/SyncFusedBatchNormGrad want them), identical on every rank. Ranks may hold
// different batch sizes, including 0; the global batch must not be empty for finite statistics
// (an empty global batch gives NaN, as FusedBatchNorm does). `tag` is compared across ranks (e.g.
// a layer index or step counter): ranks that pass different tags get an error. With
// is_training=false nothing is exchanged and this is FusedBatchNorm. A collective call in training
// (see above); a rank whose arguments fail validation still takes part, so every rank returns an
// error ("rank 1 failed: ...").
FBN_API Status SyncFusedBatchNorm(Communicator& comm, OpVersion version,
                                  const FusedBatchNormInputs& inputs,
                                  const FusedBatchNormAttrs& attrs,
                                  const FusedBatchNormOutputs& outputs, uint64_t tag = 0) noexcept;

// FusedBatchNormGrad over the global batch, for the statistics SyncFusedBatchNorm produced: this
// rank's x_backprop uses the global Σdy and Σdy·(x - mean). scale_backprop and offset_backprop are
// this rank's contributions (their sum over the ranks is the gradient of the global batch), which
// is what a data-parallel optimizer that all-reduces parameter gradients expects: reducing them
// here too would count them twice. With is_training=false nothing is exchanged.
FBN_API Status SyncFusedBatchNormGrad(Communicator& comm, OpVersion version,
                                      const FusedBatchNormGradInputs& inputs,
                                      const FusedBatchNormGradAttrs& attrs,
                                      const FusedBatchNormGradOutputs& outputs,
                                      uint64_t tag = 0) noexcept;

}  // namespace fbn

#endif  // FBN_DISTRIBUTED_H_
