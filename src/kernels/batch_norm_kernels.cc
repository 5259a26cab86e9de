// Batch-norm kernels, written once against Highway and compiled per SIMD target (foreach_target),
// plus the target-independent orchestration: task partitioning, threading and ordered merging.
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/batch_norm_kernels.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Must come after foreach_target.h.
#include "hwy/cache_control.h"
#include "hwy/highway.h"
#include "kernels/batch_norm_kernels.h"
#include "kernels/cache_probe.h"
#include "kernels/convert.h"
#include "kernels/kernel_table.h"

HWY_BEFORE_NAMESPACE();
namespace fbn::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// ------------------------------------------------------------------------------------------------
// Vector loads and stores of storage type T as vectors of Acc<T>.

template <typename T>
using AccTag = hn::ScalableTag<Acc<T>>;

// F16C converts half <-> float exactly and rounds to nearest even. Highway 1.0.3's emulated
// conversions (the portable fallback targets) mishandle inf/NaN on load and truncate on store, so
// those targets convert lane by lane with the scalar routines of convert.h.
#undef FBN_HW_F16
#if HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
#define FBN_HW_F16 1
#else
#define FBN_HW_F16 0
#endif

template <class D>
HWY_INLINE hn::Vec<D> LoadAcc(D d, const float* p) {
  return hn::LoadU(d, p);
}
template <class D>
HWY_INLINE hn::Vec<D> LoadAcc(D d, const double* p) {
  return hn::LoadU(d, p);
}
template <class D>
HWY_INLINE hn::Vec<D> LoadAcc(D d, const Half* p) {
#if FBN_HW_F16
  const hn::Rebind<hwy::float16_t, D> dh;
  return hn::PromoteTo(d, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(p)));
#else
  HWY_ALIGN float lanes[hn::MaxLanes(d)];
  for (size_t i = 0; i < hn::Lanes(d); ++i) lanes[i] = ToFloat(p[i]);
  return hn::Load(d, lanes);
#endif
}
template <class D>
HWY_INLINE hn::Vec<D> LoadAcc(D d, const BFloat16* p) {
  const hn::Rebind<uint16_t, D> du16;
  const hn::RebindToUnsigned<D> du32;
  const auto bits = hn::PromoteTo(du32, hn::LoadU(du16, reinterpret_cast<const uint16_t*>(p)));
  return hn::BitCast(d, hn::ShiftLeft<16>(bits));
}

#undef FBN_HW_BF16
#if HWY_ARCH_X86_64 && (HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL)
#define FBN_HW_BF16 1
// AVX512-BF16 (Cooper Lake, Sapphire Rapids, Zen 4) converts float to bfloat16 rounding to nearest
// even in one instruction, exactly as BFloat16Bits below (NaN: the high half with the quiet bit
// set), except that it flushes subnormal inputs to zero, which TensorFlow's rounding keeps: vectors
// with a subnormal lane take the integer rounding. Highway 1.0 has no target with the extension,
// so the instructions are written as inline assembly (no compiler flag needed) and chosen at run
// time. The integer rounding made bfloat16 writers compute-bound: 1x7x7x2048 bfloat16 inference
// took as long as float32 on one thread.
inline const bool kHardwareBF16 = [] {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16") != 0;
}();

// Lanes of v that are subnormal.
HWY_INLINE __mmask16 SubnormalLanes(__m512 v) { return _mm512_fpclass_ps_mask(v, 0x20); }
#endif

// bfloat16 bits of v, rounded to nearest even; NaN stays a (quiet) NaN.
template <class D>
HWY_INLINE hn::Vec<hn::Rebind<uint16_t, D>> BFloat16Bits(D /*d*/, hn::Vec<D> v) {
#if FBN_HW_BF16
  if constexpr (hn::MaxLanes(D()) == 16) {
    if (kHardwareBF16 && SubnormalLanes(v.raw) == 0) {
      __m256i r;
      asm("vcvtneps2bf16 %1, %0" : "=v"(r) : "v"(v.raw));
      return hn::Vec<hn::Rebind<uint16_t, D>>{r};
    }
  }
#endif
  const hn::RebindToUnsigned<D> du32;
  const hn::RebindToSigned<D> di32;
  const hn::Rebind<uint16_t, D> du16;
  const auto bits = hn::BitCast(du32, v);
  const auto lsb = hn::And(hn::ShiftRight<16>(bits), hn::Set(du32, 1u));
  auto rounded = hn::ShiftRight<16>(hn::Add(bits, hn::Add(hn::Set(du32, 0x7FFFu), lsb)));
  const auto quiet_nan = hn::Or(hn::ShiftRight<16>(bits), hn::Set(du32, 0x40u));
  rounded = hn::IfThenElse(hn::RebindMask(du32, hn::IsNaN(v)), quiet_nan, rounded);
  return hn::DemoteTo(du16, hn::BitCast(di32, rounded));
}

// Stores v to p as T. With `stream`, p must be aligned to the stored vector's size and the store
// bypasses the cache (for outputs larger than the last-level cache: no read-for-ownership).
template <class D>
HWY_INLINE void StoreAcc(D d, hn::Vec<D> v, float* p, bool stream = false) {
  if (stream) {
    hn::Stream(v, d, p);
  } else {
    hn::StoreU(v, d, p);
  }
}
template <class D>
HWY_INLINE void StoreAcc(D d, hn::Vec<D> v, double* p, bool stream = false) {
  if (stream) {
    hn::Stream(v, d, p);
  } else {
    hn::StoreU(v, d, p);
  }
}
template <class D>
HWY_INLINE void StoreAcc(D d, hn::Vec<D> v, Half* p, bool stream = false) {
#if FBN_HW_F16
  const hn::Rebind<hwy::float16_t, D> dh;
  const auto h = hn::DemoteTo(dh, v);
  if (stream) {
    hn::Stream(h, dh, reinterpret_cast<hwy::float16_t*>(p));
  } else {
    hn::StoreU(h, dh, reinterpret_cast<hwy::float16_t*>(p));
  }
#else
  (void)stream;
  HWY_ALIGN float lanes[hn::MaxLanes(d)];
  hn::Store(v, d, lanes);
  for (size_t i = 0; i < hn::Lanes(d); ++i) p[i] = ToHalf(lanes[i]);
#endif
}
template <class D>
HWY_INLINE void StoreAcc(D d, hn::Vec<D> v, BFloat16* p, bool stream = false) {
  const hn::Rebind<uint16_t, D> du16;
  const auto bits = BFloat16Bits(d, v);
  if (stream) {
    hn::Stream(bits, du16, reinterpret_cast<uint16_t*>(p));
  } else {
    hn::StoreU(bits, du16, reinterpret_cast<uint16_t*>(p));
  }
}

// Masked loads and stores of the first n < N lanes: the elementwise passes end channels-first
// planes and channels-last rows that are not whole vectors with one vector operation instead of n
// scalar ones, each with its own rounding to 16 bits (3x3 float inference 3.3x faster, 24- and
// 40-channel rows 1.4-2.5x), and with the vector body's arithmetic. Only where the hardware masks
// the access itself, so no byte past the tensor is touched: from AVX2 for 32- and 64-bit lanes,
// from AVX-512 for 16-bit ones (Highway emulates the others with whole-vector accesses).
template <typename T>
constexpr bool kMaskedTails = FBN_HW_F16 && (sizeof(T) >= 4 || HWY_TARGET != HWY_AVX2);

template <class D, typename T>
HWY_INLINE hn::Vec<D> LoadAccN(D d, const T* p, int64_t n) {
  if constexpr (sizeof(T) >= 4) {
    return hn::MaskedLoad(hn::FirstN(d, static_cast<size_t>(n)), d, p);
  } else {
    const hn::Rebind<uint16_t, D> du16;
    const auto bits = hn::MaskedLoad(hn::FirstN(du16, static_cast<size_t>(n)), du16,
                                     reinterpret_cast<const uint16_t*>(p));
    if constexpr (std::is_same_v<T, BFloat16>) {
      const hn::RebindToUnsigned<D> du32;
      return hn::BitCast(d, hn::ShiftLeft<16>(hn::PromoteTo(du32, bits)));
    } else {
      return hn::PromoteTo(d, hn::BitCast(hn::Rebind<hwy::float16_t, D>(), bits));
    }
  }
}

template <class D, typename T>
HWY_INLINE void StoreAccN(D d, hn::Vec<D> v, T* p, int64_t n) {
  if constexpr (sizeof(T) >= 4) {
    hn::BlendedStore(v, hn::FirstN(d, static_cast<size_t>(n)), d, p);
  } else {
    const hn::Rebind<uint16_t, D> du16;
    const auto bits = [&] {
      if constexpr (std::is_same_v<T, BFloat16>) {
        return BFloat16Bits(d, v);
      } else {
        return hn::BitCast(du16, hn::DemoteTo(hn::Rebind<hwy::float16_t, D>(), v));
      }
    }();
    hn::BlendedStore(bits, hn::FirstN(du16, static_cast<size_t>(n)), du16,
                     reinterpret_cast<uint16_t*>(p));
  }
}

// Whole vectors from `p` on are aligned for streaming stores of T.
template <typename T, class D>
HWY_INLINE bool StreamAligned(D d, const T* p) {
  const uintptr_t bytes = hn::Lanes(d) * sizeof(T);
  return (reinterpret_cast<uintptr_t>(p) % bytes) == 0;
}

// Elements to write one by one before p + i is aligned for streaming (at most one vector).
template <typename T, class D>
HWY_INLINE int64_t StreamHead(D d, const T* p) {
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  // bfloat16 streams whole pairs (FlatPairs): aligned to a pair, no line is left partly streamed.
  constexpr uintptr_t kVectors = HWY_TARGET != HWY_SCALAR && std::is_same_v<T, BFloat16> ? 2 : 1;
  const uintptr_t bytes = static_cast<uintptr_t>(lanes) * sizeof(T) * kVectors;
  const uintptr_t mis = reinterpret_cast<uintptr_t>(p) % bytes;
  if (mis == 0) return 0;
  if (mis % sizeof(T) != 0) return -1;  // never aligned: do not stream
  return static_cast<int64_t>((bytes - mis) / sizeof(T));
}

// Channels-first runs stream single vectors, except bfloat16, which streams only whole pairs.
template <typename T>
constexpr bool kStreamsSingles = !(HWY_TARGET != HWY_SCALAR && std::is_same_v<T, BFloat16>);

// Streaming passes read from DRAM, and there the hardware prefetchers alone left one core short
// of the copy bandwidth: the loops spend more instructions per line than a copy, so fewer lines
// are in flight (2 threads, bfloat16 inference 21 GB/s, a copy 30). Software prefetches this far
// ahead of the loads restore it (a test loop: 21 -> 30 GB/s bfloat16, 27 -> 32 float). Only the
// bfloat16 writers (most instructions per line) use them: float gained 0-10% from DRAM and lost
// about as much on tensors held by the last-level cache. They stay inside the caller's range:
// past it lie other tasks' data, fetched early or twice (32x256x14x14 float training forward
// 0.82x when its rewrite prefetched the next channels).
constexpr int64_t kPrefetchAheadBytes = 4096;

template <typename T>
constexpr int64_t kPrefetchAhead = kPrefetchAheadBytes / static_cast<int64_t>(sizeof(T));

// Planes longer than this many elements take the plane-by-plane loops (CrossesPlanes).
constexpr int64_t kCrossPlaneMax = 4096;

// The channels-last reductions read a block of rows strip by strip, the first strip from DRAM
// when the tensor is large, and the hardware prefetchers do not follow that order well (float
// statistics of 128x56x56x256 at 16 GB/s, a read sweep 25): the first pass of each strip
// prefetches the line at channel c of row r + nb (the next block) into L2, up to prefetch_end.
template <typename T>
HWY_INLINE void PrefetchNextBlock(const T* x, int64_t C, int64_t c, int64_t r, int64_t nb,
                                  int64_t prefetch_end) {
  if (r + nb < prefetch_end) __builtin_prefetch(x + (r + nb) * C + c, 0, 2);
}

#undef FBN_BF16_PAIRS
#if HWY_TARGET != HWY_SCALAR
#define FBN_BF16_PAIRS 1
// bfloat16 pairs: 2·N adjacent values loaded as N 32-bit lanes split into the even-indexed
// values (low halves, shifted up) and the odd ones (high halves, masked): one operation each
// instead of a widening load and a shift per N values. Rounded back into the same halves and
// or-ed, they store as one full vector with no narrowing or lane permutation; the per-channel
// coefficients are split into even and odd lanes once per strip.
template <class D>
HWY_INLINE void LoadBF16Pair(D d, const BFloat16* p, hn::Vec<D>& even, hn::Vec<D>& odd) {
  const hn::RebindToUnsigned<D> du;
  const auto raw = hn::LoadU(du, reinterpret_cast<const uint32_t*>(p));
  even = hn::BitCast(d, hn::ShiftLeft<16>(raw));
  odd = hn::BitCast(d, hn::And(raw, hn::Set(du, 0xFFFF0000u)));
}

// The 2·N bfloat16 values of (even, odd), rounded as BFloat16Bits, in storage order. NaN needs
// its own rounding (the carry of a NaN's low bits could reach the exponent); one test per pair
// finds it (inf - inf also takes that path, which rounds infinities exactly as well).
template <class D>
HWY_INLINE hn::Vec<hn::RebindToUnsigned<D>> BF16PairBits(D d, hn::Vec<D> even, hn::Vec<D> odd) {
  const hn::RebindToUnsigned<D> du;
#if FBN_HW_BF16
  if constexpr (hn::MaxLanes(D()) == 16) {
    if (kHardwareBF16 && (SubnormalLanes(even.raw) | SubnormalLanes(odd.raw)) == 0) {
      // Converts to [even 0..15, odd 0..15] as 16-bit words, then interleaves them.
      __m512i words;
      asm("vcvtne2ps2bf16 %2, %1, %0" : "=v"(words) : "v"(odd.raw), "v"(even.raw));
      const __m512i order =
          _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                           6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
      return hn::Vec<decltype(du)>{_mm512_permutexvar_epi16(order, words)};
    }
  }
#endif
  const auto bias = hn::Set(du, 0x7FFFu), one = hn::Set(du, 1u), high = hn::Set(du, 0xFFFF0000u);
  const auto be = hn::BitCast(du, even), bo = hn::BitCast(du, odd);
  auto re = hn::ShiftRight<16>(hn::Add(be, hn::Add(bias, hn::And(hn::ShiftRight<16>(be), one))));
  auto ro = hn::And(hn::Add(bo, hn::Add(bias, hn::And(hn::ShiftRight<16>(bo), one))), high);
  if (HWY_UNLIKELY(!hn::AllFalse(d, hn::IsNaN(hn::Add(even, odd))))) {
    re = hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(even)),
                        hn::Or(hn::ShiftRight<16>(be), hn::Set(du, 0x40u)), re);
    ro = hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(odd)),
                        hn::Or(hn::And(bo, high), hn::Set(du, 0x400000u)), ro);
  }
  return hn::Or(re, ro);
}

template <class DU>
HWY_INLINE void StorePairBits(DU du, hn::Vec<DU> bits, BFloat16* p, bool nt) {
  uint32_t* out = reinterpret_cast<uint32_t*>(p);
  if (nt) {
    hn::Stream(bits, du, out);
  } else {
    hn::StoreU(bits, du, out);
  }
}

// Channels-first runs share one channel's coefficients: whole pairs of [i, end), from i on (with
// `nt`, i is pair-aligned: StreamHead). Returns the first element left; the caller writes the
// rest with regular stores, so no cache line is written partly by streaming stores (a partly
// streamed line costs a read-modify-write in memory: 96x17x17x96 NCHW inference 3.6x slower).
template <class D, class F>
HWY_INLINE int64_t FlatPairs(D d, BFloat16* out, int64_t i, int64_t end, bool nt, F&& pair) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const hn::RebindToUnsigned<D> du;
  for (; i + 2 * N <= end; i += 2 * N) StorePairBits(du, pair(i), out + i, nt);
  return i;
}

template <class D>
HWY_INLINE void SplitPair(D d, const float* p, hn::Vec<D>& even, hn::Vec<D>& odd) {
  const auto lo = hn::LoadU(d, p), hi = hn::LoadU(d, p + hn::Lanes(d));
  even = hn::ConcatEven(d, hi, lo);
  odd = hn::ConcatOdd(d, hi, lo);
}

// Stores the even and odd lanes of a pair back in channel order (once per strip and block).
template <class D>
HWY_INLINE void StoreInterleaved(D d, hn::Vec<D> even, hn::Vec<D> odd, float* out) {
  hn::StoreInterleaved2(even, odd, d, out);
}

// Row-by-row bfloat16 streaming reloads the coefficients from L1 for every row: they are split
// into even and odd lanes once per call, into a grow-only per-thread buffer (`n` arrays of
// channels [c0, c0 + width), each as [even N, odd N] per pair).
template <class D>
HWY_INLINE const float* SplitCoefficients(D d, const float* const* arrays, int n, int64_t c0,
                                          int64_t width) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  thread_local std::vector<float> split;
  if (split.size() < static_cast<size_t>(n * width)) split.resize(static_cast<size_t>(n * width));
  float* sp = split.data();
  for (int k = 0; k < n; ++k) {
    for (int64_t c = 0; c < width; c += 2 * N) {
      hn::Vec<D> ev, od;
      SplitPair(d, arrays[k] + c0 + c, ev, od);
      hn::StoreU(ev, d, sp + k * width + c);
      hn::StoreU(od, d, sp + k * width + c + N);
    }
  }
  return sp;
}

// Row-order bfloat16 streaming writes whole vectors of pairs when every row's pairs start 4·N-byte
// aligned (half-vector streaming stores leave lines partly written).
template <typename T, class D>
HWY_INLINE bool PairsStream(D d, int64_t C, int64_t c0, const T* y) {
  const int64_t pair = 2 * static_cast<int64_t>(hn::Lanes(d));
  return std::is_same_v<T, BFloat16> && C % pair == 0 && c0 % pair == 0 &&
         reinterpret_cast<uintptr_t>(y) % static_cast<uintptr_t>(pair * 2) == 0;
}

