// Whether memory is already in the calling core's cache, measured by timing a few loads, and the
// cache topology facts the store heuristics need.
#ifndef FBN_SRC_KERNELS_CACHE_PROBE_H_
#define FBN_SRC_KERNELS_CACHE_PROBE_H_

#include <cstdint>

namespace fbn::kernels {

constexpr int kProbeLines = 4;

// How long the cache lines at lines[0..kProbeLines) take to load one after another on this core,
// in nanoseconds (the clock reads included). A heuristic for choosing between stores of the same
// values, never for a result. Each pointer must have one more readable byte after it.
int64_t ChainedLoadNanoseconds(const void* const* lines);

// Whether such a time means that the lines were in this core's cache: not when they came from
// DRAM or another core's cache, or when the thread was preempted meanwhile.
bool LoadedFromCoreCache(int64_t nanoseconds);

// Whether such a time means that every line came from DRAM. Lines of a tensor larger than the L3
// that is partly cached, or cached in the other core complex's L3, load in between.
bool LoadedFromDram(int64_t nanoseconds);

// The size of the calling core's L3 where it is a victim cache of its core complex's L2s (AMD Zen,
// read from CPUID leaf 0x8000001D); 0 on other CPUs, whose L3 the heuristics do not count on.
double VictimL3Bytes();

}  // namespace fbn::kernels

#endif  // FBN_SRC_KERNELS_CACHE_PROBE_H_
