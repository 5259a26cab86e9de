// Whether memory is already in the calling core's cache, measured by timing a few loads, and the
// cache topology facts the store heuristics need.
#ifndef FBN_SRC_KERNELS_CACHE_PROBE_H_
#define FBN_SRC_KERNELS_CACHE_PROBE_H_

namespace fbn::kernels {

constexpr int kProbeLines = 4;

// True when the cache lines at lines[0..kProbeLines) load at cache-hit speed on this core; false
// when they come from DRAM or another core's cache, or when the thread was preempted meanwhile.
// A heuristic for choosing between stores of the same values, never for a result. Each pointer
// must have one more readable byte after it.
bool LinesInCoreCache(const void* const* lines);

// The size of the calling core's L3 where it is a victim cache of its core complex's L2s (AMD Zen,
// read from CPUID leaf 0x8000001D); 0 on other CPUs, whose L3 the heuristics do not count on.
double VictimL3Bytes();

}  // namespace fbn::kernels

#endif  // FBN_SRC_KERNELS_CACHE_PROBE_H_