#else
#define FBN_BF16_PAIRS 0
template <typename T, class D>
HWY_INLINE bool PairsStream(D, int64_t, int64_t, const T*) {
  return false;
}
#endif

// Chan's merge of a block of nb values into a running state of `count` values, for many channels
// that share the counts: the weights are computed once per block, so the per-channel work has no
// division.
struct MergeWeights {
  double inv_nb;  // 1 / block count
  double w;       // nb / (count + nb)
  double v;       // count · nb / (count + nb)
};
HWY_INLINE MergeWeights WeightsFor(double count, double nb) {
  const double total = count + nb;
  return {1.0 / nb, nb / total, count * nb / total};
}

// Rows per block of a channels-last reduction: the block is re-read from cache by the second pass.
// `tensors`: how many tensors it reads row by row. Rows of whole 4 KB multiples put all of a
// strip's lines in the same few L1 sets; statistics of such rows read from DRAM take 16-row blocks,
// which measured faster (Zen 4, alternating calls: 128x7x7x2048 bfloat16 statistics 0.77x the
// time, float 32x14x14x1024, 128x14x14x1024 and 128x7x7x2048 0.90-0.93x; training forward
// 0.85-0.97x). In cache the same blocks were 1.11-1.18x slower, and the gradient's two-tensor
// sums gained nothing (0.98-1.02x).
// Rows of whole multiples of this many bytes put a strip's lines in the same few L1 sets too
// (ApplyRows).
constexpr int64_t kTileRowBytes = 2048;
HWY_INLINE int64_t BlockRows(int64_t channels, size_t elem_bytes, int tensors, RowRead read) {
  constexpr int64_t kBlockBytes = 48 * 1024;
  constexpr int64_t kDramPageRowsBlock = 16;
  const int64_t row_bytes = channels * static_cast<int64_t>(elem_bytes);
  const bool dram = read == RowRead::kDram || read == RowRead::kPrefetch;
  if (tensors == 1 && dram && row_bytes > 0 && row_bytes % kPageBytes == 0) {
    return kDramPageRowsBlock;
  }
  const int64_t rows = kBlockBytes / (row_bytes > 0 ? tensors * row_bytes : 1);
  // At least 64 rows, so the per-channel merge is amortized over many rows even for wide C.
  return rows < 64 ? 64 : (rows > 2048 ? 2048 : rows);
}
// Channels-last rows this narrow stream the frozen gradient's dx from strips (ReduceRows).
constexpr int64_t kNarrowRowChannels = 192;
constexpr int64_t kRunBlock = 4096;        // elements per block of a channels-first reduction
constexpr int64_t kShortPlaneBytes = 256;  // channels-first planes read several channels at once
constexpr int64_t kShortRunBytes = 2048;   // channels-first runs whose statistics prefetch ahead
constexpr int64_t kPrefetchPlanes = 2;

// ------------------------------------------------------------------------------------------------
// Stats.

// Block statistics are exact to rounding even when |mean| >> std: the first pass sums x - K about
// a pivot K (the block's first value), so the sum holds spread rather than magnitude; the second
// pass sums d = x - m and d² about the rounded block mean m, and the merge uses the corrected
// mean m + Σd/n and M2 = Σd² - (Σd)²/n (the "corrected two-pass" algorithm).
HWY_INLINE void CorrectedBlock(double n, double m, double sum_d, double sum_d2, double& mean,
                               double& m2) {
  mean = m + sum_d / n;
  m2 = sum_d2 - sum_d * sum_d / n;
  if (m2 < 0) m2 = 0;
}

// Channels-last strips: K vectors of adjacent channels whose accumulators stay in registers while
// the rows of a block stream past (the "register-blocked NHWC" of performance.md). The per-channel
// operations and their order are those of a row-by-row sweep, so the strip width never changes
// the result.
constexpr int kStripVectors = 4;
// Where a strip's registers allow (AVX-512's 32 vector registers, not AVX2's 16), some kernels
// take strips of eight vectors for rows from beyond L2: whole rows of up to 128 channels
// (bfloat16: 256 bytes), or longer runs of wider rows, are then one pass down the block, which the
// prefetchers follow from L3 and DRAM better than four-vector strips splitting each row's lines
// between passes. Measured on Zen 4 (alternating calls, 2 threads): bfloat16 statistics
// 0.87-0.96x the time on 2-15 MB GoogLeNet and ResNet-50 tensors, bfloat16 apply with regular
// stores 0.73-0.92x (96x17x17x128 170 -> 125 us), float gradient sums 0.70-0.96x (32x56x56x256
// training gradient 15.5 -> 13.1 ms). In L2 they were slower (batch-1 14x14x256 and 14x14x512
// bfloat16 training forward 1.1-1.18x), hence RowRead::kL2. The bfloat16 sums take six: their
// pairs need more registers (eight measured 1.55x slower), six 0.79-0.96x (training gradient
// 0.87-0.95x). Float statistics and apply and the backward apply measured 0.87-1.06x,
// 0.99-1.04x and 0.95-1.04x then and kept four; later measurements gave eight to the statistics
// of rows of whole pages (ForEachStatsStrip) and to the apply and backward apply with regular
// stores (ApplyRows, BackwardApplyRows).
constexpr int kWideStripVectors =
    (HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL) ? 2 * kStripVectors : kStripVectors;
// The bfloat16 sums' pair kernels hold more per vector: six where eight fit elsewhere.
constexpr int kWidePairStripVectors = kWideStripVectors > kStripVectors ? 6 : kStripVectors;
template <typename T>
constexpr int kStatsStripVectors = std::is_same_v<T, BFloat16> ? kWideStripVectors : kStripVectors;
template <typename T>
constexpr int kApplyStripVectors = kStatsStripVectors<T>;
template <typename T>
constexpr int kReduceStripVectors = std::is_same_v<T, float>      ? kWideStripVectors
                                    : std::is_same_v<T, BFloat16> ? kWidePairStripVectors
                                                                  : kStripVectors;

// Whether streamed float rows of C channels (N lanes a vector) are written in row order, the
// coefficients reloaded from L1, instead of strip by strip. On Zen 4 (where VictimL3Bytes() is
// non-zero) a strip's pass down the rows of a block reads from DRAM at a stride the prefetchers
// follow poorly: rows of two or more whole strips up to 512 channels measured faster in row order
// (warm, 8 alternating rounds: inference 32x256x56x56 6.3 -> 5.0 ms, 32x512x28x28 3.3 -> 2.2,
// 96x384x17x17 2.4 -> 2.0; training gradient 32x256x56x56 21.6 -> 15.7), rows of one strip and
// a bit (C <= 96) no faster, and wider rows slower (1024 and 2048 channels: 0.8-0.97x, the
// three or four coefficient arrays then fill L1 as in the Xeon case of ApplyRows).
inline bool FloatRowsStreamInRowOrder(int64_t C, int64_t N) {
  return C >= 2 * kStripVectors * N && C <= 512 && VictimL3Bytes() > 0;
}

// x - y as x + (-1)·y in one FMA: the same rounding, so the same value as hn::Sub. Zen 4 runs
// additions on two of its FP pipes and FMAs on the other two; the statistics sweeps, mostly
// subtractions and additions, keep both pairs busy this way (bfloat16 statistics, whose
// unpacking leaves fewer cycles per value, measured 1.1-1.25x faster: 32x28x28x128 157 -> 125
// us, 96x35x35x64 361 -> 289). Intel cores issue both on the same ports.
template <class D>
HWY_INLINE hn::Vec<D> SubOnFma(D d, hn::Vec<D> x, hn::Vec<D> y) {
  return hn::NegMulAdd(hn::Set(d, 1), y, x);
}

// Pass 1 of a block for the strip at channel c: bm = K + Σ(x - K)/nb with K the block's first row.
#if FBN_BF16_PAIRS
// The bfloat16 reductions read pairs (LoadBF16Pair) with accumulators in even/odd lanes: every
// channel's accumulator still adds the same values in the same order. K >= 2; an odd K's last
// vector is read singly.
template <int K, class D>
HWY_INLINE void StripMeanBF16(D d, const BFloat16* x, int64_t C, int64_t c, int64_t b0, int64_t b1,
                              int64_t prefetch_end, hn::Vec<D> vinv, float* bm) {
  constexpr int P = K / 2;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const int64_t cs = c + 2 * P * N;
  hn::Vec<D> pe[P], po[P], ae[P], ao[P];
  const BFloat16* pivot = x + b0 * C;
  for (int p = 0; p < P; ++p) {
    LoadBF16Pair(d, pivot + c + 2 * p * N, pe[p], po[p]);
    ae[p] = ao[p] = hn::Zero(d);
  }
  // The single vector of an odd K only: past the strip otherwise.
  const auto ps = K % 2 == 1 ? LoadAcc(d, pivot + cs) : hn::Zero(d);
  auto as = hn::Zero(d);
  const int64_t nb = b1 - b0;
  for (int p = 0; p < P; ++p) PrefetchNextBlock(x, C, c + 2 * p * N, b0, nb, prefetch_end);
  if (K % 2 == 1) PrefetchNextBlock(x, C, cs, b0, nb, prefetch_end);
  for (int64_t r = b0 + 1; r < b1; ++r) {
    const BFloat16* xr = x + r * C;
    for (int p = 0; p < P; ++p) {
      PrefetchNextBlock(x, C, c + 2 * p * N, r, nb, prefetch_end);
      hn::Vec<D> e, o;
      LoadBF16Pair(d, xr + c + 2 * p * N, e, o);
      ae[p] = hn::Add(ae[p], SubOnFma(d, e, pe[p]));
      ao[p] = hn::Add(ao[p], SubOnFma(d, o, po[p]));
    }
    if (K % 2 == 1) {
      PrefetchNextBlock(x, C, cs, r, nb, prefetch_end);
      as = hn::Add(as, SubOnFma(d, LoadAcc(d, xr + cs), ps));
    }
  }
  for (int p = 0; p < P; ++p) {
    StoreInterleaved(d, hn::MulAdd(ae[p], vinv, pe[p]), hn::MulAdd(ao[p], vinv, po[p]),
                     bm + c + 2 * p * N);
  }
  if (K % 2 == 1) hn::StoreU(hn::MulAdd(as, vinv, ps), d, bm + cs);
}

template <int K, class D>
HWY_INLINE void StripDeviationsBF16(D d, const BFloat16* x, int64_t C, int64_t c, int64_t b0,
                                    int64_t b1, const float* bm, float* bd, float* bd2) {
  constexpr int P = K / 2;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const int64_t cs = c + 2 * P * N;
  hn::Vec<D> me[P], mo[P], s1e[P], s1o[P], s2e[P], s2o[P];
  for (int p = 0; p < P; ++p) {
    SplitPair(d, bm + c + 2 * p * N, me[p], mo[p]);
    s1e[p] = s1o[p] = s2e[p] = s2o[p] = hn::Zero(d);
  }
  const auto ms = K % 2 == 1 ? hn::LoadU(d, bm + cs) : hn::Zero(d);
  auto s1s = hn::Zero(d), s2s = hn::Zero(d);
  for (int64_t r = b0; r < b1; ++r) {
    const BFloat16* xr = x + r * C;
    for (int p = 0; p < P; ++p) {
      hn::Vec<D> e, o;
      LoadBF16Pair(d, xr + c + 2 * p * N, e, o);
      const auto de = SubOnFma(d, e, me[p]), dO = SubOnFma(d, o, mo[p]);
      s1e[p] = hn::Add(s1e[p], de);
      s2e[p] = hn::MulAdd(de, de, s2e[p]);
      s1o[p] = hn::Add(s1o[p], dO);
      s2o[p] = hn::MulAdd(dO, dO, s2o[p]);
    }
    if (K % 2 == 1) {
      const auto dv = SubOnFma(d, LoadAcc(d, xr + cs), ms);
      s1s = hn::Add(s1s, dv);
      s2s = hn::MulAdd(dv, dv, s2s);
    }
  }
  for (int p = 0; p < P; ++p) {
    StoreInterleaved(d, s1e[p], s1o[p], bd + c + 2 * p * N);
    StoreInterleaved(d, s2e[p], s2o[p], bd2 + c + 2 * p * N);
  }
  if (K % 2 == 1) {
    hn::StoreU(s1s, d, bd + cs);
    hn::StoreU(s2s, d, bd2 + cs);
  }
}
#endif

template <int K, typename T, class D>
HWY_INLINE void StripMean(D d, const T* x, int64_t C, int64_t c, int64_t b0, int64_t b1,
                          int64_t prefetch_end, hn::Vec<D> vinv, Acc<T>* bm) {
#if FBN_BF16_PAIRS
  if constexpr (std::is_same_v<T, BFloat16> && K >= 2) {
    return StripMeanBF16<K>(d, x, C, c, b0, b1, prefetch_end, vinv, bm);
  }
#endif
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const T* pivot = x + b0 * C + c;
  hn::Vec<D> p[K], acc[K];
  for (int j = 0; j < K; ++j) {
    p[j] = LoadAcc(d, pivot + j * N);
    acc[j] = hn::Zero(d);
  }
  const int64_t nb = b1 - b0;
  for (int j = 0; j < K; ++j) PrefetchNextBlock(x, C, c + j * N, b0, nb, prefetch_end);
  for (int64_t r = b0 + 1; r < b1; ++r) {
    const T* xr = x + r * C + c;
    for (int j = 0; j < K; ++j) {
      PrefetchNextBlock(x, C, c + j * N, r, nb, prefetch_end);
      acc[j] = hn::Add(acc[j], SubOnFma(d, LoadAcc(d, xr + j * N), p[j]));
    }
  }
  for (int j = 0; j < K; ++j) hn::StoreU(hn::MulAdd(acc[j], vinv, p[j]), d, bm + c + j * N);
}

// Pass 2 of a block for the strip at channel c: bd = Σ(x - bm), bd2 = Σ(x - bm)².
template <int K, typename T, class D>
HWY_INLINE void StripDeviations(D d, const T* x, int64_t C, int64_t c, int64_t b0, int64_t b1,
                                const Acc<T>* bm, Acc<T>* bd, Acc<T>* bd2) {
#if FBN_BF16_PAIRS
  if constexpr (std::is_same_v<T, BFloat16> && K >= 2) {
    return StripDeviationsBF16<K>(d, x, C, c, b0, b1, bm, bd, bd2);
  }
#endif
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  hn::Vec<D> m[K], s1[K], s2[K];
  for (int j = 0; j < K; ++j) {
    m[j] = hn::LoadU(d, bm + c + j * N);
    s1[j] = hn::Zero(d);
    s2[j] = hn::Zero(d);
  }
  for (int64_t r = b0; r < b1; ++r) {
    const T* xr = x + r * C + c;
    for (int j = 0; j < K; ++j) {
      const auto dv = SubOnFma(d, LoadAcc(d, xr + j * N), m[j]);
      s1[j] = hn::Add(s1[j], dv);
      s2[j] = hn::MulAdd(dv, dv, s2[j]);
    }
  }
  for (int j = 0; j < K; ++j) {
    hn::StoreU(s1[j], d, bd + c + j * N);
    hn::StoreU(s2[j], d, bd2 + c + j * N);
  }
}

// Calls f(integral_constant<K>, c) with K = vectors, for a strip narrower than the widest.
template <int K, class F>
HWY_INLINE void NarrowStrip(int64_t vectors, int64_t c, F& f) {
  if constexpr (K >= 1) {
    if (vectors == K) return f(std::integral_constant<int, K>(), c);
    NarrowStrip<K - 1>(vectors, c, f);
  }
}

// Calls f(integral_constant<K>, c) for the whole-vector channels of [c0, c1) in strips of kMax
// vectors, then one narrower strip; returns the first channel left for scalar code.
template <int kMax, class D, class F>
HWY_INLINE int64_t ForEachStrip(D d, int64_t c0, int64_t c1, F&& f) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const int64_t cv = c0 + (c1 - c0) / N * N;
  int64_t c = c0;
  for (; c + kMax * N <= cv; c += kMax * N) f(std::integral_constant<int, kMax>(), c);
  NarrowStrip<kMax - 1>((cv - c) / N, c, f);
  return cv;
}

// ForEachStrip with kWide-vector strips for rows from beyond L2, else kStripVectors.
template <int kWide, class D, class F>
HWY_INLINE int64_t ForEachStripFor(RowRead read, D d, int64_t c0, int64_t c1, F&& f) {
  if (read == RowRead::kL2) return ForEachStrip<kStripVectors>(d, c0, c1, f);
  return ForEachStrip<kWide>(d, c0, c1, f);
}

// Pass 1 of a block in row order for the whole-vector channels [c0, cv): bm = K + Σ(x - K)/nb
// as StripMean gives it per channel (same operations, same order, so the same bits), with the
// sums in `acc` (L1) instead of registers. Strips read a block from DRAM a few lines per row at
// a stride the prefetchers follow poorly, even with software prefetches; rows in order they
// stream. The second pass still takes strips, from L2. Measured on Zen 4 (2 threads,
// alternating calls, float): operands flushed, 32x14x14x256, 128x7x7x512, 96x8x8x384 and
// 32x28x28x256 statistics 0.62-0.68x the time, 32x14x14x512 0.83x; DRAM-sized tensors of 43-51
// MB 0.69-0.84x. In cache it was 1.04-1.29x slower, and on tensors of 64 MB and more, which
// prefetch (kPrefetch), 0.92-1.25x: both keep the strips (StatsRead in the driver decides).
// 16-bit rows widen each vector as the strips do (bfloat16 strips split pairs into even and odd
// lanes, but every lane gets the same operations), so their bits match too.
template <typename T, class D>
HWY_INLINE void RowMean(D d, const T* x, int64_t C, int64_t c0, int64_t cv, int64_t b0, int64_t b1,
                        hn::Vec<D> vinv, Acc<T>* bm, Acc<T>* acc, Acc<T>* pivot_acc) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  // A 16-bit pivot row is converted once, into pivot_acc (L1), instead of once per row.
  const Acc<T>* pivot;
  if constexpr (std::is_same_v<T, Acc<T>>) {
    pivot = x + b0 * C;
  } else {
    for (int64_t c = c0; c < cv; c += N) {
      hn::StoreU(LoadAcc(d, x + b0 * C + c), d, pivot_acc + c);
    }
    pivot = pivot_acc;
  }
  for (int64_t c = c0; c < cv; c += N) hn::StoreU(hn::Zero(d), d, acc + c);
  for (int64_t r = b0 + 1; r < b1; ++r) {
    const T* xr = x + r * C;
    for (int64_t c = c0; c < cv; c += N) {
      const auto v = SubOnFma(d, LoadAcc(d, xr + c), hn::LoadU(d, pivot + c));
      hn::StoreU(hn::Add(hn::LoadU(d, acc + c), v), d, acc + c);
    }
  }
  for (int64_t c = c0; c < cv; c += N) {
    hn::StoreU(hn::MulAdd(hn::LoadU(d, acc + c), vinv, hn::LoadU(d, pivot + c)), d, bm + c);
  }
}

