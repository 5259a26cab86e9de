#include "distributed/exchange.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <new>
#include <string>

namespace fbn::distributed {
namespace {

constexpr uint32_t kMagic = 0x534E4246;  // "FBNS" in memory on little-endian machines
constexpr uint16_t kVersion = 1;
constexpr uint16_t kFailure = 0xFFFF;

// The fixed part of a record. Plain bytes: every rank runs the same fbn build.
struct Header {
  uint32_t magic;
  uint16_t version;
  uint16_t pass;  // Pass, or kFailure
  int32_t dtype;
  int32_t reserved;
  int64_t channels;
  int64_t count;
  uint64_t tag;
  char message[88];  // a failure's text, truncated, NUL-terminated
};
static_assert(sizeof(Header) == 128, "the record layout assumes a 128-byte header");
constexpr int64_t kInlineDoubles = (kSyncRecordBytes - 128) / 8;
static_assert(kSyncInlineChannels * 2 == kInlineDoubles, "fbn/distributed.h's constant");

Header MakeHeader(const PassInfo& info, int64_t count) {
  Header h;
  std::memset(&h, 0, sizeof(h));
  h.magic = kMagic;
  h.version = kVersion;
  h.pass = static_cast<uint16_t>(info.pass);
  h.dtype = static_cast<int32_t>(info.dtype);
  h.channels = info.channels;
  h.count = count;
  h.tag = info.tag;
  return h;
}

const char* PassName(uint16_t pass) {
  switch (pass) {
    case static_cast<uint16_t>(Pass::kForward):
      return "forward (statistics)";
    case static_cast<uint16_t>(Pass::kBackward):
      return "backward (gradient sums)";
    default:
      return "unknown";
  }
}

std::string Describe(int rank, const Header& h) {
  const bool known_dtype = h.dtype >= 0 && h.dtype <= 3;
  return "rank " + std::to_string(rank) + ": " + PassName(h.pass) + " pass, " +
         std::to_string(h.channels) + " channels, " +
         (known_dtype ? DataTypeName(static_cast<DataType>(h.dtype)) : "unknown dtype") + ", tag " +
         std::to_string(h.tag);
}

// The verdict every rank reaches from the same headers.
Status Check(const std::vector<char>& records, int ranks) {
  std::vector<Header> h(static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    std::memcpy(&h[static_cast<size_t>(r)],
                records.data() + static_cast<size_t>(r) * kSyncRecordBytes, sizeof(Header));
  }
  for (int r = 0; r < ranks; ++r) {
    const Header& x = h[static_cast<size_t>(r)];
    if (x.magic != kMagic || x.version != kVersion) {
      return InvalidArgument(
          "synchronized batch normalization: rank " + std::to_string(r) +
          " sent data that is not a synchronized batch-normalization record of this fbn version; "
          "another collective operation on the same communicator is out of step with this one");
    }
  }
  for (int r = 0; r < ranks; ++r) {
    const Header& x = h[static_cast<size_t>(r)];
    if (x.pass == kFailure) {
      std::string text(x.message, strnlen(x.message, sizeof(x.message)));
      return InvalidArgument("synchronized batch normalization: rank " + std::to_string(r) +
                             " failed: " + text);
    }
  }
  const Header& first = h[0];
  for (int r = 1; r < ranks; ++r) {
    const Header& x = h[static_cast<size_t>(r)];
    if (x.pass != first.pass || x.dtype != first.dtype || x.channels != first.channels ||
        x.tag != first.tag) {
      return InvalidArgument(
          "synchronized batch normalization: the ranks disagree (" + Describe(0, first) + "; " +
          Describe(r, x) +
          "). Every rank must make the same synchronized calls in the same order, with the same "
          "channel count and dtype");
    }
  }
  for (int r = 0; r < ranks; ++r) {
    const Header& x = h[static_cast<size_t>(r)];
    if (x.count < 0 || x.channels < 0) {
      return InvalidArgument("synchronized batch normalization: rank " + std::to_string(r) +
                             " sent a negative count");
    }
  }
  return Status::Ok();
}

}  // namespace

Status Exchange(Communicator& comm, const PassInfo& info, int64_t count, const double* partials,
                Gathered* out) noexcept {
  try {
    const int ranks = comm.size();
    const int64_t n = 2 * info.channels;
    const bool inline_partials = n <= kInlineDoubles;
    std::vector<char> record(static_cast<size_t>(kSyncRecordBytes), 0);
    const Header h = MakeHeader(info, count);
    std::memcpy(record.data(), &h, sizeof(h));
    if (inline_partials && n > 0) {
      std::memcpy(record.data() + sizeof(Header), partials,
                  static_cast<size_t>(n) * sizeof(double));
    }
    std::vector<char> all(static_cast<size_t>(ranks) * static_cast<size_t>(kSyncRecordBytes));
    Status s = comm.Allgather(record.data(), kSyncRecordBytes, all.data());
    if (!s.ok()) return s;
    if (!(s = Check(all, ranks)).ok()) return s;

    out->ranks = ranks;
    out->channels = info.channels;
    out->counts.resize(static_cast<size_t>(ranks));
    out->partials.resize(static_cast<size_t>(ranks) * static_cast<size_t>(n));
    for (int r = 0; r < ranks; ++r) {
      const char* rec = all.data() + static_cast<size_t>(r) * kSyncRecordBytes;
      Header hr;
      std::memcpy(&hr, rec, sizeof(hr));
      out->counts[static_cast<size_t>(r)] = hr.count;
      if (inline_partials && n > 0) {
        std::memcpy(out->partials.data() + static_cast<size_t>(r) * static_cast<size_t>(n),
                    rec + sizeof(Header), static_cast<size_t>(n) * sizeof(double));
      }
    }
    if (!inline_partials) {
      // Every rank checked the same headers, so every rank posts this with the same size.
      const int64_t bytes = n * static_cast<int64_t>(sizeof(double));
      s = comm.Allgather(partials, bytes, out->partials.data());
      if (!s.ok()) return s;
    }
    return Status::Ok();
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kResourceExhausted, "fbn could not allocate working memory");
  }
}

