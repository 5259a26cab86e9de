// The exchange behind every synchronized pass (see fbn/distributed.h): a fixed-size record per
// rank with a header and the per-channel partials, gathered in one collective call (two when the
// partials do not fit the record), checked on every rank, then merged in rank order. Internal.
#ifndef FBN_DISTRIBUTED_EXCHANGE_H_
#define FBN_DISTRIBUTED_EXCHANGE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "fbn/distributed.h"
#include "fbn/types.h"

namespace fbn::distributed {

enum class Pass : uint16_t { kForward = 1, kBackward = 2 };

// What every rank must agree on.
struct PassInfo {
  Pass pass = Pass::kForward;
  DataType dtype = DataType::kFloat32;
  int64_t channels = 0;  // statistics slots: 2·channels partials per rank
  uint64_t tag = 0;
};

// The partials of every rank, in rank order.
struct Gathered {
  int ranks = 0;
  int64_t channels = 0;
  std::vector<int64_t> counts;   // elements per channel on each rank
  std::vector<double> partials;  // rank r's 2·channels values at r·2·channels
};

// Contributes this rank's `count` (elements per channel) and 2·info.channels `partials`. Every rank
// gets the same `out`, or the same error: ranks that disagree on `info`, or a rank that sent a
// failure (ExchangeFailure). Communicator errors are returned as they are.
Status Exchange(Communicator& comm, const PassInfo& info, int64_t count, const double* partials,
                Gathered* out) noexcept;

// Takes part in a pass this rank could not compute (its arguments failed validation), so that the
// others fail with "rank <r> failed: <message>" instead of waiting.
void ExchangeFailure(Communicator& comm, const PassInfo& info, const std::string& message) noexcept;

// Chan's parallel merge, in rank order, of per-rank (count, mean, M2) with partials laid out as
// [mean[0..C), m2[0..C)]; ranks with count 0 contribute nothing. `mean`/`m2` get C values each.
void MergeMoments(const Gathered& g, double* mean, double* m2, int64_t* total);

// Sums, in rank order, of partials laid out as [a[0..C), b[0..C)].
void SumPartials(const Gathered& g, double* a, double* b, int64_t* total);

}  // namespace fbn::distributed

#endif  // FBN_DISTRIBUTED_EXCHANGE_H_