// The scalar channels [cv, c1) past the last whole vector, with the strips' operations: the
// pivoted block mean of rows [b0, b1) into bm, and the deviations about m into bd and bd2.
template <typename T, typename A>
void TailMean(const T* x, int64_t C, int64_t cv, int64_t c1, int64_t b0, int64_t b1, A nb, A* bm) {
  const T* pivot = x + b0 * C;
  for (int64_t c = cv; c < c1; ++c) bm[c] = A(0);
  for (int64_t r = b0 + 1; r < b1; ++r) {
    const T* xr = x + r * C;
    for (int64_t c = cv; c < c1; ++c) bm[c] += ToAcc(xr[c]) - ToAcc(pivot[c]);
  }
  for (int64_t c = cv; c < c1; ++c) bm[c] = ToAcc(pivot[c]) + bm[c] / nb;
}
template <typename T, typename A>
void TailDeviations(const T* x, int64_t C, int64_t cv, int64_t c1, int64_t b0, int64_t b1,
                    const A* m, A* bd, A* bd2) {
  for (int64_t c = cv; c < c1; ++c) bd[c] = bd2[c] = A(0);
  for (int64_t r = b0; r < b1; ++r) {
    const T* xr = x + r * C;
    for (int64_t c = cv; c < c1; ++c) {
      const A dd = ToAcc(xr[c]) - m[c];
      bd[c] += dd;
      bd2[c] += dd * dd;
    }
  }
}

// ForEachStripFor for the statistics' strips. Rows a whole number of pages long take the wide
// strips from any cache: a four-vector strip's lines down such rows fall in four L1 sets, eight
// vectors spread them over eight. Zen 4, float, alternating calls in one process: one thread,
// 49 rows of 2,048 channels (batch-1 7x7x2048) 14.1 -> 8.4 us, 196 of 1,024 29 -> 16.4 us, from
// L3 1,568 rows of 2,048 575 -> 310 us; two threads, training forward: batch-1 7x7x2048 and
// 14x14x1024 0.82-0.87x the time warm, 0.85-0.91x cold, 32x14x14x1024 0.93x, 32x7x7x2048 and
// 128x7x7x2048 0.97-0.99x. Other float rows gained nothing (0.94-1.04x), so they keep four.
template <typename T, class D, class F>
HWY_INLINE int64_t ForEachStatsStrip(RowRead read, int64_t C, D d, int64_t c0, int64_t c1, F&& f) {
  if ((C * static_cast<int64_t>(sizeof(T))) % kPageBytes == 0) {
    return ForEachStrip<kWideStripVectors>(d, c0, c1, f);
  }
  return ForEachStripFor<kStatsStripVectors<T>>(read, d, c0, c1, f);
}

// Channels-last: statistics of rows [r0, r1) and channels [c0, c1) of rows of C channels.
// `mean`/`m2` (indexed by channel) receive the range's mean and centred sum of squares; `tmp` holds
// 3·C accumulators. Both passes read the block strip by strip with register accumulators, the
// second from cache; with kFlushed the first reads rows in order instead (RowMean).
template <typename T>
void StatsRows(const void* xv, int64_t C, int64_t c0, int64_t c1, int64_t r0, int64_t r1,
               double* mean, double* m2, void* tmpv, RowRead read) {
  using A = Acc<T>;
  const T* x = static_cast<const T*>(xv);
  A* bm = static_cast<A*>(tmpv);  // the rounded block mean m
  A* bd = bm + C;                 // pass 2: Σ(x - m)
  A* bd2 = bd + C;                // pass 2: Σ(x - m)²
  const AccTag<T> d;
  const int64_t block = BlockRows(c1 - c0, sizeof(T), 1, read);
  const int64_t prefetch_end = read == RowRead::kPrefetch ? r1 : r0;
  // kFlushed: the first pass reads rows wider than one strip in order (RowMean).
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const bool row_mean = read == RowRead::kFlushed && c1 - c0 > kStatsStripVectors<T> * N;
  const int64_t whole_end = c0 + (c1 - c0) / N * N;  // the whole-vector channels end here
  double count = 0;
  for (int64_t c = c0; c < c1; ++c) mean[c] = m2[c] = 0.0;
  for (int64_t b0 = r0; b0 < r1; b0 += block) {
    const int64_t b1 = b0 + block < r1 ? b0 + block : r1;
    const A nb = static_cast<A>(b1 - b0);
    const auto vinv = hn::Set(d, A(1) / nb);
    const auto strip = [&](auto k, int64_t c) {
      StripMean<decltype(k)::value>(d, x, C, c, b0, b1, prefetch_end, vinv, bm);
      StripDeviations<decltype(k)::value>(d, x, C, c, b0, b1, bm, bd, bd2);
    };
    const auto deviations = [&](auto k, int64_t c) {
      StripDeviations<decltype(k)::value>(d, x, C, c, b0, b1, bm, bd, bd2);
    };
    int64_t cv;
    if (row_mean) {
      RowMean(d, x, C, c0, whole_end, b0, b1, vinv, bm, bd, bd2);  // bd2: written by pass 2
      cv = ForEachStatsStrip<T>(read, C, d, c0, c1, deviations);
    } else {
      cv = ForEachStatsStrip<T>(read, C, d, c0, c1, strip);
    }
    if (cv < c1) {
      TailMean(x, C, cv, c1, b0, b1, nb, bm);
      TailDeviations(x, C, cv, c1, b0, b1, bm, bd, bd2);
    }
    const MergeWeights mw = WeightsFor(count, static_cast<double>(nb));
    for (int64_t c = c0; c < c1; ++c) {
      // CorrectedBlock, then Chan's merge, with the shared weights.
      const double sd = static_cast<double>(bd[c]);
      const double bmean = static_cast<double>(bm[c]) + sd * mw.inv_nb;
      double bvar = static_cast<double>(bd2[c]) - sd * sd * mw.inv_nb;
      if (bvar < 0) bvar = 0;
      const double delta = bmean - mean[c];
      mean[c] += delta * mw.w;
      m2[c] += bvar + delta * delta * mw.v;
    }
    count += static_cast<double>(nb);
  }
}

// Channels-last statistics in two sweeps of a whole row range (the driver merges the ranges'
// results between the sweeps). Sweep 1: bm[c] = K + Σ(x - K)/n with K the range's first row.
// With kFlushed (rows from DRAM) the sweep reads rows in order (RowMean, the same bits).
template <typename T>
void MeanRows(const void* xv, int64_t C, int64_t c0, int64_t c1, int64_t r0, int64_t r1, void* bmv,
              void* tmpv, RowRead read) {
  using A = Acc<T>;
  const T* x = static_cast<const T*>(xv);
  A* bm = static_cast<A*>(bmv);
  A* tmp = static_cast<A*>(tmpv);
  const AccTag<T> d;
  const A n = static_cast<A>(r1 - r0);
  const auto vinv = hn::Set(d, A(1) / n);
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  int64_t cv;
  if (read == RowRead::kFlushed) {
    cv = c0 + (c1 - c0) / N * N;
    RowMean(d, x, C, c0, cv, r0, r1, vinv, bm, tmp, tmp + C);
  } else {
    cv = ForEachStrip<kWideStripVectors>(d, c0, c1, [&](auto k, int64_t c) {
      StripMean<decltype(k)::value>(d, x, C, c, r0, r1, r0, vinv, bm);
    });
  }
  if (cv < c1) TailMean(x, C, cv, c1, r0, r1, n, bm);
}

// Sweep 2: s1[c] = Σ(x - m), s2[c] = Σ(x - m)² about the merged mean m. tmp: 2·C accumulators.
template <typename T>
void DeviationRows(const void* xv, int64_t C, int64_t c0, int64_t c1, int64_t r0, int64_t r1,
                   const void* mv, double* s1, double* s2, void* tmpv) {
  using A = Acc<T>;
  const T* x = static_cast<const T*>(xv);
  const A* m = static_cast<const A*>(mv);
  A* bd = static_cast<A*>(tmpv);
  A* bd2 = bd + C;
  const AccTag<T> d;
  const int64_t cv = ForEachStrip<kWideStripVectors>(d, c0, c1, [&](auto k, int64_t c) {
    StripDeviations<decltype(k)::value>(d, x, C, c, r0, r1, m, bd, bd2);
  });
  if (cv < c1) TailDeviations(x, C, cv, c1, r0, r1, m, bd, bd2);
  for (int64_t c = c0; c < c1; ++c) {
    s1[c] = static_cast<double>(bd[c]);
    s2[c] = static_cast<double>(bd2[c]);
  }
}

// Calls f(offset, len, v) for the contiguous pieces of elements [v0, v1) of a channel laid out as
// planes of S elements `plane_stride` apart, offsets counted from the channel's first element; v
// is the piece's first element index.
template <class F>
HWY_INLINE void ForEachOffsetPiece(int64_t plane_stride, int64_t S, int64_t v0, int64_t v1, F&& f) {
  int64_t plane = v0 / S, off = v0 % S;
  for (int64_t v = v0; v < v1;) {
    const int64_t len = S - off < v1 - v ? S - off : v1 - v;
    f(plane * plane_stride + off, len, v);
    v += len;
    ++plane;
    off = 0;
  }
}

// Mean and centred sum of squares of elements [v0, v1) of K channels at once, each laid out alike
// (planes of S, `plane_stride` apart) from base[j] (one block: pivoted first pass, corrected
// second pass, as CorrectedBlock explains). A block spans planes, so small planes (7x7) do not pay
// a merge and the lane reductions each. Each channel gets the operations, in the order, of K = 1:
// interleaving K channels only overlaps their dependency chains (lane reductions, divisions),
// which dominate small channels (batch-1 7x7x2048 training forward 1.2-1.5x faster with K = 4).
// Short planes (up to kShortRunBytes) are a few lines each, far apart (batch 128 x 14x14: 392
// bytes 100 KB apart): too short for the hardware prefetchers to ramp up, so the loads of each
// plane wait for memory. The first pass prefetches the same piece kPrefetchPlanes planes ahead
// when it lies before `prefetch_end` (an element index of the channel): 128x512x28x28 bfloat16
// training forward 17.0 -> 13.3 ms, 96x192x17x17 float 2.2 -> 1.6 ms.
template <typename T>
HWY_INLINE void PrefetchPlaneAhead(const T* p, int64_t plane_stride, int64_t S, int64_t n,
                                   int64_t v, int64_t prefetch_end) {
  const int64_t bytes = n * static_cast<int64_t>(sizeof(T));
  if (bytes > kShortRunBytes || v + kPrefetchPlanes * S + n > prefetch_end) return;
  const char* q = reinterpret_cast<const char*>(p + kPrefetchPlanes * plane_stride);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(q + b, 0, 3);
}

// Long planes (over kShortRunBytes) the hardware prefetchers do follow, but a reduction spends
// more instructions per line than a copy (bfloat16 most: widening), so fewer lines are in flight,
// and each statistics block's second pass, from L1, leaves memory idle. The reductions of long
// planes therefore prefetch kPrefetchAhead elements ahead, through the planes and the next block,
// up to the end of their range. Medians of 3-4 alternating runs, training forward: bfloat16
// 96x64x147x147 35 -> 27 ms, 32x256x56x56 4.3 -> 3.7 ms, float 96x192x35x35 9.3 -> 7.8 ms;
// training gradient: bfloat16 96x64x147x147 63 -> 50 ms, 32x256x56x56 8.4 -> 6.1 ms, float
// 32x128x28x28 1.06 -> 0.97 ms; batch 1 and cache-resident channels unchanged.
// A cursor over a channel's element index e at (plane, off): Next(step) prefetches the lines of
// `step` elements at e, then advances e by step (step < S).
template <typename T>
class PrefetchCursor {
 public:
  PrefetchCursor(const T* base, int64_t plane_stride, int64_t S, int64_t e, int64_t end)
      : base_(base), stride_(plane_stride), S_(S), e_(e), end_(end), plane_(e / S), off_(e % S) {}
  HWY_INLINE void Next(int64_t step) {
    if (e_ < end_) {
      const char* q = reinterpret_cast<const char*>(base_ + plane_ * stride_ + off_);
      const int64_t bytes = step * static_cast<int64_t>(sizeof(T));
      for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(q + b, 0, 3);
    }
    e_ += step;
    off_ += step;
    if (off_ >= S_) {
      off_ -= S_;
      ++plane_;
    }
  }

 private:
  const T* base_;
  int64_t stride_, S_, e_, end_, plane_, off_;
};

template <int K, typename T>
HWY_INLINE void BlockTwoPass(const T* const* base, int64_t plane_stride, int64_t S, int64_t v0,
                             int64_t v1, int64_t prefetch_end, double* out_mean, double* out_m2) {
  using A = Acc<T>;
  const AccTag<T> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const int64_t len = v1 - v0;
  const int64_t first = (v0 / S) * plane_stride + v0 % S;
  hn::Vec<decltype(d)> vk[K], s0[K], s1[K];
  A k[K], s[K];
  for (int j = 0; j < K; ++j) {
    k[j] = ToAcc(base[j][first]);
    vk[j] = hn::Set(d, k[j]);
    s0[j] = s1[j] = hn::Zero(d);
    s[j] = 0;
  }
  // Long planes (read one channel at a time) prefetch ahead along the channel (PrefetchCursor).
  const bool cursor = K == 1 && S * static_cast<int64_t>(sizeof(T)) > kShortRunBytes;
  PrefetchCursor<T> ahead(base[0], plane_stride, S, v0 + kPrefetchAhead<T>, prefetch_end);
  // Offsets of the pieces relative to each channel's base.
  ForEachOffsetPiece(plane_stride, S, v0, v1, [&](int64_t o, int64_t n, int64_t v) {
    for (int j = 0; j < K; ++j)
      PrefetchPlaneAhead(base[j] + o, plane_stride, S, n, v, prefetch_end);
    int64_t i = 0;
    if (cursor) {
      for (; i + 2 * N <= n; i += 2 * N) {
        ahead.Next(2 * N);
        const T* p = base[0] + o;
        s0[0] = hn::Add(s0[0], SubOnFma(d, LoadAcc(d, p + i), vk[0]));
        s1[0] = hn::Add(s1[0], SubOnFma(d, LoadAcc(d, p + i + N), vk[0]));
      }
    }
    for (; i + 2 * N <= n; i += 2 * N) {
      for (int j = 0; j < K; ++j) {
        const T* p = base[j] + o;
        s0[j] = hn::Add(s0[j], SubOnFma(d, LoadAcc(d, p + i), vk[j]));
        s1[j] = hn::Add(s1[j], SubOnFma(d, LoadAcc(d, p + i + N), vk[j]));
      }
    }
    for (; i + N <= n; i += N) {
      for (int j = 0; j < K; ++j)
        s0[j] = hn::Add(s0[j], SubOnFma(d, LoadAcc(d, base[j] + o + i), vk[j]));
    }
    for (; i < n; ++i) {
      for (int j = 0; j < K; ++j) s[j] += ToAcc(base[j][o + i]) - k[j];
    }
  });
  hn::Vec<decltype(d)> vm[K], c0[K], c1[K], q0[K], q1[K];
  A m[K], c[K], q[K];
  for (int j = 0; j < K; ++j) {
    s[j] += len >= N ? hn::GetLane(hn::SumOfLanes(d, hn::Add(s0[j], s1[j]))) : A(0);
    m[j] = k[j] + s[j] / static_cast<A>(len);
    vm[j] = hn::Set(d, m[j]);
    c0[j] = c1[j] = q0[j] = q1[j] = hn::Zero(d);
    c[j] = q[j] = 0;
  }
  ForEachOffsetPiece(plane_stride, S, v0, v1, [&](int64_t o, int64_t n, int64_t) {
    int64_t i = 0;
    for (; i + 2 * N <= n; i += 2 * N) {
      for (int j = 0; j < K; ++j) {
        const T* p = base[j] + o;
        const auto d0 = SubOnFma(d, LoadAcc(d, p + i), vm[j]);
        const auto d1 = SubOnFma(d, LoadAcc(d, p + i + N), vm[j]);
        c0[j] = hn::Add(c0[j], d0);
        c1[j] = hn::Add(c1[j], d1);
        q0[j] = hn::MulAdd(d0, d0, q0[j]);
        q1[j] = hn::MulAdd(d1, d1, q1[j]);
      }
    }
    for (; i + N <= n; i += N) {
      for (int j = 0; j < K; ++j) {
        const auto d0 = SubOnFma(d, LoadAcc(d, base[j] + o + i), vm[j]);
        c0[j] = hn::Add(c0[j], d0);
        q0[j] = hn::MulAdd(d0, d0, q0[j]);
      }
    }
    for (; i < n; ++i) {
      for (int j = 0; j < K; ++j) {
        const A dd = ToAcc(base[j][o + i]) - m[j];
        c[j] += dd;
        q[j] += dd * dd;
      }
    }
  });
  for (int j = 0; j < K; ++j) {
    if (len >= N) {
      c[j] += hn::GetLane(hn::SumOfLanes(d, hn::Add(c0[j], c1[j])));
      q[j] += hn::GetLane(hn::SumOfLanes(d, hn::Add(q0[j], q1[j])));
    }
    CorrectedBlock(static_cast<double>(len), static_cast<double>(m[j]), static_cast<double>(c[j]),
                   static_cast<double>(q[j]), out_mean[j], out_m2[j]);
  }
}

