// The cache probe that chooses streaming stores: lines just written read as cached, lines
// flushed from every level read as missing. Timing-based, so each side needs one clear answer
// out of several tries (a preemption can make a cached probe look slow, never a flushed one
// fast).
#include "kernels/cache_probe.h"

#include <gtest/gtest.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <cstring>
#include <vector>

namespace {

using fbn::kernels::kProbeLines;
using fbn::kernels::LinesInCoreCache;

constexpr int kTries = 20;

struct Lines {
  std::vector<unsigned char> buffer = std::vector<unsigned char>(256 * 1024);
  const void* at[kProbeLines];
  Lines() {
    for (int k = 0; k < kProbeLines; ++k) at[k] = buffer.data() + k * (buffer.size() / 4) + 64;
  }
};

TEST(CacheProbe, LinesJustWrittenAreCached) {
  Lines lines;
  int cached = 0;
  for (int i = 0; i < kTries; ++i) {
    std::memset(lines.buffer.data(), i, 4096);
    for (const void* p : lines.at) std::memset(const_cast<void*>(p), i, 64);
    cached += LinesInCoreCache(lines.at);
  }
  EXPECT_GT(cached, 0);
}

#if defined(__x86_64__) || defined(__i386__)
TEST(CacheProbe, FlushedLinesAreMissing) {
  Lines lines;
  int missing = 0;
  for (int i = 0; i < kTries; ++i) {
    for (const void* p : lines.at) {
      std::memset(const_cast<void*>(p), i, 64);
      _mm_clflush(p);
    }
    _mm_mfence();
    missing += !LinesInCoreCache(lines.at);
  }
  EXPECT_GT(missing, 0);
}
#endif

}  // namespace