void ExchangeFailure(Communicator& comm, const PassInfo& info,
                     const std::string& message) noexcept {
  try {
    std::vector<char> record(static_cast<size_t>(kSyncRecordBytes), 0);
    Header h = MakeHeader(info, 0);
    h.pass = kFailure;
    const size_t len = std::min(message.size(), sizeof(h.message) - 1);
    std::memcpy(h.message, message.data(), len);
    std::memcpy(record.data(), &h, sizeof(h));
    std::vector<char> all(static_cast<size_t>(comm.size()) * static_cast<size_t>(kSyncRecordBytes));
    (void)comm.Allgather(record.data(), kSyncRecordBytes, all.data());
  } catch (...) {
    // Best effort: this rank reports its own error either way.
  }
}

void MergeMoments(const Gathered& g, double* mean, double* m2, int64_t* total) {
  const int64_t C = g.channels;
  const size_t stride = static_cast<size_t>(2 * C);
  std::fill(mean, mean + C, 0.0);
  std::fill(m2, m2 + C, 0.0);
  // Every channel of a rank has the same count, so the merge weights are per rank.
  double n = 0;
  int64_t n_total = 0;
  for (int r = 0; r < g.ranks; ++r) {
    n_total += g.counts[static_cast<size_t>(r)];
    const double nb = static_cast<double>(g.counts[static_cast<size_t>(r)]);
    if (nb == 0) continue;
    const double* p = g.partials.data() + static_cast<size_t>(r) * stride;
    const double t = n + nb;
    const double w_mean = nb / t, w_m2 = n * nb / t;
    for (int64_t c = 0; c < C; ++c) {
      const double delta = p[c] - mean[c];
      mean[c] += delta * w_mean;
      m2[c] += p[C + c] + delta * delta * w_m2;
    }
    n = t;
  }
  *total = n_total;
}

void SumPartials(const Gathered& g, double* a, double* b, int64_t* total) {
  const int64_t C = g.channels;
  const size_t stride = static_cast<size_t>(2 * C);
  std::fill(a, a + C, 0.0);
  std::fill(b, b + C, 0.0);
  int64_t n = 0;
  for (int r = 0; r < g.ranks; ++r) {
    n += g.counts[static_cast<size_t>(r)];
    const double* p = g.partials.data() + static_cast<size_t>(r) * stride;
    for (int64_t c = 0; c < C; ++c) {
      a[c] += p[c];
      b[c] += p[C + c];
    }
  }
  *total = n;
}

}  // namespace fbn::distributed