// Channels-first statistics of elements [v0, v1) of K channels, each laid out as planes of S
// contiguous elements `plane_stride` apart from base[j]: blocks of kRunBlock elements (the K
// channels' blocks read together by BlockTwoPass<K>), merged with Chan's formula; every channel
// gets the values it gets with K = 1.
template <int K, typename T>
HWY_INLINE void StatsChannels(const T* const* base, int64_t plane_stride, int64_t S, int64_t v0,
                              int64_t v1, double* mean, double* m2) {
  double count = 0;
  for (int64_t b0 = v0; b0 < v1; b0 += kRunBlock) {
    const int64_t b1 = b0 + kRunBlock < v1 ? b0 + kRunBlock : v1;
    const double nb = static_cast<double>(b1 - b0);
    double bm[K], bq[K];
    BlockTwoPass<K>(base, plane_stride, S, b0, b1, v1, bm, bq);
    if (count == 0) {  // what the merge gives for the first block, without its divisions
      for (int j = 0; j < K; ++j) {
        mean[j] = bm[j];
        m2[j] = bq[j];
      }
    } else {
      const MergeWeights mw = WeightsFor(count, nb);
      for (int j = 0; j < K; ++j) {
        const double delta = bm[j] - mean[j];
        mean[j] += delta * mw.w;
        m2[j] += bq[j] + delta * delta * mw.v;
      }
    }
    count += nb;
  }
}

// Channels-first: statistics of elements [v0, v1) of one channel starting at `basev`.
template <typename T>
void StatsRun(const void* basev, int64_t plane_stride, int64_t S, int64_t v0, int64_t v1,
              double* mean, double* m2) {
  const T* base = static_cast<const T*>(basev);
  StatsChannels<1>(&base, plane_stride, S, v0, v1, mean, m2);
}

// Channels-first: statistics of whole channels [c0, c1) of an images x C x S tensor, as StatsRun
// per channel gives them. Four channels at a time where each fits one block (their lane
// reductions and divisions overlap) or where planes are at most kShortPlaneBytes: an image's
// planes of consecutive channels are adjacent, so four 7x7 or 8x8 planes are one run the
// prefetchers follow instead of 4 lines far apart (96x384x8x8 and 128x2048x7x7 training forward
// 1.6-1.9x faster; 14x14 and larger planes measured 0.85-0.97x, so they keep one channel).
template <typename T>
void StatsRuns(const void* xv, int64_t C, int64_t S, int64_t images, int64_t c0, int64_t c1,
               double* mean, double* m2) {
  const T* x = static_cast<const T*>(xv);
  const int64_t M = images * S;
  const auto stats = [&](auto k, int64_t c) {
    constexpr int K = decltype(k)::value;
    const T* base[K];
    for (int j = 0; j < K; ++j) base[j] = x + (c + j) * S;
    StatsChannels<K>(base, C * S, S, 0, M, mean + c, m2 + c);
  };
  int64_t c = c0;
  if (M <= kRunBlock || S * static_cast<int64_t>(sizeof(T)) <= kShortPlaneBytes) {
    for (; c + 4 <= c1; c += 4) stats(std::integral_constant<int, 4>(), c);
    if (c1 - c == 3) return stats(std::integral_constant<int, 3>(), c);
    if (c1 - c == 2) return stats(std::integral_constant<int, 2>(), c);
  }
  for (; c < c1; ++c) stats(std::integral_constant<int, 1>(), c);
}

// Channels-first: statistics of channels [c0, c1) over images [n0, n1) of an images x C x S
// tensor, read in memory order: each plane is one block (BlockTwoPass, its second pass from L1),
// merged image by image with Chan's formula (mean and m2 indexed by channel). Planes up to
// kShortPlaneBytes are read four channels at a time, as StatsRuns reads them.
template <typename T>
void StatsImages(const void* xv, int64_t C, int64_t S, int64_t c0, int64_t c1, int64_t n0,
                 int64_t n1, double* mean, double* m2) {
  const T* x = static_cast<const T*>(xv);
  const double nb = static_cast<double>(S);
  const bool short_planes = S * static_cast<int64_t>(sizeof(T)) <= kShortPlaneBytes;
  double count = 0;
  for (int64_t n = n0; n < n1; ++n, count += nb) {
    const MergeWeights mw = WeightsFor(count, nb);
    const auto planes = [&](auto k, int64_t c) {
      constexpr int K = decltype(k)::value;
      const T* base[K];
      for (int j = 0; j < K; ++j) base[j] = x + (n * C + c + j) * S;
      double bm[K], bq[K];
      BlockTwoPass<K>(base, S, S, 0, S, 0, bm, bq);
      for (int j = 0; j < K; ++j) {
        if (count == 0) {
          mean[c + j] = bm[j];
          m2[c + j] = bq[j];
        } else {
          const double delta = bm[j] - mean[c + j];
          mean[c + j] += delta * mw.w;
          m2[c + j] += bq[j] + delta * delta * mw.v;
        }
      }
    };
    int64_t c = c0;
    for (; short_planes && c + 4 <= c1; c += 4) planes(std::integral_constant<int, 4>(), c);
    for (; c < c1; ++c) planes(std::integral_constant<int, 1>(), c);
  }
}

// ------------------------------------------------------------------------------------------------
// Apply: y = (x - m)·a + b.

#if FBN_BF16_PAIRS
// StripApply for bfloat16 with K >= 2: K / 2 pairs, then one single vector when K is odd.
template <int K, class D>
HWY_INLINE void StripApplyBF16(D d, const BFloat16* x, int64_t C, int64_t c, int64_t r0, int64_t r1,
                               const float* mean, const float* a, const float* b, BFloat16* y,
                               bool nt) {
  constexpr int P = K / 2;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const hn::RebindToUnsigned<D> du;
  hn::Vec<D> me[P], mo[P], ae[P], ao[P], bE[P], bO[P];
  for (int p = 0; p < P; ++p) {
    SplitPair(d, mean + c + 2 * p * N, me[p], mo[p]);
    SplitPair(d, a + c + 2 * p * N, ae[p], ao[p]);
    SplitPair(d, b + c + 2 * p * N, bE[p], bO[p]);
  }
  const int64_t cs = c + 2 * P * N;  // the single vector of an odd K
  // Loaded only for an odd K: past the strip (and the arrays) otherwise.
  const bool single = K % 2 == 1;
  const auto vm = single ? hn::LoadU(d, mean + cs) : hn::Zero(d);
  const auto va = single ? hn::LoadU(d, a + cs) : hn::Zero(d);
  const auto vb = single ? hn::LoadU(d, b + cs) : hn::Zero(d);
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t o = r * C + c;
    for (int p = 0; p < P; ++p) {
      hn::Vec<D> ev, od;
      LoadBF16Pair(d, x + o + 2 * p * N, ev, od);
      const auto bits = BF16PairBits(d, hn::MulAdd(hn::Sub(ev, me[p]), ae[p], bE[p]),
                                     hn::MulAdd(hn::Sub(od, mo[p]), ao[p], bO[p]));
      StorePairBits(du, bits, y + o + 2 * p * N, nt);
    }
    if (K % 2 == 1) {
      const int64_t os = r * C + cs;
      StoreAcc(d, hn::MulAdd(hn::Sub(LoadAcc(d, x + os), vm), va, vb), y + os, nt);
    }
  }
}
#endif

// y = (x - m)·a + b for rows [r0, r1) of the strip at channel c; m, a, b stay in registers.
template <int K, typename T, class D>
HWY_INLINE void StripApply(D d, const T* x, int64_t C, int64_t c, int64_t r0, int64_t r1,
                           const Acc<T>* mean, const Acc<T>* a, const Acc<T>* b, T* y, bool nt) {
#if FBN_BF16_PAIRS
  if constexpr (std::is_same_v<T, BFloat16> && K >= 2) {
    return StripApplyBF16<K>(d, x, C, c, r0, r1, mean, a, b, y, nt);
  }
#endif
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  hn::Vec<D> vm[K], va[K], vb[K];
  for (int j = 0; j < K; ++j) {
    vm[j] = hn::LoadU(d, mean + c + j * N);
    va[j] = hn::LoadU(d, a + c + j * N);
    vb[j] = hn::LoadU(d, b + c + j * N);
  }
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t o = r * C + c;
    for (int j = 0; j < K; ++j) {
      const auto v = hn::Sub(LoadAcc(d, x + o + j * N), vm[j]);
      StoreAcc(d, hn::MulAdd(v, va[j], vb[j]), y + o + j * N, nt);
    }
  }
}

// Channels-last writers stream a row range only where every row starts vector-aligned. An output
// that starts elsewhere (std::vector and NumPy place large buffers 16 bytes past a cache line)
// stored regularly, up to 2x slower from DRAM: float, calls alternating in one process between
// aligned buffers and buffers 16 bytes past a line, aligned / misaligned time, inference
// 32x56x56x256 0.50x, 128x7x7x2048 0.53x, 32x28x28x512 0.67x, training forwards 0.68-0.87x,
// training gradients 0.72-0.93x, frozen gradients 0.60-0.89x. Streamed shifted: inference
// 0.94-1.08x (128x7x7x2048 0.51-0.80x), training forwards 0.98-1.03x (0.70-0.82x), training
// gradients 0.91-1.07x, frozen gradients 0.75-0.96x (their sums keep the strips, dx a pass of
// its own over each block from L2).
// Whole rows (c0 = 0, c1 = C, C a multiple of N) are one contiguous range, so it streams from its
// first aligned element instead: every aligned vector then starts at the same channel phase, and
// the one vector per row that straddles two rows takes its coefficients from a vector assembled
// once (`wrap`). The elements before the first aligned vector and after the last take the same
// operations one by one. vop(e, coefficient vectors) gives elements [e, e + N); sop(e, c) one.
template <int K, typename T, class D, class VecOp, class ScalarOp>
HWY_INLINE void StreamShiftedRows(D d, int64_t C, int64_t r0, int64_t r1, T* out,
                                  const Acc<T>* const (&coef)[K], VecOp&& vop, ScalarOp&& sop) {
  using A = Acc<T>;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const int64_t e0 = r0 * C, e1 = r1 * C;
  int64_t head = StreamHead(d, out + e0);
  head = head < e1 - e0 ? head : e1 - e0;
  for (int64_t e = e0; e < e0 + head; ++e) out[e] = sop(e, e - e0);
  // Aligned vectors start at channel `head` of each row; the straddling one at C - N + head.
  HWY_ALIGN A wrap[K][hn::MaxLanes(d)];
  for (int k = 0; k < K; ++k) {
    for (int64_t j = 0; j < N; ++j) wrap[k][j] = coef[k][(C - N + head + j) % C];
  }
  hn::Vec<D> wrapv[K], cv[K];
  for (int k = 0; k < K; ++k) wrapv[k] = hn::Load(d, wrap[k]);
  // Rows wider than a page go tile by tile (as ApplyRows' tiled rows): a vector belongs to the
  // tile of its first channel, the straddling one to the last tile.
  const int64_t vectors = C / N;
  const int64_t tile = C * static_cast<int64_t>(sizeof(T)) > kPageBytes
                           ? kPageBytes / static_cast<int64_t>(sizeof(T)) / N
                           : vectors;
  // The aligned vectors lie wholly in [e0, e1) from e0 + head up to `last` (exclusive).
  const int64_t last = e0 + head + (e1 - e0 - head) / N * N;
  for (int64_t j0 = 0; j0 < vectors; j0 += tile) {
    const int64_t j1 = j0 + tile < vectors ? j0 + tile : vectors;
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t j = j0; j < j1; ++j) {
        const int64_t c = head + j * N;
        const int64_t e = r * C + c;
        if (e + N > last) break;
        if (c + N <= C) {
          for (int k = 0; k < K; ++k) cv[k] = hn::LoadU(d, coef[k] + c);
          StoreAcc(d, vop(e, cv), out + e, true);
        } else {
          StoreAcc(d, vop(e, wrapv), out + e, true);
        }
      }
    }
  }
  for (int64_t e = last; e < e1; ++e) out[e] = sop(e, (e - e0) % C);
}

// Whether StreamShiftedRows serves a call asked to stream whose rows do not start aligned.
template <typename T, class D>
HWY_INLINE bool StreamsShifted(D d, bool stream, bool nt, int64_t C, int64_t c0, int64_t c1,
                               const T* out) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  return HWY_TARGET != HWY_SCALAR && sizeof(T) >= 4 && stream && !nt && c0 == 0 && c1 == C &&
         C % N == 0 && StreamHead(d, out) > 0;
}

#if FBN_BF16_PAIRS
// bfloat16 outputs off a line stream shifted too, in whole pairs (2·N values): the coefficients
// are rotated so that channel `head` comes first and split into even and odd lanes
// (SplitCoefficients), so that every pair step of a row, the straddling one included, reads the
// next split block. pair(e, sp, width) gives the bits of elements [e, e + 2·N) from the split
// block at sp (arrays `width` apart); sop(e, c) one element. C must be a multiple of 2·N.
// Aligned / misaligned time (16 bytes past a line), regular stores before, streamed shifted
// after: 32x28x28x512 inference 0.68x -> 1.02x, training forwards 0.67-0.86x -> 0.94-1.28x,
// training gradients 0.72-0.79x -> 0.91-1.05x, frozen gradients 0.68-0.86x -> 0.71-0.93x;
// 128x7x7x2048 inference unchanged (0.75x, 0.74x).
template <int K, class D, class PairOp, class ScalarOp>
HWY_INLINE void StreamShiftedPairs(D d, int64_t C, int64_t r0, int64_t r1, BFloat16* out,
                                   const float* const (&coef)[K], PairOp&& pair, ScalarOp&& sop) {
  const int64_t P = 2 * static_cast<int64_t>(hn::Lanes(d));
  const int64_t e0 = r0 * C, e1 = r1 * C;
  int64_t head = StreamHead(d, out + e0);
  head = head < e1 - e0 ? head : e1 - e0;
  for (int64_t e = e0; e < e0 + head; ++e) out[e] = sop(e, e - e0);
  thread_local std::vector<float> rotated;
  if (rotated.size() < static_cast<size_t>(K * C)) rotated.resize(static_cast<size_t>(K * C));
  const float* arrays[K];
  for (int k = 0; k < K; ++k) {
    float* r = rotated.data() + k * C;
    std::copy(coef[k] + head, coef[k] + C, r);
    std::copy(coef[k], coef[k] + head, r + C - head);
    arrays[k] = r;
  }
  const float* sp = SplitCoefficients(d, arrays, K, 0, C);
  const hn::RebindToUnsigned<D> du;
  const int64_t last = e0 + head + (e1 - e0 - head) / P * P;
  int64_t c = 0;  // the step's first channel, counted from `head`
  for (int64_t e = e0 + head; e < last; e += P) {
    StorePairBits(du, pair(e, sp + c, C), out + e, true);
    c += P;
    if (c >= C) c -= C;
  }
  for (int64_t e = last; e < e1; ++e) out[e] = sop(e, (e - e0) % C);
}

// Whether StreamShiftedPairs serves a bfloat16 call asked to stream whose pairs do not start
// aligned.
template <typename T, class D>
HWY_INLINE bool StreamsShiftedPairs(D d, bool stream, int64_t C, int64_t c0, int64_t c1,
                                    const T* out) {
  const int64_t P = 2 * static_cast<int64_t>(hn::Lanes(d));
  return std::is_same_v<T, BFloat16> && stream && c0 == 0 && c1 == C && C % P == 0 &&
         !PairsStream(d, C, c0, out) && StreamHead(d, out) > 0;
}
#endif

// One element of the apply, y = (x - mean)·a + b, and of the backward apply,
// dx = k2·(x - mean) + (k1·dy + k0), rounded as the vectors' MulAdd rounds them: the scalar heads
// and tails must give the lanes' bits, as which elements a call writes one by one depends on
// whether it streams.
template <typename T, typename A>
HWY_INLINE T ApplyOne(T x, A mean, A a, A b) {
  return FromAcc<T>(std::fma(ToAcc(x) - mean, a, b));
}
template <typename T, typename A>
HWY_INLINE T BackwardApplyOne(T dy, T x, A mean, A k1, A k2, A k0) {
  return FromAcc<T>(std::fma(k2, ToAcc(x) - mean, std::fma(k1, ToAcc(dy), k0)));
}

