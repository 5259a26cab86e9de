// The cache probe that chooses streaming stores: lines just written read as cached, lines
// flushed from every level read as missing. Timing-based, so each side needs one clear answer
// out of several tries (a preemption can make a cached probe look slow, never a flushed one
// fast). How slow DRAM is depends on the machine, so no test asks for a DRAM verdict.
#include "kernels/cache_probe.h"

#include <gtest/gtest.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <cstring>
#include <fstream>
#include <string>
#include <vector>

namespace {

using fbn::kernels::ChainedLoadNanoseconds;
using fbn::kernels::kProbeLines;
using fbn::kernels::LoadedFromCoreCache;
using fbn::kernels::LoadedFromDram;
using fbn::kernels::VictimL3Bytes;

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
    const int64_t ns = ChainedLoadNanoseconds(lines.at);
    cached += LoadedFromCoreCache(ns) && !LoadedFromDram(ns);
  }
  EXPECT_GT(cached, 0);
}

TEST(CacheProbe, TheVerdictsNeverOverlap) {
  for (int64_t ns = 0; ns < 100000; ns += 7) {
    EXPECT_FALSE(LoadedFromCoreCache(ns) && LoadedFromDram(ns)) << ns;
  }
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
    missing += !LoadedFromCoreCache(ChainedLoadNanoseconds(lines.at));
  }
  EXPECT_GT(missing, 0);
}
#endif

// Linux's view of the same caches: cpu0's level-3 cache size in bytes, 0 when sysfs has none.
double SysfsL3Bytes() {
  for (int i = 0; i < 8; ++i) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
    int level = 0;
    std::string size;
    if (!(std::ifstream(dir + "level") >> level) || level != 3) continue;
    if (!(std::ifstream(dir + "size") >> size) || size.empty()) return 0;
    const double scale = size.back() == 'K' ? 1024.0 : size.back() == 'M' ? 1048576.0 : 1.0;
    return std::stod(size) * scale;
  }
  return 0;
}

bool CpuIsAmd() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("vendor_id", 0) == 0) return line.find("AuthenticAMD") != std::string::npos;
  }
  return false;
}

TEST(CacheTopology, VictimL3IsTheAmdL3AndNothingElsewhere) {
  if (!CpuIsAmd()) {
    EXPECT_EQ(VictimL3Bytes(), 0.0);
    return;
  }
  const double sysfs = SysfsL3Bytes();
  if (sysfs == 0) GTEST_SKIP() << "no L3 in sysfs to compare with";
  EXPECT_EQ(VictimL3Bytes(), sysfs);
}

}  // namespace