// Channels-last: rows [r0, r1), channels [c0, c1).
template <typename T>
void ApplyRows(const void* xv, int64_t C, int64_t c0, int64_t c1, int64_t r0, int64_t r1,
               const void* mv, const void* av, const void* bv, void* yv, bool stream,
               RowRead read) {
  using A = Acc<T>;
  const T* x = static_cast<const T*>(xv);
  T* y = static_cast<T*>(yv);
  const A* mean = static_cast<const A*>(mv);
  const A* a = static_cast<const A*>(av);
  const A* b = static_cast<const A*>(bv);
  const AccTag<T> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  // Streaming needs every stored vector aligned: whole-vector rows from an aligned start.
  bool nt = stream && C % N == 0 && c0 % N == 0 && StreamAligned(d, y + r0 * C);
  // Outputs off a line (StreamShiftedRows): the elements outside the aligned vectors.
  const A* const coef[3] = {mean, a, b};
  const auto apply_one = [&](int64_t e, int64_t c) { return ApplyOne(x[e], mean[c], a[c], b[c]); };
  if (StreamsShifted(d, stream, nt, C, c0, c1, y + r0 * C)) {
    return StreamShiftedRows<3>(
        d, C, r0, r1, y, coef,
        [&](int64_t e, const hn::Vec<decltype(d)>* v) {
          return hn::MulAdd(hn::Sub(LoadAcc(d, x + e), v[0]), v[1], v[2]);
        },
        apply_one);
  }
#if FBN_BF16_PAIRS
  // Not from L3, where the aligned pairs stream from strips (below), faster than in row order.
  if constexpr (std::is_same_v<T, BFloat16>) {
    if (read != RowRead::kL3 && StreamsShiftedPairs(d, stream, C, c0, c1, y + r0 * C)) {
      return StreamShiftedPairs<3>(
          d, C, r0, r1, y, coef,
          [&](int64_t e, const float* q, int64_t w) {
            hn::Vec<decltype(d)> ev, od;
            LoadBF16Pair(d, x + e, ev, od);
            const auto ye = hn::MulAdd(hn::Sub(ev, hn::LoadU(d, q)), hn::LoadU(d, q + w),
                                       hn::LoadU(d, q + 2 * w));
            const auto yo = hn::MulAdd(hn::Sub(od, hn::LoadU(d, q + N)), hn::LoadU(d, q + w + N),
                                       hn::LoadU(d, q + 2 * w + N));
            return BF16PairBits(d, ye, yo);
          },
          apply_one);
    }
  }
#endif
  // bfloat16 rows from L3 take the strips too, streaming only whole aligned pairs, else storing
  // regularly: per-call alternation (Zen 4, 2 threads) against the row-order stream below,
  // inference 96x35x35x48 0.73x (half-vector streaming stores), 32x28x28x256 0.80x,
  // 96x17x17x160 0.97x; training forward 0.68x, 0.99x, 0.90x; the rest unchanged.
  const bool l3_strips = std::is_same_v<T, BFloat16> && nt && read == RowRead::kL3;
  if (l3_strips) nt = PairsStream(d, C, c0, y + r0 * C);
  // Float rows of whole 2 KB multiples stored regularly go in row order, in tiles of at most a
  // page of channels: strip by strip, a strip's loads and stores down the rows all fall in the same
  // few L1 sets. Whole rows of 8 KB lost (32x7x7x2048 training forward 1.12-1.16x): the three
  // coefficient arrays then overflow L1 with the rows, hence the tiles. Calls of whole rows only,
  // and rows of exactly 4 KB (taken in row order before): the channel groups of batch-1 calls
  // (ForwardTrainingGroups, a thread's group a part of each row) were slower tiled than in strips
  // (fbn_bench, warm: 1x14x14x512 training forward 44 us against 28, 1x7x7x2048 35 against 30).
  // Zen 4, old / new fbn_bench alternating, warm: inference 128x7x7x512 0.69x the time,
  // 32x14x14x512 training forward 0.95x; in one process, alternating calls: 4 KB rows, inference
  // 1x14x14x1024 0.74x (earlier: 1x7x7x1024 0.47-0.49x, 8x14x14x1024 0.63x); with the buffers 16
  // bytes past a line (NumPy's), 32x14x14x512 inference 0.73x. Narrower rows lost (96x8x8x448
  // inference 1.17x, 96x35x35x48 1.27x), as did bfloat16, whose rows here widen value by value
  // (1x7x7x2048 training forward 1.38x, 32x14x14x512 inference 1.38x). The backward apply gained
  // in one process (0.82-0.96x) but lost in fbn_bench and in a full run (32x7x7x512 training
  // gradient 1.1-1.6x), so it keeps the strips.
  const int64_t row_bytes = C * static_cast<int64_t>(sizeof(T));
  // Rows not in cache, stored regularly (the driver's ApplyRead: 16-bit outputs too small to
  // stream), go in row order: strips down the rows read each from DRAM a few lines at a time,
  // which the prefetchers follow poorly. bfloat16 1x14x14x1024 inference, operands flushed,
  // old / new fbn_bench alternating: 33.6 -> 26.6 us; 1x7x7x512 0.94x, 1x28x28x256 and
  // 1x28x28x128 1.0x.
  const bool flushed_rows = read == RowRead::kFlushed && !nt;
  const bool tiled_rows =
      sizeof(T) >= 4 && !nt &&
      (row_bytes == kPageBytes || (row_bytes % kTileRowBytes == 0 && c0 == 0 && c1 == C));
  if (!tiled_rows && !flushed_rows &&
      (!nt || l3_strips || (sizeof(T) >= 4 && !FloatRowsStreamInRowOrder(C, N)))) {
    // Strips with the coefficients in registers: wide rows (2048 channels) would otherwise
    // reload three per-channel arrays that, with the rows, overflow L1; and streaming float rows
    // in row order measured 1.35x slower (Xeon, 32x56x56x256, two threads) than strip by strip.
    const auto strip = [&](auto k, int64_t c) {
      StripApply<decltype(k)::value>(d, x, C, c, r0, r1, mean, a, b, y, nt);
    };
    // Float rows stored regularly take the wide strips, as the backward apply does. Zen 4,
    // alternating calls in one process, 2 threads: 32x28x28x128 inference 0.67x the time,
    // training forward 0.75-0.80x; batch-1 7x7x2048 training forward (channel groups) 0.90x;
    // 15 other ResNet-50 and GoogLeNet shapes 0.95-1.01x.
    const int64_t cv = sizeof(T) >= 4 && !nt
                           ? ForEachStrip<kWideStripVectors>(d, c0, c1, strip)
                           : ForEachStripFor<kApplyStripVectors<T>>(read, d, c0, c1, strip);
    if constexpr (kMaskedTails<T>) {
      if (cv < c1) {
        const int64_t n = c1 - cv;
        const auto vm = LoadAccN(d, mean + cv, n), va = LoadAccN(d, a + cv, n),
                   vb = LoadAccN(d, b + cv, n);
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t o = r * C + cv;
          StoreAccN(d, hn::MulAdd(hn::Sub(LoadAccN(d, x + o, n), vm), va, vb), y + o, n);
        }
      }
      return;
    }
    for (int64_t r = r0; r < r1 && cv < c1; ++r) {
      const T* xr = x + r * C;
      T* yr = y + r * C;
      for (int64_t c = cv; c < c1; ++c) yr[c] = ApplyOne(xr[c], mean[c], a[c], b[c]);
    }
    return;
  }
  // 16-bit rows stream row by row: written strip by strip they measured 40% slower (half-vector
  // stores) and 20% slower (whole pairs, 32x56x56x256 bfloat16).
#if FBN_BF16_PAIRS
  if constexpr (std::is_same_v<T, BFloat16>) {
    if (flushed_rows ? (c1 - c0) % (2 * N) == 0 : PairsStream(d, C, c0, y + r0 * C)) {
      const int64_t width = c1 - c0;
      const float* arrays[3] = {mean, a, b};
      const float* sp = SplitCoefficients(d, arrays, 3, c0, width);
      const hn::RebindToUnsigned<decltype(d)> du;
      const int64_t prefetch_end = r1 * C - kPrefetchAhead<T>;
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t o = r * C + c0;
        for (int64_t c = 0; c < width; c += 2 * N) {
          if (o + c < prefetch_end) hwy::Prefetch(x + o + c + kPrefetchAhead<T>);
          hn::Vec<decltype(d)> ev, od;
          LoadBF16Pair(d, x + o + c, ev, od);
          const float* m = sp + c;
          const float* f = sp + width + c;
          const float* g = sp + 2 * width + c;
          const auto ye =
              hn::MulAdd(hn::Sub(ev, hn::LoadU(d, m)), hn::LoadU(d, f), hn::LoadU(d, g));
          const auto yo = hn::MulAdd(hn::Sub(od, hn::LoadU(d, m + N)), hn::LoadU(d, f + N),
                                     hn::LoadU(d, g + N));
          StorePairBits(du, BF16PairBits(d, ye, yo), y + o + c, nt);
        }
      }
      return;
    }
  }
#endif
  const int64_t tile = tiled_rows ? kPageBytes / static_cast<int64_t>(sizeof(T)) : c1 - c0;
  for (int64_t t0 = c0; t0 < c1; t0 += tile) {
    const int64_t t1 = t0 + tile < c1 ? t0 + tile : c1;
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * C;
      T* yr = y + r * C;
      int64_t c = t0;
      for (; c + N <= t1; c += N) {
        const auto v = hn::Sub(LoadAcc(d, xr + c), hn::LoadU(d, mean + c));
        StoreAcc(d, hn::MulAdd(v, hn::LoadU(d, a + c), hn::LoadU(d, b + c)), yr + c, nt);
      }
      for (; c < t1; ++c) yr[c] = ApplyOne(xr[c], mean[c], a[c], b[c]);
    }
  }
}

// Channels-first planes whose length is not a whole number of vectors leave a vector that
// straddles two planes at every plane boundary. Plane by plane, that vector is a scalar head and a
// masked tail, and when the output streams, its cache line is written by regular stores (a line
// partly streamed costs a read-modify-write in memory), which read the line first. Streaming
// passes over planes of at least one step (a vector, or a bfloat16 pair) instead take whole
// aligned steps across plane boundaries, each lane with its own channel's coefficients: a step
// spans at most two planes, so its first lanes take the current channel's and the rest the next
// channel's. Measured on Zen 4 (2 threads, alternating calls): 128x1024x14x14 float inference
// 0.71x the time, training forwards of 128x2048x7x7 and 32x1024x14x14 float 0.70-0.77x, training
// gradients of 32x2048x7x7 and 128x1024x14x14 float 0.59-0.81x, bfloat16 14x14 training forwards
// 0.62x. Unstreamed calls keep the plane loops: in cache, crossing was 1.0-1.2x slower.
template <typename T>
constexpr int kCrossParts = std::is_same_v<T, BFloat16> ? 1 + FBN_BF16_PAIRS : 1;

template <typename T, class D>
HWY_INLINE bool CrossesPlanes(D d, int64_t S, int64_t f0, int64_t f1, bool stream) {
  const int64_t step = kCrossParts<T> * static_cast<int64_t>(hn::Lanes(d));
  // Ranges of one plane (channel-at-a-time fused passes) have no boundary to cross, and the
  // extra head and tail calls cost 30% on 35x35 planes.
  return stream && f1 - f0 > S && S >= step && S % step != 0 && S <= kCrossPlaneMax;
}

// The first element of [f0, f1) from which the output's steps are aligned for streaming;
// `stream` is cleared where they never align.
template <typename T, class D>
HWY_INLINE int64_t CrossHead(D d, T* y, int64_t f0, int64_t f1, bool& stream) {
  const int64_t head = StreamHead(d, y + f0);
  if (head < 0) stream = false;
  return head > 0 ? std::min(f1, f0 + head) : f0;
}

// Calls op(i, v) for the whole steps [i, i + P·N) of [i, end) and returns the first element
// left. Lane j of v[p][k] holds arrays[k] of element i + P·j + p's channel (P = 2: the even and
// odd values of a bfloat16 pair). Only the channels of elements in [i, end) are read: the
// coefficients of the channels after the range belong to other tasks, written concurrently.
template <int K, int P, class D, typename A, class F>
HWY_INLINE int64_t CrossPlaneSteps(D d, int64_t C, int64_t S, int64_t i, int64_t end,
                                   const A* const (&arrays)[K], F&& op) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(d)), W = P * N;
  if (i + W > end) return i;
  const int64_t plane = i / S;
  int64_t plane_end = (plane + 1) * S, c = plane % C, next = c + 1 == C ? 0 : c + 1;
  hn::Vec<D> v[P][K];
  // Part p's lanes in the plane that ends `rem` elements after i: those with P·j + p < rem.
  const auto blend = [&](int64_t rem, const auto& cur, const auto& nxt) {
    for (int p = 0; p < P; ++p) {
      const auto first = hn::FirstN(d, static_cast<size_t>(std::min((rem + P - 1 - p) / P, N)));
      for (int k = 0; k < K; ++k) v[p][k] = hn::IfThenElse(first, cur(k), nxt(k));
    }
  };
  if (S < 4 * W) {
    // Short planes: no branch per plane. The number of steps within a plane varies from plane to
    // plane, and mispredicting it cost more than blending every step (7x7 float in cache: 1.19x
    // the plane loops' time with the branch, 1.05x blending every step).
    for (; i + W <= end; i += W) {
      const int64_t rem = plane_end - i;
      const int64_t second = rem < W ? next : c;  // the channel of the step's last lanes
      blend(
          rem, [&](int k) { return hn::Set(d, arrays[k][c]); },
          [&](int k) { return hn::Set(d, arrays[k][second]); });
      op(i, v);
      const bool step = rem <= W;
      plane_end += step ? S : 0;
      c = step ? next : c;
      const int64_t after = next + 1 == C ? 0 : next + 1;
      next = step ? after : next;
    }
    return i;
  }
  hn::Vec<D> cur[K], nxt[K];
  for (int k = 0; k < K; ++k) cur[k] = hn::Set(d, arrays[k][c]);
  while (true) {
    // The steps within the current plane, then the one that straddles its end.
    const int64_t stop = std::min(plane_end, end);
    if (i + W <= stop) {
      for (int p = 0; p < P; ++p) {
        for (int k = 0; k < K; ++k) v[p][k] = cur[k];
      }
      for (; i + W <= stop; i += W) op(i, v);
    }
    if (i + W > end) return i;
    // [i, i + W) is in the range and reaches into the next plane.
    for (int k = 0; k < K; ++k) nxt[k] = hn::Set(d, arrays[k][next]);
    if (i < plane_end) {
      blend(
          plane_end - i, [&](int k) { return cur[k]; }, [&](int k) { return nxt[k]; });
      op(i, v);
      i += W;
    }
    plane_end += S;
    next = next + 1 == C ? 0 : next + 1;
    for (int k = 0; k < K; ++k) cur[k] = nxt[k];
  }
}

// Channels-first: flat elements [f0, f1) of an N·C·S tensor, plane by plane.
template <typename T>
void ApplyPlanes(const void* xv, int64_t C, int64_t S, int64_t f0, int64_t f1, const void* mv,
                 const void* av, const void* bv, void* yv, bool stream) {
  using A = Acc<T>;
  const T* x = static_cast<const T*>(xv);
  T* y = static_cast<T*>(yv);
  const A* mean = static_cast<const A*>(mv);
  const A* a = static_cast<const A*>(av);
  const A* b = static_cast<const A*>(bv);
  const AccTag<T> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  // The plane and channel of f0, then advanced plane by plane: ranges spanning many small planes
  // (batch-1 7x7) would otherwise pay two integer divisions per plane.
  int64_t plane = f0 / S, c = plane % C;
  for (int64_t f = f0; f < f1; ++plane, c = c + 1 == C ? 0 : c + 1) {
    const int64_t end = (plane + 1) * S < f1 ? (plane + 1) * S : f1;
    const auto vm = hn::Set(d, mean[c]), va = hn::Set(d, a[c]), vb = hn::Set(d, b[c]);
    int64_t i = f;
    const int64_t head = stream ? StreamHead(d, y + f) : -1;
    const bool nt = head >= 0 && head < end - f;
    if (nt) {
      for (; i < f + head; ++i) y[i] = ApplyOne(x[i], mean[c], a[c], b[c]);
    }
#if FBN_BF16_PAIRS
    if constexpr (std::is_same_v<T, BFloat16>) {
      i = FlatPairs(d, y, i, end, nt, [&](int64_t j) {
        if (nt && j < f1 - kPrefetchAhead<T>) hwy::Prefetch(x + j + kPrefetchAhead<T>);
        hn::Vec<decltype(d)> ev, od;
        LoadBF16Pair(d, x + j, ev, od);
        return BF16PairBits(d, hn::MulAdd(hn::Sub(ev, vm), va, vb),
                            hn::MulAdd(hn::Sub(od, vm), va, vb));
      });
    }
#endif
    const bool nt_rest = nt && kStreamsSingles<T>;
    for (; i + N <= end; i += N) {
      StoreAcc(d, hn::MulAdd(hn::Sub(LoadAcc(d, x + i), vm), va, vb), y + i, nt_rest);
    }
    if constexpr (kMaskedTails<T>) {
      if (i < end)
        StoreAccN(d, hn::MulAdd(hn::Sub(LoadAccN(d, x + i, end - i), vm), va, vb), y + i, end - i);
      i = end;
    }
    for (; i < end; ++i) y[i] = ApplyOne(x[i], mean[c], a[c], b[c]);
    f = end;
  }
}

// Channels-first: flat elements [f0, f1) of an N·C·S tensor.
template <typename T>
void ApplyFlat(const void* xv, int64_t C, int64_t S, int64_t f0, int64_t f1, const void* mv,
               const void* av, const void* bv, void* yv, bool stream) {
  const AccTag<T> d;
  if (!CrossesPlanes<T>(d, S, f0, f1, stream)) {
    return ApplyPlanes<T>(xv, C, S, f0, f1, mv, av, bv, yv, stream);
  }
  using A = Acc<T>;
  const T* x = static_cast<const T*>(xv);
  T* y = static_cast<T*>(yv);
  const A* const arrays[3] = {static_cast<const A*>(mv), static_cast<const A*>(av),
                              static_cast<const A*>(bv)};
  const int64_t i0 = CrossHead(d, y, f0, f1, stream);
  if (i0 > f0) ApplyPlanes<T>(xv, C, S, f0, i0, mv, av, bv, yv, false);
  const auto step = [&](int64_t i, const auto& v) {
#if FBN_BF16_PAIRS
    if constexpr (std::is_same_v<T, BFloat16>) {
      if (i < f1 - kPrefetchAhead<T>) hwy::Prefetch(x + i + kPrefetchAhead<T>);
      hn::Vec<decltype(d)> ev, od;
      LoadBF16Pair(d, x + i, ev, od);
      const auto bits = BF16PairBits(d, hn::MulAdd(hn::Sub(ev, v[0][0]), v[0][1], v[0][2]),
                                     hn::MulAdd(hn::Sub(od, v[1][0]), v[1][1], v[1][2]));
      return StorePairBits(hn::RebindToUnsigned<decltype(d)>(), bits, y + i, stream);
    }
#endif
    StoreAcc(d, hn::MulAdd(hn::Sub(LoadAcc(d, x + i), v[0][0]), v[0][1], v[0][2]), y + i, stream);
  };
  const int64_t i1 = CrossPlaneSteps<3, kCrossParts<T>>(d, C, S, i0, f1, arrays, step);
  if (i1 < f1) ApplyPlanes<T>(xv, C, S, i1, f1, mv, av, bv, yv, false);
}

// ------------------------------------------------------------------------------------------------
// Backward reductions: Σdy and Σdy·(x - m). With `k1` non-null (frozen backward), also writes
// dx = k1·dy in the same sweep.

// Σdy and Σdy·(x - m) of a block for the strip at channel c, into s and t; with k1, dx = k1·dy.
#if FBN_BF16_PAIRS
template <int K, bool kStream, class D>
HWY_INLINE void StripReduceBF16(D d, const BFloat16* dy, const BFloat16* x, int64_t C, int64_t c,
                                int64_t b0, int64_t b1, int64_t prefetch_end, const float* mean,
                                const float* k1, BFloat16* dx, float* s, float* t) {
  constexpr int P = K / 2;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const int64_t cs = c + 2 * P * N;
  const hn::RebindToUnsigned<D> du;
  hn::Vec<D> me[P], mo[P], ke[P], ko[P], ge[P], go[P], xe[P], xo[P];
  for (int p = 0; p < P; ++p) {
    SplitPair(d, mean + c + 2 * p * N, me[p], mo[p]);
    if (k1) SplitPair(d, k1 + c + 2 * p * N, ke[p], ko[p]);
    ge[p] = go[p] = xe[p] = xo[p] = hn::Zero(d);
  }
  const auto ms = K % 2 == 1 ? hn::LoadU(d, mean + cs) : hn::Zero(d);  // odd K only
  auto gs = hn::Zero(d), xs = hn::Zero(d);
  const int64_t nb = b1 - b0;
  for (int64_t r = b0; r < b1; ++r) {
    const int64_t o = r * C;
    for (int p = 0; p < P; ++p) {
      PrefetchNextBlock(dy, C, c + 2 * p * N, r, nb, prefetch_end);
      PrefetchNextBlock(x, C, c + 2 * p * N, r, nb, prefetch_end);
      hn::Vec<D> de, dO, ve, vo;
      LoadBF16Pair(d, dy + o + c + 2 * p * N, de, dO);
      LoadBF16Pair(d, x + o + c + 2 * p * N, ve, vo);
      ge[p] = hn::Add(ge[p], de);
      xe[p] = hn::MulAdd(de, hn::Sub(ve, me[p]), xe[p]);
      go[p] = hn::Add(go[p], dO);
      xo[p] = hn::MulAdd(dO, hn::Sub(vo, mo[p]), xo[p]);
      if (k1) {
        StorePairBits(du, BF16PairBits(d, hn::Mul(de, ke[p]), hn::Mul(dO, ko[p])),
                      dx + o + c + 2 * p * N, kStream);
      }
    }
    if (K % 2 == 1) {
      PrefetchNextBlock(dy, C, cs, r, nb, prefetch_end);
      PrefetchNextBlock(x, C, cs, r, nb, prefetch_end);
      const auto g = LoadAcc(d, dy + o + cs);
      gs = hn::Add(gs, g);
      xs = hn::MulAdd(g, hn::Sub(LoadAcc(d, x + o + cs), ms), xs);
      if (k1) StoreAcc(d, hn::Mul(g, hn::LoadU(d, k1 + cs)), dx + o + cs, kStream);
    }
  }
  for (int p = 0; p < P; ++p) {
    StoreInterleaved(d, ge[p], go[p], s + c + 2 * p * N);
    StoreInterleaved(d, xe[p], xo[p], t + c + 2 * p * N);
  }
  if (K % 2 == 1) {
    hn::StoreU(gs, d, s + cs);
    hn::StoreU(xs, d, t + cs);
  }
}
#endif

// kStream: dx with streaming stores (a compile-time choice: a run-time flag in the store slowed
// the bfloat16 pair kernel, 1x14x14x512 flushed 1.35x).
template <int K, bool kStream, typename T, class D>
HWY_INLINE void StripReduce(D d, const T* dy, const T* x, int64_t C, int64_t c, int64_t b0,
                            int64_t b1, int64_t prefetch_end, const Acc<T>* mean, const Acc<T>* k1,
                            T* dx, Acc<T>* s, Acc<T>* t) {
#if FBN_BF16_PAIRS
  if constexpr (std::is_same_v<T, BFloat16> && K >= 2) {
    return StripReduceBF16<K, kStream>(d, dy, x, C, c, b0, b1, prefetch_end, mean, k1, dx, s, t);
  }
#endif
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  hn::Vec<D> m[K], sg[K], sx[K];
  for (int j = 0; j < K; ++j) {
    m[j] = hn::LoadU(d, mean + c + j * N);
    sg[j] = hn::Zero(d);
    sx[j] = hn::Zero(d);
  }
  const int64_t nb = b1 - b0;
  for (int64_t r = b0; r < b1; ++r) {
    const int64_t o = r * C + c;
    for (int j = 0; j < K; ++j) {
      PrefetchNextBlock(dy, C, c + j * N, r, nb, prefetch_end);
      PrefetchNextBlock(x, C, c + j * N, r, nb, prefetch_end);
      const auto g = LoadAcc(d, dy + o + j * N);
      sg[j] = hn::Add(sg[j], g);
      sx[j] = hn::MulAdd(g, hn::Sub(LoadAcc(d, x + o + j * N), m[j]), sx[j]);
      if (k1) StoreAcc(d, hn::Mul(g, hn::LoadU(d, k1 + c + j * N)), dx + o + j * N, kStream);
    }
  }
  for (int j = 0; j < K; ++j) {
    hn::StoreU(sg[j], d, s + c + j * N);
    hn::StoreU(sx[j], d, t + c + j * N);
  }
}

#if FBN_BF16_PAIRS
// ReduceRows' bfloat16 row sweep of rows [b0, b1), channels [c0, c1) (whole pairs), as the
// generic sweep with pairs: dy and x read as pairs (LoadBF16Pair), dx streamed as whole vectors,
// mean and k1 split into even and odd lanes once per call (`split`), the block sums kept split
// in s and t until the block's end, where they go back to channel order. Per lane the same
// operations in the same order, so the same bits. Rows of 4 KB and more load and store the sums
// once per two rows; shorter rows lost that way (1 KB rows 1.4x slower). Frozen bfloat16
// gradients, calls alternating in one process (Zen 4, 2 threads), pairs / generic sweep:
// 32x28x28x512, 128x14x14x512, 128x14x14x1024 and 128x7x7x2048 0.74-0.76x the time,
// 32x56x56x256 0.82x, 96x17x17x384 0.84-0.85x (warm and cold), 96x71x71x192 0.92x.
template <bool kDx, class D>
HWY_INLINE void ReducePairRows(D d, const BFloat16* dy, const BFloat16* x, int64_t C, int64_t c0,
                               int64_t c1, int64_t b0, int64_t b1, const float* split, BFloat16* dx,
                               float* s, float* t) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const hn::RebindToUnsigned<D> du;
  const int64_t width = c1 - c0;
  for (int64_t c = c0; c < c1; c += N) {
    hn::StoreU(hn::Zero(d), d, s + c);
    hn::StoreU(hn::Zero(d), d, t + c);
  }
  // One row's pair at channel c into the split sums (se, so, te, to).
  const auto row = [&](int64_t o, int64_t c, const float* m, const float* k, hn::Vec<D>& se,
                       hn::Vec<D>& so, hn::Vec<D>& te, hn::Vec<D>& to) {
    hn::Vec<D> ge, go, xe, xo;
    LoadBF16Pair(d, dy + o + c, ge, go);
    LoadBF16Pair(d, x + o + c, xe, xo);
    se = hn::Add(se, ge);
    so = hn::Add(so, go);
    te = hn::MulAdd(ge, hn::Sub(xe, hn::LoadU(d, m)), te);
    to = hn::MulAdd(go, hn::Sub(xo, hn::LoadU(d, m + N)), to);
    if constexpr (kDx) {
      StorePairBits(du,
                    BF16PairBits(d, hn::Mul(ge, hn::LoadU(d, k)), hn::Mul(go, hn::LoadU(d, k + N))),
                    dx + o + c, true);
    }
  };
  // `k` rows from row r: each pair's sums loaded once, updated k times, stored once.
  const auto rows_from = [&](auto k, int64_t r) {
    for (int64_t c = c0; c < c1; c += 2 * N) {
      const float* m = split + (c - c0);
      const float* kc = kDx ? split + width + (c - c0) : nullptr;
      auto se = hn::LoadU(d, s + c), so = hn::LoadU(d, s + c + N);
      auto te = hn::LoadU(d, t + c), to = hn::LoadU(d, t + c + N);
      for (int j = 0; j < decltype(k)::value; ++j) row((r + j) * C, c, m, kc, se, so, te, to);
      hn::StoreU(se, d, s + c);
      hn::StoreU(so, d, s + c + N);
      hn::StoreU(te, d, t + c);
      hn::StoreU(to, d, t + c + N);
    }
  };
  int64_t r = b0;
  if (C * static_cast<int64_t>(sizeof(BFloat16)) >= kPageBytes) {
    for (; r + 2 <= b1; r += 2) rows_from(std::integral_constant<int, 2>(), r);
  }
  for (; r < b1; ++r) rows_from(std::integral_constant<int, 1>(), r);
  for (int64_t c = c0; c < c1; c += 2 * N) {
    StoreInterleaved(d, hn::LoadU(d, s + c), hn::LoadU(d, s + c + N), s + c);
    StoreInterleaved(d, hn::LoadU(d, t + c), hn::LoadU(d, t + c + N), t + c);
  }
}
#endif

// Channels-last rows [r0, r1) and channels [c0, c1), in blocks; block sums accumulate in
// registers strip by strip (in `tmp`, 2·C accumulators, for the channels past the last whole
// vector) and are added to the double sums (indexed by channel) once per block.
template <typename T>
void ReduceRows(const void* dyv, const void* xv, int64_t C, int64_t c0, int64_t c1, int64_t r0,
                int64_t r1, int64_t rows, const void* mv, double* sum_dy, double* sum_dy_xc,
                const void* k1v, void* dxv, void* tmpv, bool stream, RowRead read) {
  using A = Acc<T>;
  const T* dy = static_cast<const T*>(dyv);
  const T* x = static_cast<const T*>(xv);
  const A* mean = static_cast<const A*>(mv);
  const A* k1 = static_cast<const A*>(k1v);
  T* dx = static_cast<T*>(dxv);
  A* s = static_cast<A*>(tmpv);
  A* t = s + C;
  const AccTag<T> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const int64_t block = BlockRows(c1 - c0, sizeof(T), 2, read);
  // Into the next task's rows too: its first block is otherwise read with nothing ahead of it
  // (training-gradient sums, operands flushed, 1.6-6.4 MB: 0.89-0.99x the time prefetching
  // within the task only, 0.81-0.88x across; DRAM-sized tensors 0.99-1.0x).
  const bool prefetch = read == RowRead::kPrefetch || read == RowRead::kFlushed;
  const int64_t prefetch_end = prefetch ? std::min(rows, r1 + block) : r0;
  const bool nt = k1 && stream && C % N == 0 && c0 % N == 0 && StreamAligned(d, dx + r0 * C);
  // A frozen backward streaming dx sweeps the rows in row order (below), except from L3: there
  // the strips, with the sums in registers, took 0.41-0.96x its time, streaming too (per-call
  // alternation, Zen 4, 2 threads, tensors of 1.8-12.8 MB: float 32x14x14x256, 96x17x17x64/96,
  // 32x28x28x64/128; bfloat16 32x28x28x128, 32x7x7x2048, 128x7x7x512, 96x17x17x160). Calls
  // that fit L2 but stream (input flushed: 1x14x14x256 float, 1x14x14x512 bfloat16) were
  // 1.35-1.42x slower in strips. The strips stream bfloat16 only in whole aligned pairs
  // (PairsStream), else store regularly. Flushed L3-sized calls take the strips with prefetches
  // (0.54-0.96x the row sweep's time, kFlushed).
  // Rows of up to kNarrowRowChannels from tensors under the prefetch size (kDram: 16-64 MB here,
  // partly still in the L3 when warm) take the strips too: the row sweep's in-memory block sums
  // cost more per byte on such short rows (warm, alternating calls, strips / row sweep, medians
  // of 2-4 rounds in three sessions: bfloat16 96x96x35x35 0.28-0.32x, 128x64x56x56 0.18-0.88x,
  // 32x128x56x56 0.63-0.82x, 96x128x35x35 0.89x; float 96x64x35x35 0.22-0.86x, 32x64x56x56
  // 0.19-0.84x, 96x96x35x35 0.51-1.04x, 32x128x56x56 0.85-1.06x), and so did 160 and 192
  // channels (float 96x160x17x17 0.73x, 96x192x17x17 0.72x warm, 0.78x cold). Wider rows lost
  // (256 channels 1.2-1.4x at 26 and 51 MB, 1024-2048 1.2x, 512 1.0-1.06x) and keep the row
  // sweep, as do tensors of 64 MB and more (96x80x73x73 bfloat16, 82 MB: 0.97-1.13x).
  const bool narrow_rows = read == RowRead::kDram && C <= kNarrowRowChannels;
  // The training gradient's sums (no dx) of rows not in cache (kFlushed) over kNarrowSumChannels
  // sweep rows in order too, the block sums in L1 (same operations per lane, so the same bits):
  // strips read each row a few lines at a time, which the prefetchers follow poorly from DRAM
  // even with software prefetches. Float training gradients, operands flushed, old / new
  // fbn_bench alternating (Zen 4, 2 threads): 1x28x28x256, 1x28x28x512, 1x56x56x256 0.74-0.83x
  // the time, 32x7x7x512, 128x7x7x512, 96x8x8x384 0.79-0.94x (noisier), 32x14x14x256
  // 0.88-1.0x; bfloat16 with pairs: 32x14x14x256, 96x17x17x192, 32x7x7x512 0.92-0.95x. Rows of
  // 128 channels and fewer gained nothing or lost (bfloat16 96x35x35x64 1.04-1.15x); calls in
  // cache and batch-1 rows of 7x7 and 14x14 were level.
  const bool sums_sweep = !k1 && read == RowRead::kFlushed && C > kNarrowSumChannels;
  const bool row_sweep =
      sums_sweep || (nt && read != RowRead::kL3 && read != RowRead::kFlushed && !narrow_rows);
  const bool strip_nt =
      nt && !row_sweep && (!std::is_same_v<T, BFloat16> || PairsStream(d, C, c0, dx + r0 * C));
  // dx asked to stream but not aligned (StreamShiftedRows): the strips take the sums alone, and
  // each block's dx streams from its rows just read, still in L2.
#if FBN_BF16_PAIRS
  const bool shifted_pairs = k1 && StreamsShiftedPairs(d, stream, C, c0, c1, dx + r0 * C);
#else
  constexpr bool shifted_pairs = false;
#endif
  const bool shifted =
      shifted_pairs || (k1 && StreamsShifted(d, stream, nt, C, c0, c1, dx + r0 * C));
  const A* strip_k1 = shifted ? nullptr : k1;
  const A* const coef[1] = {k1};
  const auto dx_one = [&](int64_t e, int64_t c) { return FromAcc<T>(ToAcc(dy[e]) * k1[c]); };
  for (int64_t c = c0; c < c1; ++c) sum_dy[c] = sum_dy_xc[c] = 0.0;
#if FBN_BF16_PAIRS
  // bfloat16 row sweeps of whole pairs take ReducePairRows.
  const bool pair_sweep = std::is_same_v<T, BFloat16> && row_sweep && (c1 - c0) % (2 * N) == 0 &&
                          (sums_sweep || PairsStream(d, C, c0, dx + r0 * C));
  const float* split = nullptr;
  if constexpr (std::is_same_v<T, BFloat16>) {
    if (pair_sweep) {
      const float* arrays[2] = {mean, k1};
      split = SplitCoefficients(d, arrays, k1 ? 2 : 1, c0, c1 - c0);
    }
  }
#else
  constexpr bool pair_sweep = false;
#endif
  for (int64_t b0 = r0; b0 < r1; b0 += block) {
    const int64_t b1 = b0 + block < r1 ? b0 + block : r1;
    int64_t cv = c0 + (c1 - c0) / N * N;
    if (pair_sweep) {
#if FBN_BF16_PAIRS
      if constexpr (std::is_same_v<T, BFloat16>) {
        if (sums_sweep) {
          ReducePairRows<false>(d, dy, x, C, c0, c1, b0, b1, split, dx, s, t);
        } else {
          ReducePairRows<true>(d, dy, x, C, c0, c1, b0, b1, split, dx, s, t);
        }
      }
#endif
    } else if (row_sweep) {
      // One row-major sweep reading dy and x in order, with the block sums in memory (strips
      // measured 12-35% slower from DRAM, reading and writing each row in pieces).
      for (int64_t c = c0; c < cv; ++c) s[c] = t[c] = A(0);
      // Rows of 4 KB and more load and store the sums once per two rows (same operations per
      // lane, so the same bits): frozen float gradients alternating in one process, 128x7x7x2048
      // 0.81-0.84x the time warm and cold, 32x14x14x1024 0.88x, 128x14x14x1024 0.95x.
      const auto sweep = [&](auto with_dx) {
        constexpr bool kDx = decltype(with_dx)::value;
        int64_t r = b0;
        if (C * static_cast<int64_t>(sizeof(T)) >= kPageBytes) {
          for (; r + 2 <= b1; r += 2) {
            const int64_t o = r * C;
            for (int64_t c = c0; c < cv; c += N) {
              const auto m = hn::LoadU(d, mean + c);
              const auto g0 = LoadAcc(d, dy + o + c), g1 = LoadAcc(d, dy + o + C + c);
              const auto x0 = hn::Sub(LoadAcc(d, x + o + c), m);
              const auto x1 = hn::Sub(LoadAcc(d, x + o + C + c), m);
              hn::StoreU(hn::Add(hn::Add(hn::LoadU(d, s + c), g0), g1), d, s + c);
              hn::StoreU(hn::MulAdd(g1, x1, hn::MulAdd(g0, x0, hn::LoadU(d, t + c))), d, t + c);
              if constexpr (kDx) {
                const auto k = hn::LoadU(d, k1 + c);
                StoreAcc(d, hn::Mul(g0, k), dx + o + c, true);
                StoreAcc(d, hn::Mul(g1, k), dx + o + C + c, true);
              }
            }
          }
        }
        for (; r < b1; ++r) {
          const int64_t o = r * C;
          for (int64_t c = c0; c < cv; c += N) {
            const auto g = LoadAcc(d, dy + o + c);
            const auto xc = hn::Sub(LoadAcc(d, x + o + c), hn::LoadU(d, mean + c));
            hn::StoreU(hn::Add(hn::LoadU(d, s + c), g), d, s + c);
            hn::StoreU(hn::MulAdd(g, xc, hn::LoadU(d, t + c)), d, t + c);
            if constexpr (kDx) StoreAcc(d, hn::Mul(g, hn::LoadU(d, k1 + c)), dx + o + c, true);
          }
        }
      };
      if (sums_sweep) {
        sweep(std::false_type());
      } else {
        sweep(std::true_type());
      }
    } else {
      const auto strip = [&](auto k, int64_t c) {
        constexpr int K = decltype(k)::value;
        if (strip_nt) {
          StripReduce<K, true>(d, dy, x, C, c, b0, b1, prefetch_end, mean, strip_k1, dx, s, t);
        } else {
          StripReduce<K, false>(d, dy, x, C, c, b0, b1, prefetch_end, mean, strip_k1, dx, s, t);
        }
      };
      cv = ForEachStripFor<kReduceStripVectors<T>>(read, d, c0, c1, strip);
    }
    if (cv < c1) {
      for (int64_t c = cv; c < c1; ++c) s[c] = t[c] = A(0);
      for (int64_t r = b0; r < b1; ++r) {
        const int64_t o = r * C;
        for (int64_t c = cv; c < c1; ++c) {
          const A g = ToAcc(dy[o + c]);
          s[c] += g;
          t[c] += g * (ToAcc(x[o + c]) - mean[c]);
          if (strip_k1) dx[o + c] = FromAcc<T>(g * k1[c]);
        }
      }
    }
#if FBN_BF16_PAIRS
    if constexpr (std::is_same_v<T, BFloat16>) {
      if (shifted_pairs) {
        StreamShiftedPairs<1>(
            d, C, b0, b1, dx, coef,
            [&](int64_t e, const float* q, int64_t) {
              hn::Vec<decltype(d)> ge, go;
              LoadBF16Pair(d, dy + e, ge, go);
              return BF16PairBits(d, hn::Mul(ge, hn::LoadU(d, q)),
                                  hn::Mul(go, hn::LoadU(d, q + N)));
            },
            dx_one);
      }
    }
#endif
    if (shifted && !shifted_pairs) {
      StreamShiftedRows<1>(
          d, C, b0, b1, dx, coef,
          [&](int64_t e, const hn::Vec<decltype(d)>* v) {
            return hn::Mul(LoadAcc(d, dy + e), v[0]);
          },
          dx_one);
    }
    for (int64_t c = c0; c < c1; ++c) {
      sum_dy[c] += static_cast<double>(s[c]);
      sum_dy_xc[c] += static_cast<double>(t[c]);
    }
  }
}

// Channels-first: elements [v0, v1) of channel c (planes `plane_stride` apart from the channel's
// first element at offset `base`).
template <typename T>
void ReduceRun(const void* dyv, const void* xv, int64_t base, int64_t plane_stride, int64_t S,
               int64_t v0, int64_t v1, Acc<T> mean, double* sum_dy, double* sum_dy_xc, Acc<T> k1,
               void* dxv, bool stream) {
  using A = Acc<T>;
  const T* dy = static_cast<const T*>(dyv);
  const T* x = static_cast<const T*>(xv);
  T* dx = static_cast<T*>(dxv);
  const AccTag<T> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const auto vm = hn::Set(d, mean);
  const auto vk = hn::Set(d, k1);
  double total_s = 0, total_t = 0;
  // As BlockTwoPass: long planes prefetch ahead along the channel.
  const bool cursor = S * static_cast<int64_t>(sizeof(T)) > kShortRunBytes;
  PrefetchCursor<T> ahead_dy(dy + base, plane_stride, S, v0 + kPrefetchAhead<T>, v1);
  PrefetchCursor<T> ahead_x(x + base, plane_stride, S, v0 + kPrefetchAhead<T>, v1);
  int64_t v = v0;
  while (v < v1) {
    const int64_t plane = v / S, off = v % S;
    int64_t len = S - off;
    if (len > v1 - v) len = v1 - v;
    if (len > kRunBlock) len = kRunBlock;
    const int64_t at = base + plane * plane_stride + off;
    // Streaming only where the run is aligned for it; the sums never depend on the alignment.
    const bool nt = dx && stream && StreamAligned(d, dx + at);
    auto s = hn::Zero(d), t = hn::Zero(d);
    int64_t i = 0;
    for (; cursor && i + 2 * N <= len; i += 2 * N) {
      ahead_dy.Next(2 * N);
      ahead_x.Next(2 * N);
      for (int64_t u = i; u < i + 2 * N; u += N) {  // the order of the loop below
        const auto g = LoadAcc(d, dy + at + u);
        s = hn::Add(s, g);
        t = hn::MulAdd(g, hn::Sub(LoadAcc(d, x + at + u), vm), t);
        if (dx) StoreAcc(d, hn::Mul(g, vk), dx + at + u, nt);
      }
    }
    for (; i + N <= len; i += N) {
      const auto g = LoadAcc(d, dy + at + i);
      s = hn::Add(s, g);
      t = hn::MulAdd(g, hn::Sub(LoadAcc(d, x + at + i), vm), t);
      if (dx) StoreAcc(d, hn::Mul(g, vk), dx + at + i, nt);
    }
    A ss = hn::GetLane(hn::SumOfLanes(d, s));
    A tt = hn::GetLane(hn::SumOfLanes(d, t));
    for (; i < len; ++i) {
      const A g = ToAcc(dy[at + i]);
      ss += g;
      tt = std::fma(g, ToAcc(x[at + i]) - mean, tt);  // as ReduceChannels: see there
      if (dx) dx[at + i] = FromAcc<T>(g * k1);
    }
    total_s += static_cast<double>(ss);
    total_t += static_cast<double>(tt);
    v += len;
  }
  *sum_dy = total_s;
  *sum_dy_xc = total_t;
}

// Channels-first sums of whole channels [c0, c1) of an images x C x S tensor, as ReduceRun per
// channel gives them (with dx = k1·dy where k1 is non-null), K channels interleaved as in
// BlockTwoPass: small planes are dominated by each run's two lane reductions, and an image's
// planes of K adjacent channels are one run the prefetchers follow (96x320x8x8 bfloat16 frozen
// gradient flushed 1616 -> 719 us, one channel at a time before).
template <int K, typename T>
HWY_INLINE void ReduceChannels(const T* dy, const T* x, const int64_t* first, int64_t plane_stride,
                               int64_t S, int64_t M, const Acc<T>* mean, const Acc<T>* k1, T* dx,
                               bool stream, double* sum_dy, double* sum_dy_xc) {
  using A = Acc<T>;
  const AccTag<T> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  hn::Vec<decltype(d)> vm[K], vk[K];
  double total_s[K], total_t[K];
  for (int j = 0; j < K; ++j) {
    vm[j] = hn::Set(d, mean[j]);
    vk[j] = hn::Set(d, k1 ? k1[j] : A(0));
    total_s[j] = total_t[j] = 0;
  }
  // As BlockTwoPass: long planes (one channel at a time) prefetch ahead along the channel.
  const bool cursor = K == 1 && S * static_cast<int64_t>(sizeof(T)) > kShortRunBytes;
  PrefetchCursor<T> ahead_dy(dy + first[0], plane_stride, S, kPrefetchAhead<T>, M);
  PrefetchCursor<T> ahead_x(x + first[0], plane_stride, S, kPrefetchAhead<T>, M);
  for (int64_t v = 0; v < M;) {
    const int64_t plane = v / S, off = v % S;
    int64_t len = S - off;
    if (len > M - v) len = M - v;
    if (len > kRunBlock) len = kRunBlock;
    const int64_t o = plane * plane_stride + off;
    for (int j = 0; j < K; ++j) {
      PrefetchPlaneAhead(dy + first[j] + o, plane_stride, S, len, v, M);
      PrefetchPlaneAhead(x + first[j] + o, plane_stride, S, len, v, M);
    }
    hn::Vec<decltype(d)> sv[K], tv[K];
    for (int j = 0; j < K; ++j) sv[j] = tv[j] = hn::Zero(d);
    bool nt[K];
    for (int j = 0; j < K; ++j) nt[j] = dx && stream && StreamAligned(d, dx + first[j] + o);
    int64_t i = 0;
    for (; cursor && i + 2 * N <= len; i += 2 * N) {
      ahead_dy.Next(2 * N);
      ahead_x.Next(2 * N);
      for (int64_t u = i; u < i + 2 * N; u += N) {  // the order of the loop below
        const int64_t at = first[0] + o + u;
        const auto g = LoadAcc(d, dy + at);
        sv[0] = hn::Add(sv[0], g);
        tv[0] = hn::MulAdd(g, hn::Sub(LoadAcc(d, x + at), vm[0]), tv[0]);
        if (dx) StoreAcc(d, hn::Mul(g, vk[0]), dx + at, nt[0]);
      }
    }
    for (; i + N <= len; i += N) {
      for (int j = 0; j < K; ++j) {
        const int64_t at = first[j] + o + i;
        const auto g = LoadAcc(d, dy + at);
        sv[j] = hn::Add(sv[j], g);
        tv[j] = hn::MulAdd(g, hn::Sub(LoadAcc(d, x + at), vm[j]), tv[j]);
        if (dx) StoreAcc(d, hn::Mul(g, vk[j]), dx + at, nt[j]);
      }
    }
    A ss[K], tt[K];
    for (int j = 0; j < K; ++j) {
      ss[j] = hn::GetLane(hn::SumOfLanes(d, sv[j]));
      tt[j] = hn::GetLane(hn::SumOfLanes(d, tv[j]));
    }
    for (; i < len; ++i) {
      for (int j = 0; j < K; ++j) {
        const int64_t at = first[j] + o + i;
        const A g = ToAcc(dy[at]);
        ss[j] += g;
        // An explicit FMA, as the vector part's: left to contraction, the compiler fused this
        // and not ReduceRun's, and the four-channel sums differed from the one-channel ones.
        tt[j] = std::fma(g, ToAcc(x[at]) - mean[j], tt[j]);
        if (dx) dx[at] = FromAcc<T>(g * k1[j]);
      }
    }
    for (int j = 0; j < K; ++j) {
      total_s[j] += static_cast<double>(ss[j]);
      total_t[j] += static_cast<double>(tt[j]);
    }
    v += len;
  }
  for (int j = 0; j < K; ++j) {
    sum_dy[j] = total_s[j];
    sum_dy_xc[j] = total_t[j];
  }
}

// The type-erased operands of the channels-first sums; dx only where k1 asks for it.
template <typename T>
struct ReduceOperands {
  ReduceOperands(const void* dyv, const void* xv, const void* mv, const void* k1v, void* dxv)
      : dy(static_cast<const T*>(dyv)),
        x(static_cast<const T*>(xv)),
        mean(static_cast<const Acc<T>*>(mv)),
        k1(static_cast<const Acc<T>*>(k1v)),
        dx(k1v ? static_cast<T*>(dxv) : nullptr) {}
  const T* dy;
  const T* x;
  const Acc<T>* mean;
  const Acc<T>* k1;
  T* dx;
};

template <typename T>
void ReduceRuns(const void* dyv, const void* xv, int64_t C, int64_t S, int64_t images, int64_t c0,
                int64_t c1, const void* mv, double* sum_dy, double* sum_dy_xc, const void* k1v,
                void* dxv, bool stream) {
  const ReduceOperands<T> o(dyv, xv, mv, k1v, dxv);
  const int64_t M = images * S;
  constexpr int K = 4;
  int64_t c = c0;
  // Four channels where StatsRuns takes four (short channels or short planes); with dx, short
  // planes only: batch-1 14x14 float and 28x28 bfloat16 frozen gradients from memory took 1.3-1.9x
  // as long four at a time (1x512x14x14 float 70 -> 101 us in the full runs).
  const bool short_planes = S * static_cast<int64_t>(sizeof(T)) <= kShortPlaneBytes;
  const bool several = short_planes || (M <= kRunBlock && o.k1 == nullptr);
  for (; several && c + K <= c1; c += K) {
    int64_t first[K];
    for (int j = 0; j < K; ++j) first[j] = (c + j) * S;
    ReduceChannels<K>(o.dy, o.x, first, C * S, S, M, o.mean + c, o.k1 ? o.k1 + c : nullptr, o.dx,
                      stream, sum_dy + c, sum_dy_xc + c);
  }
  for (; c < c1; ++c) {
    const int64_t first = c * S;
    ReduceChannels<1>(o.dy, o.x, &first, C * S, S, M, o.mean + c, o.k1 ? o.k1 + c : nullptr, o.dx,
                      stream, sum_dy + c, sum_dy_xc + c);
  }
}

// Channels-first sums of channels [c0, c1) over images [n0, n1), read in memory order: each
// plane's sums are ReduceChannels' for that plane (four channels at a time where ReduceRuns takes
// four), added per channel in image order (sum_dy and sum_dy_xc indexed by channel; with k1
// non-null also dx = k1·dy).
template <typename T>
void ReduceImages(const void* dyv, const void* xv, int64_t C, int64_t S, int64_t c0, int64_t c1,
                  int64_t n0, int64_t n1, const void* mv, double* sum_dy, double* sum_dy_xc,
                  const void* k1v, void* dxv, bool stream) {
  const ReduceOperands<T> o(dyv, xv, mv, k1v, dxv);
  const bool short_planes = S * static_cast<int64_t>(sizeof(T)) <= kShortPlaneBytes;
  for (int64_t c = c0; c < c1; ++c) sum_dy[c] = sum_dy_xc[c] = 0.0;
  for (int64_t n = n0; n < n1; ++n) {
    const auto planes = [&](auto k, int64_t c) {
      constexpr int K = decltype(k)::value;
      int64_t first[K];
      for (int j = 0; j < K; ++j) first[j] = (n * C + c + j) * S;
      double ps[K], pt[K];
      ReduceChannels<K>(o.dy, o.x, first, C * S, S, S, o.mean + c, o.k1 ? o.k1 + c : nullptr, o.dx,
                        stream, ps, pt);
      for (int j = 0; j < K; ++j) {
        sum_dy[c + j] += ps[j];
        sum_dy_xc[c + j] += pt[j];
      }
    };
    int64_t c = c0;
    for (; short_planes && c + 4 <= c1; c += 4) planes(std::integral_constant<int, 4>(), c);
    for (; c < c1; ++c) planes(std::integral_constant<int, 1>(), c);
  }
}

// ------------------------------------------------------------------------------------------------
// Backward apply: dx = k1·dy + k2·(x - m) + k0.

#if FBN_BF16_PAIRS
// StripBackwardApply for bfloat16 with K >= 2, in pairs as StripApplyBF16.
template <int K, class D>
HWY_INLINE void StripBackwardApplyBF16(D d, const BFloat16* dy, const BFloat16* x, int64_t C,
                                       int64_t c, int64_t r0, int64_t r1, const float* mean,
                                       const float* k1, const float* k2, const float* k0,
                                       BFloat16* dx, bool nt) {
  constexpr int P = K / 2;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const hn::RebindToUnsigned<D> du;
  hn::Vec<D> me[P], mo[P], e1[P], o1[P], e2[P], o2[P], e0[P], o0[P];
  for (int p = 0; p < P; ++p) {
    SplitPair(d, mean + c + 2 * p * N, me[p], mo[p]);
    SplitPair(d, k1 + c + 2 * p * N, e1[p], o1[p]);
    SplitPair(d, k2 + c + 2 * p * N, e2[p], o2[p]);
    SplitPair(d, k0 + c + 2 * p * N, e0[p], o0[p]);
  }
  const int64_t cs = c + 2 * P * N;  // the single vector of an odd K
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t o = r * C + c;
    for (int p = 0; p < P; ++p) {
      hn::Vec<D> xe, xo, ge, go;
      LoadBF16Pair(d, x + o + 2 * p * N, xe, xo);
      LoadBF16Pair(d, dy + o + 2 * p * N, ge, go);
      const auto ve = hn::MulAdd(e2[p], hn::Sub(xe, me[p]), hn::MulAdd(e1[p], ge, e0[p]));
      const auto vo = hn::MulAdd(o2[p], hn::Sub(xo, mo[p]), hn::MulAdd(o1[p], go, o0[p]));
      StorePairBits(du, BF16PairBits(d, ve, vo), dx + o + 2 * p * N, nt);
    }
    if (K % 2 == 1) {
      const int64_t os = r * C + cs;
      const auto xc = hn::Sub(LoadAcc(d, x + os), hn::LoadU(d, mean + cs));
      const auto t = hn::MulAdd(hn::LoadU(d, k1 + cs), LoadAcc(d, dy + os), hn::LoadU(d, k0 + cs));
      StoreAcc(d, hn::MulAdd(hn::LoadU(d, k2 + cs), xc, t), dx + os, nt);
    }
  }
}
#endif

// dx = k1·dy + k2·(x - m) + k0 for rows [r0, r1) of the strip at channel c, coefficients in
// registers.
template <int K, typename T, class D>
HWY_INLINE void StripBackwardApply(D d, const T* dy, const T* x, int64_t C, int64_t c, int64_t r0,
                                   int64_t r1, const Acc<T>* mean, const Acc<T>* k1,
                                   const Acc<T>* k2, const Acc<T>* k0, T* dx, bool nt) {
#if FBN_BF16_PAIRS
  if constexpr (std::is_same_v<T, BFloat16> && K >= 2) {
    return StripBackwardApplyBF16<K>(d, dy, x, C, c, r0, r1, mean, k1, k2, k0, dx, nt);
  }
#endif
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  hn::Vec<D> vm[K], v1[K], v2[K], v0[K];
  for (int j = 0; j < K; ++j) {
    vm[j] = hn::LoadU(d, mean + c + j * N);
    v1[j] = hn::LoadU(d, k1 + c + j * N);
    v2[j] = hn::LoadU(d, k2 + c + j * N);
    v0[j] = hn::LoadU(d, k0 + c + j * N);
  }
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t o = r * C + c;
    for (int j = 0; j < K; ++j) {
      const auto xc = hn::Sub(LoadAcc(d, x + o + j * N), vm[j]);
      const auto t = hn::MulAdd(v1[j], LoadAcc(d, dy + o + j * N), v0[j]);
      StoreAcc(d, hn::MulAdd(v2[j], xc, t), dx + o + j * N, nt);
    }
  }
}

// Channels-last: rows [r0, r1), channels [c0, c1).
template <typename T>
void BackwardApplyRows(const void* dyv, const void* xv, int64_t C, int64_t c0, int64_t c1,
                       int64_t r0, int64_t r1, const void* mv, const void* k1v, const void* k2v,
                       const void* k0v, void* dxv, bool stream) {
  using A = Acc<T>;
  const T* dy = static_cast<const T*>(dyv);
  const T* x = static_cast<const T*>(xv);
  T* dx = static_cast<T*>(dxv);
  const A* mean = static_cast<const A*>(mv);
  const A* k1 = static_cast<const A*>(k1v);
  const A* k2 = static_cast<const A*>(k2v);
  const A* k0 = static_cast<const A*>(k0v);
  const AccTag<T> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const bool nt = stream && C % N == 0 && c0 % N == 0 && StreamAligned(d, dx + r0 * C);
  // Outputs off a line (StreamShiftedRows): the elements outside the aligned vectors.
  const A* const coef[4] = {mean, k1, k2, k0};
  const auto dx_one = [&](int64_t e, int64_t c) {
    return BackwardApplyOne(dy[e], x[e], mean[c], k1[c], k2[c], k0[c]);
  };
  if (StreamsShifted(d, stream, nt, C, c0, c1, dx + r0 * C)) {
    return StreamShiftedRows<4>(
        d, C, r0, r1, dx, coef,
        [&](int64_t e, const hn::Vec<decltype(d)>* v) {
          const auto xc = hn::Sub(LoadAcc(d, x + e), v[0]);
          return hn::MulAdd(v[2], xc, hn::MulAdd(v[1], LoadAcc(d, dy + e), v[3]));
        },
        dx_one);
  }
#if FBN_BF16_PAIRS
  if constexpr (std::is_same_v<T, BFloat16>) {
    if (StreamsShiftedPairs(d, stream, C, c0, c1, dx + r0 * C)) {
      return StreamShiftedPairs<4>(
          d, C, r0, r1, dx, coef,
          [&](int64_t e, const float* q, int64_t w) {
            hn::Vec<decltype(d)> xe, xo, ge, go;
            LoadBF16Pair(d, x + e, xe, xo);
            LoadBF16Pair(d, dy + e, ge, go);
            const auto ve =
                hn::MulAdd(hn::LoadU(d, q + 2 * w), hn::Sub(xe, hn::LoadU(d, q)),
                           hn::MulAdd(hn::LoadU(d, q + w), ge, hn::LoadU(d, q + 3 * w)));
            const auto vo =
                hn::MulAdd(hn::LoadU(d, q + 2 * w + N), hn::Sub(xo, hn::LoadU(d, q + N)),
                           hn::MulAdd(hn::LoadU(d, q + w + N), go, hn::LoadU(d, q + 3 * w + N)));
            return BF16PairBits(d, ve, vo);
          },
          dx_one);
    }
  }
#endif
  if (!nt || (sizeof(T) >= 4 && !FloatRowsStreamInRowOrder(C, N))) {
    // Strips with the coefficients in registers, as in ApplyRows. Float rows stored regularly
    // take the wide strips: fewer passes down the rows of dy and x. Zen 4, training gradient,
    // alternating calls in one process: 1x28x28x512 one thread 0.85x the time (two 0.97x),
    // 1x14x14x1024 0.73-0.79x, 32x7x7x512 0.85x, 1x7x7x2048 0.86x warm and cold, 32x14x14x512
    // cold 0.87x, 32x14x14x1024 0.95x; rows of 64-256 channels and DRAM-sized calls 0.97-1.01x.
    // Streamed rows keep four (96x8x8x1280 and x2048 1.02x wide).
    const auto strip = [&](auto k, int64_t c) {
      StripBackwardApply<decltype(k)::value>(d, dy, x, C, c, r0, r1, mean, k1, k2, k0, dx, nt);
    };
    const int64_t cv = sizeof(T) >= 4 && !nt ? ForEachStrip<kWideStripVectors>(d, c0, c1, strip)
                                             : ForEachStrip<kStripVectors>(d, c0, c1, strip);
    if constexpr (kMaskedTails<T>) {
      if (cv < c1) {
        const int64_t n = c1 - cv;
        const auto vm = LoadAccN(d, mean + cv, n), v1 = LoadAccN(d, k1 + cv, n),
                   v2 = LoadAccN(d, k2 + cv, n), v0 = LoadAccN(d, k0 + cv, n);
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t o = r * C + cv;
          const auto xc = hn::Sub(LoadAccN(d, x + o, n), vm);
          StoreAccN(d, hn::MulAdd(v2, xc, hn::MulAdd(v1, LoadAccN(d, dy + o, n), v0)), dx + o, n);
        }
      }
      return;
    }
    for (int64_t r = r0; r < r1 && cv < c1; ++r) {
      const int64_t o = r * C;
      for (int64_t c = cv; c < c1; ++c) {
        dx[o + c] = BackwardApplyOne(dy[o + c], x[o + c], mean[c], k1[c], k2[c], k0[c]);
      }
    }
    return;
  }
#if FBN_BF16_PAIRS
  if constexpr (std::is_same_v<T, BFloat16>) {
    if (PairsStream(d, C, c0, dx + r0 * C)) {
      // As in ApplyRows: rows in order, whole pairs, split coefficients from L1.
      const int64_t width = c1 - c0;
      const float* arrays[4] = {mean, k1, k2, k0};
      const float* sp = SplitCoefficients(d, arrays, 4, c0, width);
      const hn::RebindToUnsigned<decltype(d)> du;
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t o = r * C + c0;
        for (int64_t c = 0; c < width; c += 2 * N) {
          hn::Vec<decltype(d)> xe, xo, ge, go;
          LoadBF16Pair(d, x + o + c, xe, xo);
          LoadBF16Pair(d, dy + o + c, ge, go);
          const float* m = sp + c;
          const float* f1 = sp + width + c;
          const float* f2 = sp + 2 * width + c;
          const float* f0 = sp + 3 * width + c;
          const auto ve = hn::MulAdd(hn::LoadU(d, f2), hn::Sub(xe, hn::LoadU(d, m)),
                                     hn::MulAdd(hn::LoadU(d, f1), ge, hn::LoadU(d, f0)));
          const auto vo = hn::MulAdd(hn::LoadU(d, f2 + N), hn::Sub(xo, hn::LoadU(d, m + N)),
                                     hn::MulAdd(hn::LoadU(d, f1 + N), go, hn::LoadU(d, f0 + N)));
          StorePairBits(du, BF16PairBits(d, ve, vo), dx + o + c, true);
        }
      }
      return;
    }
  }
#endif
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t o = r * C;
    int64_t c = c0;
    for (; c + N <= c1; c += N) {
      const auto xc = hn::Sub(LoadAcc(d, x + o + c), hn::LoadU(d, mean + c));
      const auto t = hn::MulAdd(hn::LoadU(d, k1 + c), LoadAcc(d, dy + o + c), hn::LoadU(d, k0 + c));
      StoreAcc(d, hn::MulAdd(hn::LoadU(d, k2 + c), xc, t), dx + o + c, nt);
    }
    for (; c < c1; ++c) {
      dx[o + c] = BackwardApplyOne(dy[o + c], x[o + c], mean[c], k1[c], k2[c], k0[c]);
    }
  }
}

template <typename T>
void BackwardApplyPlanes(const void* dyv, const void* xv, int64_t C, int64_t S, int64_t f0,
                         int64_t f1, const void* mv, const void* k1v, const void* k2v,
                         const void* k0v, void* dxv, bool stream) {
  using A = Acc<T>;
  const T* dy = static_cast<const T*>(dyv);
  const T* x = static_cast<const T*>(xv);
  T* dx = static_cast<T*>(dxv);
  const A* mean = static_cast<const A*>(mv);
  const A* k1 = static_cast<const A*>(k1v);
  const A* k2 = static_cast<const A*>(k2v);
  const A* k0 = static_cast<const A*>(k0v);
  const AccTag<T> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  int64_t plane = f0 / S, c = plane % C;  // as in ApplyFlat
  for (int64_t f = f0; f < f1; ++plane, c = c + 1 == C ? 0 : c + 1) {
    const int64_t end = (plane + 1) * S < f1 ? (plane + 1) * S : f1;
    const auto vm = hn::Set(d, mean[c]), v1 = hn::Set(d, k1[c]), v2 = hn::Set(d, k2[c]),
               v0 = hn::Set(d, k0[c]);
    int64_t i = f;
    const int64_t head = stream ? StreamHead(d, dx + f) : -1;
    const bool nt = head >= 0 && head < end - f;
    auto scalar = [&](int64_t j) {
      dx[j] = BackwardApplyOne(dy[j], x[j], mean[c], k1[c], k2[c], k0[c]);
    };
    if (nt) {
      for (; i < f + head; ++i) scalar(i);
    }
#if FBN_BF16_PAIRS
    if constexpr (std::is_same_v<T, BFloat16>) {
      i = FlatPairs(d, dx, i, end, nt, [&](int64_t j) {
        hn::Vec<decltype(d)> xe, xo, ge, go;
        LoadBF16Pair(d, x + j, xe, xo);
        LoadBF16Pair(d, dy + j, ge, go);
        return BF16PairBits(d, hn::MulAdd(v2, hn::Sub(xe, vm), hn::MulAdd(v1, ge, v0)),
                            hn::MulAdd(v2, hn::Sub(xo, vm), hn::MulAdd(v1, go, v0)));
      });
    }
#endif
    const bool nt_rest = nt && kStreamsSingles<T>;
    for (; i + N <= end; i += N) {
      const auto xc = hn::Sub(LoadAcc(d, x + i), vm);
      StoreAcc(d, hn::MulAdd(v2, xc, hn::MulAdd(v1, LoadAcc(d, dy + i), v0)), dx + i, nt_rest);
    }
    if constexpr (kMaskedTails<T>) {
      if (i < end) {
        const auto xc = hn::Sub(LoadAccN(d, x + i, end - i), vm);
        StoreAccN(d, hn::MulAdd(v2, xc, hn::MulAdd(v1, LoadAccN(d, dy + i, end - i), v0)), dx + i,
                  end - i);
      }
      i = end;
    }
    for (; i < end; ++i) scalar(i);
    f = end;
  }
}

// Channels-first: dx = k2·(x - m) + (k1·dy + k0) for flat elements [f0, f1).
template <typename T>
void BackwardApplyFlat(const void* dyv, const void* xv, int64_t C, int64_t S, int64_t f0,
                       int64_t f1, const void* mv, const void* k1v, const void* k2v,
                       const void* k0v, void* dxv, bool stream) {
  const AccTag<T> d;
  if (!CrossesPlanes<T>(d, S, f0, f1, stream)) {
    return BackwardApplyPlanes<T>(dyv, xv, C, S, f0, f1, mv, k1v, k2v, k0v, dxv, stream);
  }
  using A = Acc<T>;
  const T* dy = static_cast<const T*>(dyv);
  const T* x = static_cast<const T*>(xv);
  T* dx = static_cast<T*>(dxv);
  const A* const arrays[4] = {static_cast<const A*>(mv), static_cast<const A*>(k1v),
                              static_cast<const A*>(k2v), static_cast<const A*>(k0v)};
  const int64_t i0 = CrossHead(d, dx, f0, f1, stream);
  if (i0 > f0) BackwardApplyPlanes<T>(dyv, xv, C, S, f0, i0, mv, k1v, k2v, k0v, dxv, false);
  const auto step = [&](int64_t i, const auto& v) {
#if FBN_BF16_PAIRS
    if constexpr (std::is_same_v<T, BFloat16>) {
      hn::Vec<decltype(d)> xe, xo, ge, go;
      LoadBF16Pair(d, x + i, xe, xo);
      LoadBF16Pair(d, dy + i, ge, go);
      const auto e = hn::MulAdd(v[0][2], hn::Sub(xe, v[0][0]), hn::MulAdd(v[0][1], ge, v[0][3]));
      const auto o = hn::MulAdd(v[1][2], hn::Sub(xo, v[1][0]), hn::MulAdd(v[1][1], go, v[1][3]));
      return StorePairBits(hn::RebindToUnsigned<decltype(d)>(), BF16PairBits(d, e, o), dx + i,
                           stream);
    }
#endif
    const auto xc = hn::Sub(LoadAcc(d, x + i), v[0][0]);
    StoreAcc(d, hn::MulAdd(v[0][2], xc, hn::MulAdd(v[0][1], LoadAcc(d, dy + i), v[0][3])), dx + i,
             stream);
  };
  const int64_t i1 = CrossPlaneSteps<4, kCrossParts<T>>(d, C, S, i0, f1, arrays, step);
  if (i1 < f1) BackwardApplyPlanes<T>(dyv, xv, C, S, i1, f1, mv, k1v, k2v, k0v, dxv, false);
}

// ------------------------------------------------------------------------------------------------

// Transposes of planes with a short side: the short loop has a constant trip count, so the
// compiler vectorizes the long one with shuffles (1x4096x2x2 float inference 26 -> 11 us; with
// both trip counts variable the copies took 0.5 ns per element).
template <typename U, int kShort>
void TransposeShort(const U* HWY_RESTRICT src, U* HWY_RESTRICT dst, int64_t rows, int64_t cols) {
  if (cols == kShort) {  // rows x kShort -> kShort x rows
    for (int64_t i = 0; i < rows; ++i) {
      for (int j = 0; j < kShort; ++j) dst[j * rows + i] = src[i * kShort + j];
    }
  } else {  // kShort x cols -> cols x kShort
    for (int64_t j = 0; j < cols; ++j) {
      for (int i = 0; i < kShort; ++i) dst[j * kShort + i] = src[i * cols + j];
    }
  }
}

template <typename U>
void TransposePlane(const U* HWY_RESTRICT src, U* HWY_RESTRICT dst, int64_t rows, int64_t cols) {
  switch (std::min(rows, cols)) {
    case 2:
      return TransposeShort<U, 2>(src, dst, rows, cols);
    case 3:
      return TransposeShort<U, 3>(src, dst, rows, cols);
    case 4:
      return TransposeShort<U, 4>(src, dst, rows, cols);
    default:
      for (int64_t j = 0; j < cols; ++j) {
        for (int64_t i = 0; i < rows; ++i) dst[j * rows + i] = src[i * cols + j];
      }
  }
}

// Per image, dst[j·rows + i] = src[i·cols + j] (KernelEntry::transpose).
template <typename T>
void TransposeImages(const void* srcv, void* dstv, int64_t images, int64_t rows, int64_t cols) {
  using U = std::conditional_t<sizeof(T) == 2, uint16_t,
                               std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>>;
  static_assert(sizeof(U) == sizeof(T));
  const U* src = static_cast<const U*>(srcv);
  U* dst = static_cast<U*>(dstv);
  for (int64_t n = 0; n < images; ++n, src += rows * cols, dst += rows * cols) {
    TransposePlane(src, dst, rows, cols);
  }
}

template <typename T>
void FillEntry(KernelEntry* e) {
  e->stats_rows = &StatsRows<T>;
  e->mean_rows = &MeanRows<T>;
  e->deviation_rows = &DeviationRows<T>;
  e->stats_run = &StatsRun<T>;
  e->stats_runs = &StatsRuns<T>;
  e->stats_images = &StatsImages<T>;
  e->apply_rows = &ApplyRows<T>;
  e->apply_flat = &ApplyFlat<T>;
  e->reduce_rows = &ReduceRows<T>;
  e->reduce_run = [](const void* dy, const void* x, int64_t base, int64_t plane_stride, int64_t S,
                     int64_t v0, int64_t v1, const void* mean, int64_t c, double* sum_dy,
                     double* sum_dy_xc, const void* k1, void* dx, bool stream) {
    using A = Acc<T>;
    const A m = static_cast<const A*>(mean)[c];
    const A k = k1 ? static_cast<const A*>(k1)[c] : A(0);
    ReduceRun<T>(dy, x, base, plane_stride, S, v0, v1, m, sum_dy, sum_dy_xc, k, k1 ? dx : nullptr,
                 stream);
  };
  e->reduce_runs = &ReduceRuns<T>;
  e->reduce_images = &ReduceImages<T>;
  e->backward_apply_rows = &BackwardApplyRows<T>;
  e->backward_apply_flat = &BackwardApplyFlat<T>;
  e->transpose = &TransposeImages<T>;
  const size_t unit = hn::Lanes(AccTag<T>()) * sizeof(T) * (kStreamsSingles<T> ? 1 : 2);
  e->stream_unit_bytes = HWY_TARGET == HWY_SCALAR ? 0 : static_cast<int64_t>(unit);
}

const KernelTable* GetKernelTable() {
  static const KernelTable table = [] {
    KernelTable t;
    FillEntry<Half>(&t.entries[static_cast<int>(DataType::kFloat16)]);
    FillEntry<BFloat16>(&t.entries[static_cast<int>(DataType::kBFloat16)]);
    FillEntry<float>(&t.entries[static_cast<int>(DataType::kFloat32)]);
    FillEntry<double>(&t.entries[static_cast<int>(DataType::kFloat64)]);
    t.target_name = hwy::TargetName(HWY_TARGET);
    return t;
  }();
  return &table;
}

}  // namespace HWY_NAMESPACE
}  // namespace fbn::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace fbn::kernels {

HWY_EXPORT(GetKernelTable);

const KernelTable& ActiveKernels() {
  // Resolved on every call (cheap: a table lookup) so tests can cap the target.
  return *HWY_DYNAMIC_DISPATCH(GetKernelTable)();
}

}  // namespace fbn::kernels
#endif  // HWY_ONCE
