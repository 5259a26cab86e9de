// Orchestration of the batch-norm kernels: fixed task partitions, threads, ordered merges.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/batch_norm_kernels.h"
#include "kernels/cache_probe.h"
#include "kernels/call_tuning.h"
#include "kernels/channel_math.h"
#include "kernels/convert.h"
#include "kernels/kernel_table.h"
#include "threading/thread_pool.h"

namespace fbn::kernels {
namespace {

// A reduction task reads about this much of each input; the partition depends only on the shape
// and element size, never on the thread count, which keeps results bit-identical.
constexpr double kReduceTaskBytes = 256.0 * 1024;
// A channels-first channel up to this size is one task, reduced and then rewritten while it is
// still in the core's L2 (or L3): the fused paths read it from DRAM once. Larger channels are
// split between the threads (FuseSplitChannels): 96x192x71x71 and 96x80x73x73 float (1.9-2.0 MB
// channels) trained 1.1-1.2x faster split, 1.6 MB channels 0.9-1.1x (2 MB L2 per core here).
constexpr double kChannelTaskBytes = 1.75 * 1024 * 1024;
constexpr int64_t kMaxReduceTasks = 64;
// Channels-first channels up to this size are reduced and rewritten one at a time by all threads
// (FuseSplitChannels).
constexpr double kSplitChannelBytes = 32.0 * 1024 * 1024;
// Channels-last reductions of tensors at least this large prefetch the next block of rows: from
// DRAM they gain (128x56x56x256 training forward bfloat16 1.27x, float 1.11x), from the last-level
// cache they lose (32x28x28x256 float 0.75x). 64 MB is this VM's measured effective LLC.
constexpr double kPrefetchStatsBytes = 64.0 * 1024 * 1024;
// 16-bit tensors with at least this many elements prefetch too: widening them costs more work per
// byte, so fewer of their loads are in flight (51 MB bfloat16 training passes, 32x56x56x256,
// 128x64x56x56 and 128x28x28x256, gained 1.05-1.39x, medians of 4 alternating runs; float tensors
// of 45-51 MB went either way, 0.88-1.16x). Not the frozen gradient, which writes dx in the same
// sweep (0.9-1.0x).
constexpr double kPrefetchStatsElements = kPrefetchStatsBytes / 4;
// Batch-1 channels-first fused paths reduce and rewrite a task's channels in chunks of about this
// many bytes of their inputs (FusedChunk).
constexpr double kFusedChunkBytes = 16.0 * 1024;
constexpr double kFusedChunkFromMemoryBytes = 4.0 * 1024;
// An element-wise task writes about this much.
constexpr double kApplyTaskBytes = 64.0 * 1024;

// Channels-first outputs are written plane by plane, each plane's unaligned ends with regular
// stores: short planes would mix those with streaming stores in the same cache lines and leave
// lines partly written, which costs a read-modify-write in memory (128x2048x7x7 bfloat16
// inference took 33 ms instead of 2). Only planes of at least this many bytes stream.
constexpr int64_t kStreamPlaneBytes = 512;
// The fused channels-first training paths write each channel's planes N·C·S apart; when their
// streaming stores are whole cache lines (StreamLines), shorter planes stream their whole lines
// too, no line being written both ways (GoogLeNet-v3 96x192x8x8 flushed: bfloat16 training
// forward 634 -> 332 us, float training gradient 1592 -> 807 us). The flat writers of inference
// measured slower that way (7x7 and 14x14 planes, 0.55-0.83x): their alignment heads cost more.
constexpr int64_t kStreamLinePlaneBytes = 128;
constexpr int64_t kCacheLineBytes = 64;

bool StreamLines(const KernelEntry& e) {
  return e.stream_unit_bytes > 0 && e.stream_unit_bytes % kCacheLineBytes == 0;
}

// The L2 size of one core (sysconf; 1 MB where it is not reported).
double L2Bytes() {
  static const double bytes = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return l2 > 0 ? static_cast<double>(l2) : 1024.0 * 1024;
  }();
  return bytes;
}

// Where a channels-last pass's rows come from (RowRead). `tensors`: how many tensors of g's size
// the pass and the one it feeds touch (statistics then apply: 2; gradient sums then dx: 3).
// `reads_only`: the sweep writes nothing (statistics, the training gradient's sums). Where the L3
// is a victim cache, tensors over half of it count as read from DRAM, as for StreamOutput.
RowRead RowReadOf(const Geometry& g, size_t elem_bytes, int tensors, bool reads_only, int threads) {
  const double elements = static_cast<double>(g.elements());
  const double bytes = elements * static_cast<double>(elem_bytes);
  if (bytes >= kPrefetchStatsBytes || (reads_only && elements >= kPrefetchStatsElements)) {
    return RowRead::kPrefetch;
  }
  const double l3 = VictimL3Bytes();
  if (l3 > 0 && bytes > l3 / 2) return RowRead::kDram;
  return tensors * bytes <= threads * L2Bytes() ? RowRead::kL2 : RowRead::kL3;
}

// Outputs bypass the cache with streaming stores once the tensors a call touches (`tensors` of
// them, inputs and output) overflow the L2 caches of the threads working on them: the output
// would be evicted before anything read it back, and streaming saves the read-for-ownership of
// every line. Measured on ResNet-50 batch-1 shapes (Xeon, 2 threads, 2 MB L2 each): 3.2 MB float
// inference 121 -> 90 us with its operands in cache and 281 -> 156 us flushed from it; at
// 800 KB streaming doubled the in-cache time (12 -> 23 us). Where the L3 is a victim cache of the
// L2s (Zen 4, 1 MB L2, 32 MB L3) lines evicted from L2 come back from L3 at L2-like latency, so
// there regular stores keep the output for its reader up to a share of the L3 (L3KeepShare).
// 16-bit channels-first writers, whose short planes stream whole lines, stayed faster streamed
// (96x448x8x8 bfloat16 inference 166 vs 222 us).
//
// The share, from warm runs of the benchmark's shapes (fbn_bench, 2-4 alternating rounds,
// streamed / regular):
// - Half the L3 first (1x256x56x56 float inference 120 -> 58 us, 32x256x14x14 NCHW 195 -> 108,
//   32x512x7x7 float training gradient 198 -> 157).
// - Forward passes (x in, y out) up to 0.8 of it: float 12.8 MB tensors 1.1-2.1x faster
//   (32x28x28x128 inference 466 -> 241 us, 96x8x8x384 training 467 -> 283, NCHW 32x512x14x14
//   inference 467 -> 220), bfloat16 32x56x56x64 inference 476 -> 236. At 0.85 of it
//   (96x17x17x128 float, 28.4 MB touched) the training forward lost 693 -> 854 then; since the
//   wider strips it gains (below).
// - Gradients (x and dy in, dx out) up to 0.6 of it: 32x256x14x14 float 1.15-1.9x faster
//   (NCHW frozen 315 -> 166 us), bfloat16 32x28x28x128 training 400 -> 307; at 0.7 and more
//   (96x8x8x320 float, 23.6 MB) the frozen gradient lost 302 -> 369.
// - 16-bit rows of more than 512 channels keep half: with regular stores beyond it bfloat16
//   32x14x14x1024 training forward lost 857 -> 1092 us and 32x7x7x2048 frozen gradient 321 ->
//   392 (the same split by channel count showed when such tensors kept the whole L3).
// - Channels-last forward passes of rows up to kKeepRowChannels: up to 1.1 of it for float and
//   1.6 for 16-bit types, where a steady run keeps y in the L3 beside x (fbn_bench, warm, 3-6
//   rounds, 0.8 / new). Inference: bfloat16 96x35x35x64 280-557 -> 220-328 us (oneDNN
//   274-420), 96x35x35x96 824-852 -> 603-813, 32x56x56x128 0.97-0.99x; float 96x17x17x128
//   266-523 -> 191-317 (oneDNN 264-519), 96x17x17x160 0.84x, 96x35x35x32 0.67x. Training
//   forward: bfloat16 96x35x35x64 0.64x (oneDNN 725 us, fbn 864 -> 556), 96x35x35x96 0.83x,
//   32x56x56x128 0.91x; float 96x35x35x32 0.61x, 96x17x17x128 0.64x, 96x17x17x160 0.81x.
//   Float at 1.5 of it lost (96x35x35x64 inference 560 -> 675-949 with regular stores), and so
//   did wider bfloat16 rows at 1.6 (inference 96x17x17x384 1.47x, 32x14x14x1024 1.38-1.66x).
//   The probe still streams calls whose input is not in cache; a call whose input is cached but
//   whose output is not pays for reading y's lines first (inference 1.5-1.8x the op's time,
//   calls alternating with streamed ones), and leaves y in the L3 for its reader. The frozen
//   gradient (one sweep, three tensors) lost at 1.2 and 1.6 of it (96x8x8x448 float 463-578 ->
//   589-932 us).
// - The 16-bit training gradient of such rows, whose dx sweep rereads dy and x, up to 0.7 of it:
//   bfloat16 96x35x35x32 0.63-0.90x the time (oneDNN 407-430 us, fbn 446 -> 285-401),
//   96x17x17x128 0.80-0.95x; at 0.8 96x17x17x160 went either way (0.93-1.15x), at 1.4 the
//   larger ones too (96x17x17x192 1.14x); float gradients gained nothing at 1.0-1.4.
constexpr int64_t kKeepRowChannels = 192;

// Channels-last rows of up to kKeepRowChannels, the rows that keep the most of the L3.
bool KeepRows(const Geometry& g) { return g.channels_last && g.c <= kKeepRowChannels; }

// What a call moves: `tensors` tensors of g's size.
double TouchedBytes(const Geometry& g, size_t elem_bytes, int tensors) {
  return static_cast<double>(tensors) * static_cast<double>(g.elements()) *
         static_cast<double>(elem_bytes);
}

double L3KeepShare(const Geometry& g, size_t elem_bytes, int tensors, bool training_gradient) {
  if (tensors == 2 && KeepRows(g)) return elem_bytes < 4 ? 1.6 : 1.1;
  if (training_gradient && elem_bytes < 4 && KeepRows(g)) return 0.7;
  if (elem_bytes < 4) {
    if (!g.channels_last) return 0.0;
    if (g.c > 512) return 0.5;
  }
  return tensors <= 2 ? 0.8 : 0.6;
}

// `training_gradient`: dx of the training gradient, whose sweep rereads dy and x.
bool StreamOutput(const Geometry& g, size_t elem_bytes, int tensors, int threads,
                  bool training_gradient = false) {
  const double touched = TouchedBytes(g, elem_bytes, tensors);
  const double retained =
      std::max(static_cast<double>(threads) * L2Bytes(),
               VictimL3Bytes() * L3KeepShare(g, elem_bytes, tensors, training_gradient));
  return touched > retained;
}

// 16-bit channels-last rows of up to kKeepRowChannels whose forward pass (x in, y out) or training
// gradient (dy and x in, dx out) touches more than the L3 but fits the L3s of a host that puts the
// two cores on two of them (up to this many times one L3) keep their output or stream it by the
// shape's own recent times (CallTuning::KeepOutput), where StreamOutput or the probe would stream
// it. Keeping it pays when the L3s hold most of the call's tensors, which depends on where the host
// put the cores and on what ran before, and which the probe's four loads cannot tell on such
// tensors (warm 51 MB bfloat16 inputs read them in 290-380 ns, flushed ones in 651+). Calls whose
// probe finds every line in DRAM stream without asking. fbn_bench, tuned / always streamed
// (FBN_TUNE_STORES=0), alternating processes: warm bfloat16 inference 96x35x35x96 0.70x the time,
// 128x28x28x128 0.71x, 32x56x56x128 0.86x; training forward 0.84x, 0.87x, 1.05x (six rounds, two
// near, four far); training gradient 32x56x56x64 0.76x, 96x35x35x64 0.89x, 96x35x35x96 0.95x
// (four rounds, far); cold 0.91-1.05x. Float rows and wider 16-bit rows lost with their outputs
// kept (in one process, far: 1.3-3x the streamed time; float 96x17x17x192 inference 2.1x), so
// they always stream.
constexpr double kTunedKeepL3s = 2.0;

bool TunedKeep(const Geometry& g, size_t elem_bytes, int tensors, bool training_gradient) {
  const double touched = TouchedBytes(g, elem_bytes, tensors);
  const double l3 = VictimL3Bytes();
  return (tensors == 2 || training_gradient) && elem_bytes < 4 && KeepRows(g) && touched > l3 &&
         touched <= kTunedKeepL3s * l3;
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t ClampTasks(double wanted, int64_t upper) {
  const double clamped = std::min(std::max(1.0, std::ceil(wanted)), static_cast<double>(upper));
  return static_cast<int64_t>(clamped);
}

// Grow-only scratch owned by the calling thread: partial results of reduction tasks.
double* Scratch(size_t doubles) {
  thread_local std::vector<double> buffer;
  if (buffer.size() < doubles) buffer.resize(doubles);
  return buffer.data();
}

std::vector<double>& MergeScratch(size_t doubles) {
  thread_local std::vector<double> buffer;
  if (buffer.size() < doubles) buffer.resize(doubles);
  return buffer;
}

// Chan's merge weights of parts with counts count_of(i), merged in order: w[2i] = n_i / N_i and
// w[2i+1] = N_{i-1} · n_i / N_i, where N_i is the running count.
template <typename CountOf>
void ChanWeights(int64_t parts, CountOf&& count_of, double* w) {
  double count = 0;
  for (int64_t i = 0; i < parts; ++i) {
    const double nb = count_of(i);
    const double total = count + nb;
    w[2 * i] = nb / total;
    w[2 * i + 1] = count * nb / total;
    count = total;
  }
}

const KernelEntry& Entry(DataType dtype) {
  return ActiveKernels().entries[static_cast<int>(dtype)];
}

size_t ElemBytes(DataType dtype) { return DataTypeSize(dtype); }

const void* Offset(const void* p, int64_t elements, size_t elem_bytes) {
  return static_cast<const char*>(p) + static_cast<size_t>(elements) * elem_bytes;
}

// A tensor whose inner dimension is shorter than a vector runs in the other layout: the
// channels-first kernels take planes of this many elements or fewer (2x2, 3x3) lane by lane, with
// a dependency chain and a division per channel, and the channels-last kernels rows of that few
// channels (image inputs: 3) element by element, while the other layout's kernels fill vectors.
// 1x64x2x2 bfloat16 training forward 2.1 -> 1.0 us, 1x1024x3x3 float 36 -> 15 us, 1x64x64x3 float
// NHWC 46 -> 7 us. A dimension of 1 needs no copy (N x C x 1 is N x 1 x C): 64x2048x1x1 float
// inference gradient 920 -> 20 us, 8x128x128x1 NHWC training forward 815 -> 31 us.
constexpr int64_t kShortInner = 16;
// Above this size per tensor, copies of inner dimensions over kShortCopyInner cost more than they
// save: 3x3 planes lost from 600 KB (8x2048x3x3 float inference 0.48x). Inner dimensions of up to
// kShortCopyInner elements have vectorized copies and gain at every size measured, up to 19 MB
// (64x224x224x3 bfloat16 NHWC training forward flushed 26.8 -> 6.2 ms, 128x2048x2x2 float NCHW
// 2.3 -> 0.9 ms).
constexpr double kSwapCopyBytes = 64.0 * 1024;
constexpr int64_t kShortCopyInner = 4;

// How a call runs: in its own layout, in the other layout on the same memory, or on copies of its
// tensors in the other layout.
enum class Swap { kNo, kSameMemory, kCopy };

// `elementwise`: a single sweep (Apply, BackwardApply). Copies of inner dimensions over
// kShortCopyInner cost more than they save there (1x1024x3x3 float inference 0.70x, 2x32x32x8
// NHWC 0.44x) and on channels-last rows (2x32x32x8 float gradients 0.57-0.80x).
Swap SwapOf(const Geometry& g, size_t elem_bytes, bool elementwise = false) {
  const int64_t inner = g.channels_last ? g.c : g.s, outer = g.channels_last ? g.s : g.c;
  // The other layout helps only where its inner dimension fills vectors (and a swapped call must
  // not swap back).
  if (inner >= kShortInner || outer < kShortInner) return Swap::kNo;
  if (inner == 1) return Swap::kSameMemory;
  if (inner > kShortCopyInner && (elementwise || g.channels_last)) return Swap::kNo;
  const double bytes = static_cast<double>(g.elements()) * static_cast<double>(elem_bytes);
  return inner <= kShortCopyInner || bytes <= kSwapCopyBytes ? Swap::kCopy : Swap::kNo;
}

Geometry Swapped(Geometry g) {
  g.channels_last = !g.channels_last;
  return g;
}

// Copies of at least this many bytes are split among the threads; a two-image 98 KB copy took twice
// as long split (2x64x64x3 float NHWC training forward 14 -> 29 us).
constexpr double kParallelCopyBytes = 256.0 * 1024;

// Per image, a (rows x cols) matrix of g's layout transposed: C x S for channels-first. Images are
// split among the threads (8x128x128x3 float NHWC training forward 549 -> 287 us).
void TransposeFrom(DataType dtype, const Geometry& g, const void* src, void* dst) {
  const int64_t rows = g.channels_last ? g.s : g.c, cols = g.channels_last ? g.c : g.s;
  const size_t es = ElemBytes(dtype);
  const auto transpose = Entry(dtype).transpose;
  const int64_t image = rows * cols;
  const int threads =
      static_cast<double>(g.elements() * static_cast<int64_t>(es)) >= kParallelCopyBytes
          ? threading::NumThreads()
          : 1;
  const int64_t tasks = std::min<int64_t>(g.n, threads);
  threading::ParallelFor(tasks, threads, [&](int64_t t) {
    const int64_t n0 = g.n * t / tasks, n1 = g.n * (t + 1) / tasks;
    transpose(Offset(src, n0 * image, es),
              static_cast<char*>(dst) + static_cast<size_t>(n0 * image) * es, n1 - n0, rows, cols);
  });
}

// The calling thread's buffer for the copies of swapped calls, kept between calls up to this size
// (three tensors of 32 MB) so that repeated calls do not fault in fresh pages.
constexpr size_t kRetainedCopyBytes = 96u << 20;

std::vector<double>& CopyBuffer() {
  thread_local std::vector<double> buffer;
  return buffer;
}

// A call run in the other layout (SwapOf): the swapped geometry, its tensors there (the tensors
// themselves for Swap::kSameMemory, else transposed copies in slots 0..2 of the calling thread's
// CopyBuffer, each on its own cache lines), and the move of its output back.
class SwappedCall {
 public:
  SwappedCall(Swap how, DataType dtype, const Geometry& g)
      : how_(how), dtype_(dtype), g_(g), swapped_(Swapped(g)) {
    if (how_ != Swap::kCopy) return;
    constexpr size_t kLine = kCacheLineBytes;
    const size_t bytes = static_cast<size_t>(g.elements()) * ElemBytes(dtype);
    stride_ = (bytes + kLine - 1) / kLine * kLine;
    std::vector<double>& buffer = CopyBuffer();
    const size_t need = (3 * stride_ + kLine) / sizeof(double);
    if (buffer.size() < need) buffer.resize(need);
    const uintptr_t p = reinterpret_cast<uintptr_t>(buffer.data());
    base_ = reinterpret_cast<char*>((p + kLine - 1) / kLine * kLine);
  }
  ~SwappedCall() {
    std::vector<double>& buffer = CopyBuffer();
    if (buffer.size() * sizeof(double) > kRetainedCopyBytes) std::vector<double>().swap(buffer);
  }
  SwappedCall(const SwappedCall&) = delete;
  SwappedCall& operator=(const SwappedCall&) = delete;

  const Geometry& geometry() const { return swapped_; }
  // The input `src` in the other layout.
  const void* In(const void* src, int slot) const {
    if (how_ == Swap::kSameMemory) return src;
    void* dst = base_ + static_cast<size_t>(slot) * stride_;
    TransposeFrom(dtype_, g_, src, dst);
    return dst;
  }
  // Where the swapped call writes the output `dst`; Finish moves it there.
  void* Out(void* dst) const { return how_ == Swap::kSameMemory ? dst : base_ + 2 * stride_; }
  void Finish(const void* out, void* dst) const {
    if (how_ == Swap::kCopy) TransposeFrom(dtype_, swapped_, out, dst);
  }

 private:
  Swap how_;
  DataType dtype_;
  Geometry g_, swapped_;
  size_t stride_ = 0;
  char* base_ = nullptr;
};

// The least output for which StreamStores probes the cache; smaller outputs that fit the caches
// get regular stores whatever the caches hold. Where the streaming kernel is the strip kernel
// (training passes, float inference), 50 KB outputs with the input flushed already gain 15-45%
// (7x7x512 bfloat16 training forward 21.6 -> 18.4 us, 14x14x64 float 15.0 -> 7.9 us).
constexpr double kProbeBytes = 32.0 * 1024;
// 16-bit single-sweep passes (inference, the backward apply) stream in row order with the
// coefficients in memory: with the input flushed, slower than regular stores at 200 KB
// (128x28x28 bfloat16 inference 27 -> 49 us), faster at 800 KB (512x28x28: 113 -> 71 us).
constexpr double kProbeRowOrder16Bytes = 512.0 * 1024;
// The frozen backward streams in row order with its sums in memory: with its operands flushed,
// slower at 100 KB (512x7x7 float 18 -> 25 us), faster at 200 KB (2048x7x7: 69 -> 54 us).
constexpr double kProbeFrozenBytes = 128.0 * 1024;

double ProbeBytesOneSweep(size_t elem_bytes, bool frozen) {
  if (elem_bytes < 4) return kProbeRowOrder16Bytes;
  return frozen ? kProbeFrozenBytes : kProbeBytes;
}

// Whether a call's input (x, or dy for gradients) is in the calling core's cache, probed before
// the call reads anything and at most once: a probe brings its lines in, so a second probe would
// always hit. The lines lie spread over what the calling thread's own tasks (its first block with
// all threads working) read.
class InputProbe {
 public:
  InputProbe(const Geometry& g, size_t elem_bytes, const void* in)
      : g_(g), es_(static_cast<int64_t>(elem_bytes)), in_(in) {}

  bool InCoreCache() { return LoadedFromCoreCache(Nanoseconds()); }
  // Whether every line probed came from DRAM (InCoreCache is false then too).
  bool FromDram() { return LoadedFromDram(Nanoseconds()); }

 private:
  int64_t Nanoseconds() {
    if (nanoseconds_ < 0) nanoseconds_ = Probe();
    return nanoseconds_;
  }

  int64_t Probe() const {
    const int64_t threads = threading::NumThreads();
    const void* lines[kProbeLines];
    constexpr int64_t kHalves = 2 * kProbeLines;
    const int64_t first_images = g_.n / threads;
    for (int k = 0; k < kProbeLines; ++k) {
      if (g_.channels_last) {
        // Column 0 of rows in the first row range (also in the first channel group).
        const int64_t rows = std::max<int64_t>(1, g_.n * g_.s / threads);
        lines[k] = Offset(in_, (2 * k + 1) * rows / kHalves * g_.c, es_);
      } else if (first_images >= kProbeLines) {
        // Channel 0 of images in the first image range (also in the first channel range).
        lines[k] =
            Offset(in_, ((2 * k + 1) * first_images / kHalves * g_.c * g_.s) + g_.s / 2, es_);
      } else {
        // Spread over the first 1 / threads of the tensor (the first channel range).
        lines[k] = Offset(in_, (2 * k + 1) * (g_.elements() / threads) / kHalves, es_);
      }
    }
    return ChainedLoadNanoseconds(lines);
  }

  const Geometry& g_;
  int64_t es_;
  const void* in_;
  int64_t nanoseconds_ = -1;  // not probed yet
};

// Whether a call reads its input from memory: a tensor large enough to probe (`bytes_per_element`
// of each of g's elements) whose input was not in the calling core's cache at the call's start.
bool InputFromMemory(const Geometry& g, double bytes_per_element, InputProbe& probe) {
  return static_cast<double>(g.elements()) * bytes_per_element >= kProbeBytes &&
         !probe.InCoreCache();
}

// Small calls (under threading's extra-thread threshold) whose input is not in the calling core's
// cache read it from DRAM or another core at a latency that one thread cannot hide, so they take
// a thread per this much traffic instead (ResNet-50 batch-1 NHWC, operands flushed: 7x7x512
// bfloat16 inference 18.8 -> 15.0 us and training forward 23.8 -> 16.3 us). With the input in
// cache a second thread costs more than it saves (7x7x256 float inference 2.8 -> 3.3 us).
constexpr int64_t kColdBytesPerThread = 16 * 1024;
// Calls with less traffic than this do not probe: their fixed cost decides.
constexpr int64_t kColdProbeTraffic = 32 * 1024;

// Threads for a call that moves `tensors` tensors of g's size.
int CallThreads(const Geometry& g, size_t elem_bytes, int tensors, InputProbe& probe) {
  const int64_t traffic = tensors * g.elements() * static_cast<int64_t>(elem_bytes);
  int threads = threading::ThreadsForWork(traffic);
  if (threads < threading::NumThreads() && traffic >= kColdProbeTraffic && !probe.InCoreCache()) {
    threads = std::min<int>(threading::NumThreads(),
                            static_cast<int>(std::max<int64_t>(1, traffic / kColdBytesPerThread)));
  }
  return CallTuning::Threads(threads, traffic);
}

// Channels-first calls that would stream only because their input is not in cache (the output
// fits the L2s) keep regular stores for planes shorter than this: each plane's unaligned ends
// are regular stores anyway, and on short planes streaming the rest measured slower (ResNet-50
// batch-1 float, operands flushed, regular / streamed: 14x14 planes 0.63-0.84x in inference and
// the backward apply; 28x28 and 56x56 planes 1.13-1.38x).
constexpr int64_t kColdStreamPlaneBytes = 1024;

// Whether a call writes its output with streaming stores, decided before it reads anything.
// Outputs too large for the threads' L2 stream (StreamOutput). Smaller ones stream when the
// call's input is not in the calling core's cache: the call then reads from DRAM, and regular
// stores would fetch every output line from DRAM first (ResNet-50 batch-1 float, operands
// flushed: 256x28x28 inference 77 -> 47 us; short channels-first planes excepted, above). With
// the input in cache, the usual case when the previous layer has just written it, the output
// stays in cache for the next layer (streaming it doubles the time).
bool StreamStores(const Geometry& g, size_t elem_bytes, int tensors, int threads,
                  double probe_bytes, InputProbe& probe, bool short_planes = false,
                  bool training_gradient = false) {
  const int64_t es = static_cast<int64_t>(elem_bytes);
  const int64_t min_plane = short_planes ? kStreamLinePlaneBytes : kStreamPlaneBytes;
  if (!g.channels_last && g.s * es < min_plane) return false;
  const auto streams = [&] {
    if (StreamOutput(g, elem_bytes, tensors, threads, training_gradient)) return true;
    const double bytes = static_cast<double>(g.elements() * es);
    if (bytes < probe_bytes) return false;
    if (!g.channels_last && g.s * es < kColdStreamPlaneBytes) return false;
    return !probe.InCoreCache();
  };
  return streams() && !(TunedKeep(g, elem_bytes, tensors, training_gradient) && !probe.FromDram() &&
                        CallTuning::KeepOutput());
}

// Channels-last reduction tasks: contiguous ranges of rows, and when there are too few rows to
// split (batch-1 7x7x2048), also groups of channels. Task t covers row range t / groups and
// channel group t % groups; every (row range, channel) pair belongs to exactly one task.
struct RowPartition {
  int64_t rows_per_task;
  int64_t row_tasks;
  int64_t width;   // channels per group (a multiple of 64 unless it is C)
  int64_t groups;  // channel groups
  int64_t tasks() const { return row_tasks * groups; }
};
// A task's fixed work is O(C) (zeroing and merging its per-channel partials), so it gets at least
// this many rows to amortize it.
constexpr int64_t kMinRowsPerTask = 64;
constexpr int64_t kGroupChannels = 64;
constexpr int64_t kGroupRows = 256;
constexpr double kGroupTasks = 4;

// `fused`: the caller finishes each channel group in its task (FuseChannelGroups); then short
// tensors take channel groups over all rows too. The separate reductions keep row ranges there:
// flushed 1x14x14x256 float frozen gradients took 41 us in half-row groups, 33 in row ranges.
RowPartition PartitionRows(int64_t rows, int64_t channels, double channel_bytes,
                           bool fused = false) {
  const double row_bytes = static_cast<double>(channels) * channel_bytes;
  const double wanted_total = static_cast<double>(rows) * row_bytes / kReduceTaskBytes;
  const int64_t wanted =
      fused && rows <= kGroupRows && channels >= 2 * kGroupChannels && wanted_total <= kGroupTasks
          ? 1
          : ClampTasks(wanted_total,
                       std::min<int64_t>(CeilDiv(rows, kMinRowsPerTask), kMaxReduceTasks));
  RowPartition p;
  p.rows_per_task = CeilDiv(rows, wanted);
  p.row_tasks = CeilDiv(rows, p.rows_per_task);
  p.width = channels;
  p.groups = 1;
  // Channel groups only make up for rows too few to split, never for the task cap: strided
  // narrow groups of long tensors read each row in pieces (measured 2-7x slower).
  const double capped = std::min(wanted_total, static_cast<double>(kMaxReduceTasks));
  int64_t more = ClampTasks(capped / static_cast<double>(p.row_tasks),
                            std::max<int64_t>(1, channels / kGroupChannels));
  // Rows too few to split give a second thread a channel group even below the task size (batch-1
  // 7x7x2048 bfloat16 ran on one thread); like every split here it depends on the shape only.
  if (p.row_tasks == 1) {
    more = std::max<int64_t>(more, std::min<int64_t>(2, channels / kGroupChannels));
  }
  if (more > 1) {
    p.width = CeilDiv(CeilDiv(channels, more), kGroupChannels) * kGroupChannels;
    p.groups = CeilDiv(channels, p.width);
  }
  return p;
}

// Channels-first reduction: each channel's M elements split into `pieces` ranges of `piece_len`;
// when a channel is one piece, `group` channels share a task.
struct RunPartition {
  int64_t pieces, piece_len, group, tasks;
  int64_t begin(int64_t piece) const { return piece * piece_len; }
  int64_t end(int64_t piece, int64_t per_channel) const {
    return std::min(per_channel, begin(piece) + piece_len);
  }
};
RunPartition PartitionRuns(int64_t channels, int64_t per_channel, double elem_bytes) {
  RunPartition p;
  const double channel_bytes = static_cast<double>(per_channel) * elem_bytes;
  p.pieces = channel_bytes <= kChannelTaskBytes
                 ? 1
                 : ClampTasks(channel_bytes / kReduceTaskBytes,
                              std::min<int64_t>(per_channel, kMaxReduceTasks));
  p.piece_len = CeilDiv(per_channel, p.pieces);
  p.pieces = CeilDiv(per_channel, p.piece_len);
  if (p.pieces == 1) {
    p.group = ClampTasks(kReduceTaskBytes / std::max(1.0, channel_bytes), channels);
    p.group = std::min<int64_t>(std::max<int64_t>(p.group, 1), channels);
    p.tasks = CeilDiv(channels, p.group);
  } else {
    p.group = 1;
    p.tasks = channels * p.pieces;
  }
  return p;
}

// Calls f(c, piece, v0, v1) for every (channel, piece) of task t.
template <typename F>
void ForEachRun(const RunPartition& p, int64_t channels, int64_t per_channel, int64_t t, F&& f) {
  if (p.pieces == 1) {
    const int64_t c1 = std::min(channels, (t + 1) * p.group);
    for (int64_t c = t * p.group; c < c1; ++c) f(c, int64_t{0}, int64_t{0}, per_channel);
  } else {
    const int64_t c = t / p.pieces, piece = t % p.pieces;
    f(c, piece, p.begin(piece), p.end(piece, per_channel));
  }
}

// Chan's weights of the pieces of a RunPartition (every channel has the same piece counts).
const double* PieceWeights(const RunPartition& p, int64_t M) {
  std::vector<double>& w = MergeScratch(2 * static_cast<size_t>(p.pieces));
  ChanWeights(
      p.pieces,
      [&](int64_t piece) { return static_cast<double>(p.end(piece, M) - p.begin(piece)); },
      w.data());
  return w.data();
}

// One channel's statistics from its pieces' (mean, M2) pairs at `s`, merged in piece order.
void MergePieceStats(const RunPartition& p, int64_t M, const double* w, const double* s,
                     double* mean, double* variance) {
  double mu = 0, m2 = 0;
  for (int64_t piece = 0; piece < p.pieces; ++piece) {
    const double delta = s[2 * piece] - mu;
    mu += delta * w[2 * piece];
    m2 += s[2 * piece + 1] + delta * delta * w[2 * piece + 1];
  }
  *mean = mu;
  *variance = m2 / static_cast<double>(M);  // as the fused path divides
}

// One channel's sums from its pieces' (sum dy, sum dy·(x - m)) pairs at `s`, in piece order.
void MergePieceSums(const RunPartition& p, const double* s, double* sum_dy, double* sum_dy_xc) {
  double s0 = 0, s1 = 0;
  for (int64_t piece = 0; piece < p.pieces; ++piece) {
    s0 += s[2 * piece];
    s1 += s[2 * piece + 1];
  }
  *sum_dy = s0;
  *sum_dy_xc = s1;
}

// Calls f(f0, f1) for the flat ranges (one per plane it touches) of elements [v0, v1) of
// channels-first channel c.
template <typename F>
void ForEachPieceRange(const Geometry& g, int64_t c, int64_t v0, int64_t v1, F&& f) {
  int64_t plane = v0 / g.s, off = v0 % g.s;
  for (int64_t v = v0; v < v1; ++plane, off = 0) {
    const int64_t len = std::min(g.s - off, v1 - v);
    const int64_t f0 = (plane * g.c + c) * g.s + off;
    f(f0, f0 + len);
    v += len;
  }
}

// The pivoted/corrected mean of a channel holding +-Inf is NaN (Inf - Inf); TensorFlow's plain
// sum gives +-Inf (or NaN when both signs or a NaN occur). Channels whose mean came out NaN are
// summed again plainly, so non-finite inputs propagate exactly as in TensorFlow. Rare: costs
// nothing on finite data.
template <typename T>
double PlainMean(const Geometry& g, const void* xv, int64_t c) {
  const T* x = static_cast<const T*>(xv);
  double sum = 0;
  if (g.channels_last) {
    for (int64_t r = 0; r < g.n * g.s; ++r) sum += static_cast<double>(ToAcc(x[r * g.c + c]));
  } else {
    for (int64_t b = 0; b < g.n; ++b) {
      const T* p = x + (b * g.c + c) * g.s;
      for (int64_t i = 0; i < g.s; ++i) sum += static_cast<double>(ToAcc(p[i]));
    }
  }
  return sum / static_cast<double>(g.per_channel());
}

void FixNonFiniteMeanSlow(DataType dtype, const Geometry& g, const void* x, int64_t c,
                          double* mean) {
  WithType(dtype, [&](auto tag) { *mean = PlainMean<decltype(tag)>(g, x, c); });
}

inline void FixNonFiniteMean(DataType dtype, const Geometry& g, const void* x, int64_t c,
                             double* mean) {
  if (std::isnan(*mean)) FixNonFiniteMeanSlow(dtype, g, x, c, mean);
}

// Chan-merges the row-range partials (slots of `slot` doubles: mean, M2) of channels [c0, c1) in
// row-range order into mean and variance (M2 / rows), vectorized over channels (wide batch-1
// layers have thousands: one at a time, the merge of 1x7x7x2048 took 3 us of a 27 us call).
// NaN means (an infinite input) are then recomputed plainly (FixNonFiniteMean).
void MergeRowPartials(DataType dtype, const Geometry& g, const void* x, const RowPartition& p,
                      int64_t rows, int64_t C, const double* partial, size_t slot, int64_t c0,
                      int64_t c1, double* mean, double* variance) {
  // Every channel has the same per-task counts: Chan's weights once per row range.
  double w[2 * kMaxReduceTasks];
  ChanWeights(
      p.row_tasks,
      [&](int64_t t) {
        const int64_t r0 = t * p.rows_per_task;
        return static_cast<double>(std::min(rows, r0 + p.rows_per_task) - r0);
      },
      w);
  if (MergeChannelPartials(c1 - c0, p.row_tasks, partial + c0, slot, C, w,
                           1.0 / static_cast<double>(rows), mean + c0, variance + c0)) {
    for (int64_t c = c0; c < c1; ++c) FixNonFiniteMean(dtype, g, x, c, &mean[c]);
  }
}

// Sums the row-range partial sums (slots of `slot` doubles: Σdy, Σdy·(x - m)) of channels
// [c0, c1) in row-range order. Row ranges outer, channels inner: vectorizable, and the same order
// per channel.
void MergeRowSums(const RowPartition& p, int64_t C, const double* partial, size_t slot, int64_t c0,
                  int64_t c1, double* sum_dy, double* sum_dy_xc) {
  std::fill(sum_dy + c0, sum_dy + c1, 0.0);
  std::fill(sum_dy_xc + c0, sum_dy_xc + c1, 0.0);
  for (int64_t t = 0; t < p.row_tasks; ++t) {
    const double* s = partial + slot * static_cast<size_t>(t);
    for (int64_t c = c0; c < c1; ++c) {
      sum_dy[c] += s[c];
      sum_dy_xc[c] += s[C + c];
    }
  }
}

}  // namespace

namespace {

// Where channels-last statistics read their rows: as RowReadOf, but kFlushed (StatsRows' first
// pass in row order) where the rows come from DRAM: tensors larger than the victim L3 that do not
// prefetch, and tensors whose input was not in cache at the call's start (`probe`). Measured on
// Zen 4 (process-level, old/new fbn_bench alternating, float training forward): flushed
// 32x14x14x512, 128x7x7x512, 96x8x8x384 and x448, 1x28x28x512, 96x17x17x128 0.73-0.83x the
// time; warm 32x28x28x512, 128x14x14x512, 96x17x17x384 0.76-0.83x. Warm tensors between half and
// all of the L3 (partly cached) measured 1.03-1.31x in row order, so they keep the strips unless
// the probe finds them uncached. 16-bit types (in-process, alternating calls), flushed:
// bfloat16 1x28x28x512 0.49x the time, 32x28x28x256 0.70x, 32x14x14x512 0.84-0.93x, 7x7 and 8x8
// shapes unchanged; float16 0.62-0.84x on the same shapes. Process-level, bfloat16 training
// forwards, cold: 0.77-0.88x on 32x28x28x256, 1x28x28x512, 96x8x8x384 and x448, 128x7x7x512,
// 32x14x14x512; 1.04-1.09x (within the run's noise) on 96x17x17x128 and x192, 128x14x14x256,
// 32x56x56x128. Not
// for calls of fewer than 128 rows (batch-1 7x7: 1.06-1.2x), the channel-group tasks of
// ForwardTrainingGroups (batch-1 14x14x512 and x1024 training forwards 1.18-1.21x), nor rows of 4
// KB multiples, whose kDram blocks are shorter (BlockRows): kFlushed takes kL3's blocks, so the
// probe can never change a result.
RowRead StatsRead(const Geometry& g, size_t es, int threads, InputProbe& probe) {
  const RowRead read = RowReadOf(g, es, 2, true, threads);
  const bool dram = read == RowRead::kDram && (g.c * static_cast<int64_t>(es)) % kPageBytes != 0;
  if (!g.channels_last || g.n * g.s < 2 * kMinRowsPerTask ||
      (read != RowRead::kL2 && read != RowRead::kL3 && !dram)) {
    return read;
  }
  if (dram && static_cast<double>(g.elements() * static_cast<int64_t>(es)) > VictimL3Bytes()) {
    return RowRead::kFlushed;
  }
  return InputFromMemory(g, static_cast<double>(es), probe) ? RowRead::kFlushed : read;
}

// Channels-first tensors of several images can be reduced in memory order, image by image, instead
// of channel by channel: a channel's planes lie C·S elements apart, so the channel-major tasks
// read a few hundred bytes to a few KB per image, scattered over the tensor, which memory serves
// at about half the rate of a linear read (128x1024x14x14 float statistics 20 GB/s, a plain
// two-thread read 32-35). In image order the statistics take one block per plane and the sums add
// per-plane sums; the reduction then no longer leaves its channels in cache for a fused rewrite,
// and the elementwise pass reads its inputs again.
//
// Gradient sums (training and frozen): planes up to 8 KB, 2 KB for 16-bit types, whose widening
// keeps the second read from keeping pace. Zen 4, alternating calls, image order / channel order,
// training gradient: float 14x14, 17x17, 28x28 and 35x35 planes at batch 32-128 0.46-0.87x the
// time with the operands flushed, 0.50-0.87x in cache; 7x7 and 8x8 0.53-0.87x; bfloat16 14x14 to
// 28x28 0.41-0.75x; bfloat16 7x7 0.64-0.73x flushed, 1.05-1.11x in cache. The frozen gradient
// 0.53-0.83x (32x256x14x14 in cache 1.05x). Longer planes lost: float 56x56 1.09-1.35x, bfloat16
// 35x35 1.05-1.11x.
constexpr int64_t kImageSumsPlaneBytes = 8192;
constexpr int64_t kImageSumsPlaneBytes16 = 2048;

bool SumsByImage(const Geometry& g, size_t es) {
  if (g.channels_last || g.n < 2) return false;
  const int64_t plane = g.s * static_cast<int64_t>(es);
  return plane <= (es < 4 ? kImageSumsPlaneBytes16 : kImageSumsPlaneBytes);
}

// The training gradient's sums (BackwardTraining, and BackwardReduce in the same order), in image
// order as SumsByImage for planes up to kFusedPlaneBytes, except for planes over 1 KB in
// tensors of 64 MB and more: there each channel-major run is long enough to stream, and the fused
// and split passes rewrite dx from cache where image order reads dy and x from memory twice. Full
// benchmark runs, process level, image order / channel order, float 28x28: 12-25 MB 0.56-0.79x,
// 49 MB 0.86-1.02x, 98 MB 1.09-1.10x, 196 MB 1.19-1.23x (1.10-1.21x alternating); bfloat16 28x28
// 49 MB 0.85-0.99x, 98 MB 1.06-1.15x. Shorter planes kept winning there (7x7 and 14x14 at 49-98 MB
// 0.50-1.02x).
constexpr int64_t kLongPlaneBytes = 1024;
constexpr double kLongPlaneTensorBytes = 64.0 * 1024 * 1024;

// The fused training passes read their inputs once where they come from DRAM (RewriteChunk
// overlaps each chunk's rewrite with the read of the next), which beats image order for planes
// over this size whatever the tensor's size. Calls alternating in one process, channel order
// with the overlap / image order, warm and cold: float 28x28 planes 1.10-1.33x faster in the
// training forward and 1.08-1.52x in the training gradient (12-49 MB tensors), 35x35 1.03-1.25x
// forward and 0.84-1.27x gradient (geomean 1.10); 17x17 and shorter planes lost (float 14x14 and
// 17x17 forwards 0.71-1.0x, bfloat16 17x17 gradients 0.63-0.83x), so they keep image order.
constexpr int64_t kFusedPlaneBytes = 2048;

bool TrainingSumsByImage(const Geometry& g, size_t es) {
  const double bytes = static_cast<double>(g.elements()) * static_cast<double>(es);
  const int64_t plane = g.s * static_cast<int64_t>(es);
  return SumsByImage(g, es) && plane <= kFusedPlaneBytes &&
         !(plane > kLongPlaneBytes && bytes >= kLongPlaneTensorBytes);
}

// Statistics (training forward, and ComputeStats in the same order): float and double planes over
// kShortPlaneBytes and up to kFusedPlaneBytes, in tensors of at least 13 MB. Per-plane blocks cost
// a lane reduction and divisions per plane, which 7x7 and 8x8 float planes do not hide (1.1-2.1x
// the time), nor 16-bit planes, which widen (in cache 1.04-1.48x); and smaller tensors the fused
// rewrite reads from L2 while the separate pass reads them from L3 (9.6-12.8 MB: 0.74-0.86x
// flushed but 1.0-1.18x in cache). Training forward, float, image order / channel order (before
// the fused passes overlapped): 14 to 25 MB tensors of 14x14 and 17x17 planes 0.51-0.71x flushed,
// 0.60-0.80x in cache; 51-135 MB tensors of 14x14 to 35x35 planes 0.66-0.93x; double 28-51 MB
// 0.63-0.82x.
constexpr double kImageStatsBytes = 13.0 * 1024 * 1024;
// Planes up to this size the kernels read four channels at a time (their kShortPlaneBytes).
constexpr int64_t kFourPlaneBytes = 256;

bool StatsByImage(const Geometry& g, size_t es) {
  if (g.channels_last || g.n < 2 || es < 4) return false;
  const int64_t plane = g.s * static_cast<int64_t>(es);
  const double bytes = static_cast<double>(g.elements()) * static_cast<double>(es);
  return plane > kFourPlaneBytes && plane <= kFusedPlaneBytes && bytes >= kImageStatsBytes;
}

// Image-order tasks: image ranges, and where the images are too few for the tasks the size asks
// for, channel groups too (multiples of four channels, as the kernels take them). Task t covers
// image range t / groups and channel group t % groups; like every partition here it depends on
// the shape only.
struct ImagePartition {
  int64_t per_range, ranges, width, groups;
  int64_t tasks() const { return ranges * groups; }
  int64_t n0(int64_t t) const { return t / groups * per_range; }
  int64_t n1(int64_t t, int64_t n) const { return std::min(n, n0(t) + per_range); }
  int64_t c0(int64_t t) const { return t % groups * width; }
  int64_t c1(int64_t t, int64_t c) const { return std::min(c, c0(t) + width); }
};
constexpr int64_t kImageGroupChannels = 4;

ImagePartition PartitionImages(const Geometry& g, double bytes_per_element) {
  const double bytes = static_cast<double>(g.elements()) * bytes_per_element;
  const int64_t wanted = ClampTasks(bytes / kReduceTaskBytes, kMaxReduceTasks);
  ImagePartition p;
  p.per_range = CeilDiv(g.n, std::min(g.n, wanted));
  p.ranges = CeilDiv(g.n, p.per_range);
  const int64_t more = std::min(CeilDiv(wanted, p.ranges), CeilDiv(g.c, kImageGroupChannels));
  p.width = CeilDiv(CeilDiv(g.c, more), kImageGroupChannels) * kImageGroupChannels;
  p.groups = CeilDiv(g.c, p.width);
  return p;
}

// Statistics in image order (StatsByImage): per image range the Chan merge of its planes, then
// the ranges merged in order.
void ImageStats(DataType dtype, const Geometry& g, const void* x, int threads, double* mean,
                double* variance) {
  const KernelEntry& e = Entry(dtype);
  const size_t es = ElemBytes(dtype);
  const int64_t C = g.c;
  const ImagePartition p = PartitionImages(g, static_cast<double>(es));
  const size_t slot = static_cast<size_t>(2 * C);  // mean, M2
  double* partial = Scratch(slot * static_cast<size_t>(p.ranges));
  threading::ParallelFor(p.tasks(), threads, [&](int64_t t) {
    double* s = partial + slot * static_cast<size_t>(t / p.groups);
    e.stats_images(x, C, g.s, p.c0(t), p.c1(t, C), p.n0(t), p.n1(t, g.n), s, s + C);
  });
  double w[2 * kMaxReduceTasks];
  ChanWeights(
      p.ranges,
      [&](int64_t r) {
        const int64_t t = r * p.groups;
        return static_cast<double>((p.n1(t, g.n) - p.n0(t)) * g.s);
      },
      w);
  if (MergeChannelPartials(C, p.ranges, partial, slot, C, w,
                           1.0 / static_cast<double>(g.per_channel()), mean, variance)) {
    for (int64_t c = 0; c < C; ++c) FixNonFiniteMean(dtype, g, x, c, &mean[c]);
  }
}

// Channels-last statistics of tensors a victim L3 holds (from one L2 to half the L3) take two
// sweeps of the whole tensor, the row ranges' results merged between them: the means, then the
// sums of deviations about the merged mean. StatsRows' block-by-block passes re-read each block
// from L2 one row per access, a stride the prefetchers do not follow across pages; one strip
// sweep reads the tensor from L3 at close to a linear read's speed (Zen 4, 12.8 MB of 8 KB rows,
// 2 threads: 100-120 us against 350-450 for both block passes). Training forwards, calls
// alternating in one process, two sweeps / blocks, the 44 such NHWC cases of the benchmark:
// geomean 0.94x the time; 32x7x7x2048 float 0.77x warm and cold, bfloat16 0.64x warm and 0.78x
// cold, 96x8x8x448 float 0.87x warm; the losses are cold 12.8 MB tensors of 2 KB rows, whose
// second sweep reads from L3 what the blocks read from L2 (32x14x14x1024 bfloat16 1.11x,
// 128x7x7x512 float 1.10x, 32x14x14x512 float 1.07x), and 96x8x8x192 float warm 1.06x. From
// one L2 to two: 1.6 MB tensors 0.86-1.0x (32x7x7x512 bfloat16 0.91x warm, 0.87x cold); at 0.8
// MB 0.96-1.08x, so smaller tensors keep the blocks, as do rows narrower than
// kTwoSweepRowBytes.
constexpr int64_t kTwoSweepRowBytes = 512;
// Sweep ranges (whole rows, all channels): about this many bytes each, a multiple of
// kSweepTaskMultiple of them (the partition depends on the shape only, and balances 2 and 4
// threads), and at most kMaxSweepRows rows, the float accumulators' longest run (as BlockRows'
// blocks). Four 3.2 MB ranges of 32x7x7x2048 float took 0.84-0.90x the time of 1 MB ones.
constexpr double kSweepTaskBytes = 4.0 * 1024 * 1024;
constexpr int64_t kSweepTaskMultiple = 4;
constexpr int64_t kMaxSweepRows = 2048;

// Decided from the shape and the machine's caches only, never from the thread count or the cache
// probe: the two ways round differently, and a result must not depend on either.
bool StatsInTwoSweeps(const Geometry& g, size_t es) {
  const double bytes = static_cast<double>(g.elements() * static_cast<int64_t>(es));
  return g.channels_last && g.c * static_cast<int64_t>(es) >= kTwoSweepRowBytes &&
         g.n * g.s >= kSweepTaskMultiple * kMinRowsPerTask && bytes > L2Bytes() &&
         bytes <= VictimL3Bytes() / 2;
}

RowPartition SweepPartition(int64_t rows, int64_t C, size_t es) {
  const double bytes = static_cast<double>(rows * C * static_cast<int64_t>(es));
  int64_t tasks = std::max(static_cast<int64_t>(std::ceil(bytes / kSweepTaskBytes)),
                           CeilDiv(rows, kMaxSweepRows));
  tasks = CeilDiv(tasks, kSweepTaskMultiple) * kSweepTaskMultiple;
  tasks = std::min<int64_t>({tasks, rows / kMinRowsPerTask, kMaxReduceTasks});
  RowPartition p;
  p.rows_per_task = CeilDiv(rows, tasks);
  p.row_tasks = CeilDiv(rows, p.rows_per_task);
  p.width = C;
  p.groups = 1;
  return p;
}

// The merged mean of the first sweep, m = Σ n_t·bm_t / n, rounded to the accumulation type A:
// the second sweep's pivot (its sums correct the rounding).
template <typename A>
void MergeSweepMeans(const RowPartition& p, int64_t rows, int64_t C, const double* partial,
                     size_t slot, A* m) {
  std::vector<double>& acc = MergeScratch(static_cast<size_t>(C));
  std::fill(acc.begin(), acc.end(), 0.0);
  for (int64_t t = 0; t < p.row_tasks; ++t) {
    const A* bm = reinterpret_cast<const A*>(partial + slot * static_cast<size_t>(t));
    const int64_t r0 = t * p.rows_per_task;
    const double n = static_cast<double>(std::min(rows, r0 + p.rows_per_task) - r0);
    for (int64_t c = 0; c < C; ++c) acc[c] += n * static_cast<double>(bm[c]);
  }
  const double inv = 1.0 / static_cast<double>(rows);
  for (int64_t c = 0; c < C; ++c) m[c] = static_cast<A>(acc[c] * inv);
}

// StatsInTwoSweeps' statistics over the row ranges of p: mean = m + Σd/n and
// M2 = Σd² - (Σd)²/n with d = x - m (the corrected two-pass algorithm), sums in range order.
// `first`: kFlushed where the input is not in cache (the probe), else kL3.
void TwoSweepStats(DataType dtype, const Geometry& g, const void* x, const RowPartition& p,
                   int threads, RowRead first, double* mean, double* variance) {
  const KernelEntry& e = Entry(dtype);
  const int64_t C = g.c, rows = g.n * g.s;
  // Per row range: C block means (accumulation type), 2·C accumulators, s1 and s2 (double).
  const size_t slot = static_cast<size_t>(5 * C);
  double* partial = Scratch(slot * static_cast<size_t>(p.row_tasks) + static_cast<size_t>(C));
  double* mbuf = partial + slot * static_cast<size_t>(p.row_tasks);
  threading::ParallelFor(p.row_tasks, threads, [&](int64_t t) {
    const int64_t r0 = t * p.rows_per_task;
    double* s = partial + slot * static_cast<size_t>(t);
    e.mean_rows(x, C, 0, C, r0, std::min(rows, r0 + p.rows_per_task), s, s + C, first);
  });
  if (dtype == DataType::kFloat64) {
    MergeSweepMeans(p, rows, C, partial, slot, mbuf);
  } else {
    MergeSweepMeans(p, rows, C, partial, slot, reinterpret_cast<float*>(mbuf));
  }
  threading::ParallelFor(p.row_tasks, threads, [&](int64_t t) {
    const int64_t r0 = t * p.rows_per_task;
    double* s = partial + slot * static_cast<size_t>(t);
    e.deviation_rows(x, C, 0, C, r0, std::min(rows, r0 + p.rows_per_task), mbuf, s + 3 * C,
                     s + 4 * C, s + C);
  });
  MergeRowSums(p, C, partial + 3 * C, slot, 0, C, mean, variance);  // Σd, Σd² in range order
  const double n = static_cast<double>(rows);
  bool nan = false;
  for (int64_t c = 0; c < C; ++c) {
    const double m = dtype == DataType::kFloat64
                         ? mbuf[c]
                         : static_cast<double>(reinterpret_cast<const float*>(mbuf)[c]);
    const double s1 = mean[c];
    mean[c] = m + s1 / n;
    double m2 = variance[c] - s1 * s1 / n;
    if (m2 < 0) m2 = 0;  // NaN stays NaN
    variance[c] = m2 / n;
    nan |= !std::isfinite(mean[c]);
  }
  if (nan) {
    for (int64_t c = 0; c < C; ++c) FixNonFiniteMean(dtype, g, x, c, &mean[c]);
  }
}

void ComputeStatsWith(DataType dtype, const Geometry& g, const void* x, int threads,
                      InputProbe& probe, double* mean, double* variance) {
  const KernelEntry& e = Entry(dtype);
  const size_t es = ElemBytes(dtype);
  const int64_t C = g.c;
  if (g.channels_last) {
    const int64_t rows = g.n * g.s;
    if (StatsInTwoSweeps(g, es)) {
      const RowRead first =
          InputFromMemory(g, static_cast<double>(es), probe) ? RowRead::kFlushed : RowRead::kL3;
      return TwoSweepStats(dtype, g, x, SweepPartition(rows, C, es), threads, first, mean,
                           variance);
    }
    const RowPartition p = PartitionRows(rows, C, static_cast<double>(es));
    const RowRead read = StatsRead(g, es, threads, probe);
    const size_t slot = static_cast<size_t>(5 * C);  // mean, m2, 3·C scratch accumulators
    double* partial = Scratch(slot * static_cast<size_t>(p.row_tasks));
    threading::ParallelFor(p.tasks(), threads, [&](int64_t t) {
      const int64_t rt = t / p.groups, c0 = (t % p.groups) * p.width;
      double* s = partial + slot * static_cast<size_t>(rt);
      const int64_t r0 = rt * p.rows_per_task;
      e.stats_rows(x, C, c0, std::min(C, c0 + p.width), r0, std::min(rows, r0 + p.rows_per_task), s,
                   s + C, s + 2 * C, read);
    });
    MergeRowPartials(dtype, g, x, p, rows, C, partial, slot, 0, C, mean, variance);
    return;
  }
  // In the order ForwardTraining takes: the same statistics whichever pass computes them.
  if (StatsByImage(g, es)) return ImageStats(dtype, g, x, threads, mean, variance);
  const int64_t M = g.per_channel();
  const RunPartition p = PartitionRuns(C, M, static_cast<double>(es));
  double* partial = Scratch(2 * static_cast<size_t>(C * p.pieces));
  threading::ParallelFor(p.tasks, threads, [&](int64_t t) {
    ForEachRun(p, C, M, t, [&](int64_t c, int64_t piece, int64_t v0, int64_t v1) {
      double* s = partial + 2 * static_cast<size_t>(c * p.pieces + piece);
      e.stats_run(Offset(x, c * g.s, es), C * g.s, g.s, v0, v1, s, s + 1);
    });
  });
  const double* w = PieceWeights(p, M);
  for (int64_t c = 0; c < C; ++c) {
    MergePieceStats(p, M, w, partial + 2 * static_cast<size_t>(c * p.pieces), &mean[c],
                    &variance[c]);
    FixNonFiniteMean(dtype, g, x, c, &mean[c]);
  }
}

}  // namespace

void ComputeStats(DataType dtype, const Geometry& g, const void* x, double* mean,
                  double* variance) {
  const CallTuning tuning(CallTuning::Entry::kStats, dtype, g);
  const size_t es = ElemBytes(dtype);
  if (const Swap how = SwapOf(g, es); how != Swap::kNo) {
    const SwappedCall call(how, dtype, g);
    return ComputeStats(dtype, call.geometry(), call.In(x, 0), mean, variance);
  }
  InputProbe probe(g, es, x);
  ComputeStatsWith(dtype, g, x, CallThreads(g, es, 1, probe), probe, mean, variance);
}

namespace {

// Elementwise passes (inference, the backward apply) split `total` units (rows or elements) into
// tasks of about kApplyTaskBytes, as many as a multiple of `threads`, with boundaries on multiples
// of `align` units, and call f(begin, end) per task. A task count that is not a multiple of the
// threads leaves one thread a whole task more: batch-1 7x7x2048 bfloat16 in 64 KB tasks was 32
// rows for one thread and 17 for the other. Elementwise results do not depend on the split.
template <typename F>
void ForEachApplyRange(int64_t total, double unit_bytes, int64_t align, int threads, F&& f) {
  int64_t tasks = std::max<int64_t>(
      1,
      static_cast<int64_t>(std::ceil(static_cast<double>(total) * unit_bytes / kApplyTaskBytes)));
  tasks = CeilDiv(tasks, threads) * threads;
  const auto bound = [&](int64_t t) {
    return std::min(total, CeilDiv(t * total / tasks, align) * align);
  };
  threading::ParallelFor(tasks, threads, [&](int64_t t) {
    const int64_t begin = bound(t), end = bound(t + 1);
    if (begin < end) f(begin, end);
  });
}

// Flat (channels-first) task boundaries fall on multiples of this many elements: whole cache lines
// for every dtype, so no line is written by two threads.
constexpr int64_t kFlatAlign = 64;

// Where a channels-last apply's rows come from: as RowReadOf, but from DRAM when a streaming
// call's input was not in cache at its start (`probe`, before anything read it). Its output is
// not cached then either, and the regular stores of bfloat16 strips from L3 would fetch every
// output line first (96x35x35x48 inference, operands flushed: 1.28x the row-order stream).
// kFlushed when such a call keeps regular stores (16-bit outputs under kProbeRowOrder16Bytes):
// its rows then go in row order, which the prefetchers follow from DRAM.
RowRead ApplyRead(const Geometry& g, size_t es, int threads, bool stream, InputProbe& probe) {
  const RowRead read = RowReadOf(g, es, 2, false, threads);
  if (read == RowRead::kL3 && stream && !probe.InCoreCache()) return RowRead::kDram;
  if (!stream && (read == RowRead::kL2 || read == RowRead::kL3) &&
      InputFromMemory(g, static_cast<double>(es), probe)) {
    return RowRead::kFlushed;
  }
  return read;
}

// Where the gradients' channels-last reductions read their rows: as RowReadOf, but kFlushed when
// the call's input was not in cache at its start (`probe`) although the tensor fits the caches.
// The reductions read rows in strips, which the hardware prefetchers do not follow from DRAM:
// software prefetches do. Operands flushed, alternating calls, training-gradient sums (from L2 or
// L3): 32x7x7x512, 32x14x14x256, 1x28x28x256, 96x8x8x448 bfloat16 and 96x17x17x192 bfloat16
// 0.76-0.88x the time, float tensors of 3-13 MB with 64-448 channels 1.0-1.06x. The frozen
// gradient (from L3 only: from L2 it sweeps rows in order) 0.54-0.96x: 32x14x14x256,
// 96x8x8x192, 32x28x28x128, 32x14x14x512, 96x17x17x192. In cache (the probe can misread L3
// hits) prefetching would cost 0.89-1.08x.
// The training gradient's sums of DRAM-sized tensors below the prefetch size (kDram: 16-64 MB
// here) prefetch the next block too when rows have more than this many channels: calls
// alternating in one process, warm and cold, 0.75-0.97x the time on 160-2048 channels
// (32x28x28x512 bfloat16 0.75-0.82x, 32x28x28x256 float 0.79-0.85x, 128x14x14x256 float
// 0.81-0.87x, 96x17x17x384 0.77-0.89x); 128 channels 0.93-1.0x, and 48-96 float channels
// 1.05-1.09x slower (kNarrowSumChannels). Prefetches change no value.

RowRead ReductionRead(const Geometry& g, size_t es, bool frozen, int threads, InputProbe& probe) {
  const RowRead read = RowReadOf(g, es, 3, !frozen, threads);
  if (g.channels_last && !frozen && read == RowRead::kDram && g.c > kNarrowSumChannels) {
    return RowRead::kPrefetch;
  }
  const bool fits = frozen ? read == RowRead::kL3 : read == RowRead::kL2 || read == RowRead::kL3;
  if (!g.channels_last || !fits) return read;
  return InputFromMemory(g, static_cast<double>(es), probe) ? RowRead::kFlushed : read;
}

// `read`: ApplyRead's, decided before the call read anything (channels-last only).
void ApplyWith(DataType dtype, const Geometry& g, const void* x, const void* mean, const void* a,
               const void* b, void* y, int threads, bool stream, RowRead read) {
  const KernelEntry& e = Entry(dtype);
  const size_t es = ElemBytes(dtype);
  if (g.channels_last) {
    ForEachApplyRange(g.n * g.s, static_cast<double>(g.c * es), 1, threads,
                      [&](int64_t r0, int64_t r1) {
                        e.apply_rows(x, g.c, 0, g.c, r0, r1, mean, a, b, y, stream, read);
                      });
  } else {
    ForEachApplyRange(
        g.elements(), static_cast<double>(es), kFlatAlign, threads,
        [&](int64_t f0, int64_t f1) { e.apply_flat(x, g.c, g.s, f0, f1, mean, a, b, y, stream); });
  }
}

}  // namespace

void Apply(DataType dtype, const Geometry& g, const void* x, const void* mean, const void* a,
           const void* b, void* y) {
  const CallTuning tuning(CallTuning::Entry::kApply, dtype, g);
  const size_t es = ElemBytes(dtype);
  if (const Swap how = SwapOf(g, es, true); how != Swap::kNo) {
    const SwappedCall call(how, dtype, g);
    void* out = call.Out(y);
    Apply(dtype, call.geometry(), call.In(x, 0), mean, a, b, out);
    return call.Finish(out, y);
  }
  InputProbe probe(g, es, x);
  const int threads = CallThreads(g, es, 2, probe);
  const bool stream = StreamStores(g, es, 2, threads, ProbeBytesOneSweep(es, false), probe);
  ApplyWith(dtype, g, x, mean, a, b, y, threads, stream, ApplyRead(g, es, threads, stream, probe));
}

namespace {

// Shared by BackwardReduce and FrozenBackward: k1 == nullptr means reduce only.
// The frozen backward writes dx in the same sweep, streamed when `stream`.
// `prepare` and `finish` as for FrozenBackward: in the channel-group tasks when the rows are one
// range (the tasks' sums are then final), else on the calling thread.
// `read`: where channels-last rows come from (ReductionRead).
void ReduceImpl(DataType dtype, const Geometry& g, const void* dy, const void* x, const void* mean,
                const void* k1, void* dx, int threads, bool stream, RowRead read, double* sum_dy,
                double* sum_dy_xc, ChannelStep prepare = {}, ChannelStep finish = {}) {
  const KernelEntry& e = Entry(dtype);
  const size_t es = ElemBytes(dtype);
  const int64_t C = g.c;
  if (g.channels_last) {
    const int64_t rows = g.n * g.s;
    const RowPartition p = PartitionRows(rows, C, 2.0 * static_cast<double>(es));
    const size_t slot = static_cast<size_t>(4 * C);  // sums, 2·C scratch accumulators
    double* partial = Scratch(slot * static_cast<size_t>(p.row_tasks));
    const bool in_tasks = p.row_tasks == 1;
    if (!in_tasks) prepare(0, C);
    threading::ParallelFor(p.tasks(), threads, [&](int64_t t) {
      const int64_t rt = t / p.groups, c0 = (t % p.groups) * p.width;
      const int64_t c1 = std::min(C, c0 + p.width);
      double* s = partial + slot * static_cast<size_t>(rt);
      const int64_t r0 = rt * p.rows_per_task;
      if (in_tasks) prepare(c0, c1);
      e.reduce_rows(dy, x, C, c0, c1, r0, std::min(rows, r0 + p.rows_per_task), rows, mean, s,
                    s + C, k1, dx, s + 2 * C, stream, read);
      if (in_tasks) {
        MergeRowSums(p, C, partial, slot, c0, c1, sum_dy, sum_dy_xc);
        finish(c0, c1);
      }
    });
    if (in_tasks) return;
    MergeRowSums(p, C, partial, slot, 0, C, sum_dy, sum_dy_xc);
    finish(0, C);
    return;
  }
  prepare(0, C);
  // The training gradient's sums (no k1) in the order BackwardTraining takes.
  if (k1 == nullptr ? TrainingSumsByImage(g, es) : SumsByImage(g, es)) {
    // Per image range, then the ranges added in order.
    const ImagePartition p = PartitionImages(g, 2.0 * static_cast<double>(es));
    const size_t slot = static_cast<size_t>(2 * C);  // Σdy, Σdy·(x - m)
    double* partial = Scratch(slot * static_cast<size_t>(p.ranges));
    threading::ParallelFor(p.tasks(), threads, [&](int64_t t) {
      double* s = partial + slot * static_cast<size_t>(t / p.groups);
      e.reduce_images(dy, x, C, g.s, p.c0(t), p.c1(t, C), p.n0(t), p.n1(t, g.n), mean, s, s + C, k1,
                      dx, stream);
    });
    std::fill(sum_dy, sum_dy + C, 0.0);
    std::fill(sum_dy_xc, sum_dy_xc + C, 0.0);
    for (int64_t r = 0; r < p.ranges; ++r) {
      const double* s = partial + slot * static_cast<size_t>(r);
      for (int64_t c = 0; c < C; ++c) {
        sum_dy[c] += s[c];
        sum_dy_xc[c] += s[C + c];
      }
    }
    finish(0, C);
    return;
  }
  const int64_t M = g.per_channel();
  const RunPartition p = PartitionRuns(C, M, 2.0 * static_cast<double>(es));
  double* partial = Scratch(2 * static_cast<size_t>(C * p.pieces));
  if (p.pieces == 1) {
    // Whole channels per task: several at a time (reduce_runs gives each the sums reduce_run
    // gives it). The sums then add to zero as MergePieceSums adds one piece.
    double* ps = partial;
    double* pt = partial + C;
    threading::ParallelFor(p.tasks, threads, [&](int64_t t) {
      const int64_t c0 = t * p.group, c1 = std::min(C, c0 + p.group);
      e.reduce_runs(dy, x, C, g.s, g.n, c0, c1, mean, ps, pt, k1, dx, stream);
    });
    for (int64_t c = 0; c < C; ++c) {
      sum_dy[c] = 0.0 + ps[c];
      sum_dy_xc[c] = 0.0 + pt[c];
    }
    finish(0, C);
    return;
  }
  threading::ParallelFor(p.tasks, threads, [&](int64_t t) {
    ForEachRun(p, C, M, t, [&](int64_t c, int64_t piece, int64_t v0, int64_t v1) {
      double* s = partial + 2 * static_cast<size_t>(c * p.pieces + piece);
      e.reduce_run(dy, x, c * g.s, C * g.s, g.s, v0, v1, mean, c, s, s + 1, k1, dx, stream);
    });
  });
  for (int64_t c = 0; c < C; ++c) {
    MergePieceSums(p, partial + 2 * static_cast<size_t>(c * p.pieces), &sum_dy[c], &sum_dy_xc[c]);
  }
  finish(0, C);
}

}  // namespace

void BackwardReduce(DataType dtype, const Geometry& g, const void* dy, const void* x,
                    const void* mean, double* sum_dy, double* sum_dy_xc) {
  const CallTuning tuning(CallTuning::Entry::kBackwardReduce, dtype, g);
  const size_t es = ElemBytes(dtype);
  if (const Swap how = SwapOf(g, es); how != Swap::kNo) {
    const SwappedCall call(how, dtype, g);
    return BackwardReduce(dtype, call.geometry(), call.In(dy, 0), call.In(x, 1), mean, sum_dy,
                          sum_dy_xc);
  }
  InputProbe probe(g, es, dy);
  const int threads = CallThreads(g, es, 2, probe);
  ReduceImpl(dtype, g, dy, x, mean, nullptr, nullptr, threads, false,
             ReductionRead(g, es, false, threads, probe), sum_dy, sum_dy_xc);
}

void FrozenBackward(DataType dtype, const Geometry& g, const void* dy, const void* x,
                    const void* mean, const void* k1, void* dx, double* sum_dy, double* sum_dy_xc,
                    ChannelStep prepare, ChannelStep finish) {
  const CallTuning tuning(CallTuning::Entry::kFrozenBackward, dtype, g);
  const size_t es = ElemBytes(dtype);
  if (const Swap how = SwapOf(g, es); how != Swap::kNo) {
    const SwappedCall call(how, dtype, g);
    void* out = call.Out(dx);
    FrozenBackward(dtype, call.geometry(), call.In(dy, 0), call.In(x, 1), mean, k1, out, sum_dy,
                   sum_dy_xc, prepare, finish);
    return call.Finish(out, dx);
  }
  InputProbe probe(g, es, dy);
  const int threads = CallThreads(g, es, 3, probe);
  // Both decided before anything reads dy.
  const bool stream = StreamStores(g, es, 3, threads, ProbeBytesOneSweep(es, true), probe);
  ReduceImpl(dtype, g, dy, x, mean, k1, dx, threads, stream,
             ReductionRead(g, es, true, threads, probe), sum_dy, sum_dy_xc, prepare, finish);
}

namespace {

void BackwardApplyWith(DataType dtype, const Geometry& g, const void* dy, const void* x,
                       const void* mean, const void* k1, const void* k2, const void* k0, void* dx,
                       int threads, bool stream) {
  const KernelEntry& e = Entry(dtype);
  const size_t es = ElemBytes(dtype);
  if (g.channels_last) {
    ForEachApplyRange(
        g.n * g.s, static_cast<double>(g.c * es), 1, threads, [&](int64_t r0, int64_t r1) {
          e.backward_apply_rows(dy, x, g.c, 0, g.c, r0, r1, mean, k1, k2, k0, dx, stream);
        });
  } else {
    ForEachApplyRange(
        g.elements(), static_cast<double>(es), kFlatAlign, threads, [&](int64_t f0, int64_t f1) {
          e.backward_apply_flat(dy, x, g.c, g.s, f0, f1, mean, k1, k2, k0, dx, stream);
        });
  }
}

}  // namespace

void BackwardApply(DataType dtype, const Geometry& g, const void* dy, const void* x,
                   const void* mean, const void* k1, const void* k2, const void* k0, void* dx) {
  const CallTuning tuning(CallTuning::Entry::kBackwardApply, dtype, g);
  const size_t es = ElemBytes(dtype);
  if (const Swap how = SwapOf(g, es, true); how != Swap::kNo) {
    const SwappedCall call(how, dtype, g);
    void* out = call.Out(dx);
    BackwardApply(dtype, call.geometry(), call.In(dy, 0), call.In(x, 1), mean, k1, k2, k0, out);
    return call.Finish(out, dx);
  }
  InputProbe probe(g, es, dy);
  const int threads = CallThreads(g, es, 3, probe);
  BackwardApplyWith(dtype, g, dy, x, mean, k1, k2, k0, dx, threads,
                    StreamStores(g, es, 3, threads, ProbeBytesOneSweep(es, false), probe));
}

namespace {

// k_mean = U(mean), k_a = U(scale / sqrt(variance + eps)), k_b = offset for channels [c0, c1).
void ForwardCoefficients(bool wide, int64_t c0, int64_t c1, const double* mean,
                         const double* variance, const void* scale, const void* offset, double eps,
                         void* k_mean, void* k_a, void* k_b) {
  const size_t us = wide ? sizeof(double) : sizeof(float);
  if (wide) {
    for (int64_t c = c0; c < c1; ++c) static_cast<double*>(k_mean)[c] = mean[c];
  } else {
    for (int64_t c = c0; c < c1; ++c) static_cast<float*>(k_mean)[c] = static_cast<float>(mean[c]);
  }
  ScaleOverStd(wide, c1 - c0, variance + c0, Offset(scale, c0, us), eps,
               static_cast<char*>(k_a) + static_cast<size_t>(c0) * us);
  std::memcpy(static_cast<char*>(k_b) + static_cast<size_t>(c0) * us, Offset(offset, c0, us),
              static_cast<size_t>(c1 - c0) * us);
}

// Calls f(f0, f1) for the flat ranges of channels [c0, c1) of a channels-first tensor: one range
// per image, since an image's planes of consecutive channels are adjacent (batch-1 7x7x2048: one
// writer call for a chunk of channels instead of one per 49-element plane).
template <typename F>
void ForEachImageRange(const Geometry& g, int64_t c0, int64_t c1, F&& f) {
  for (int64_t n = 0; n < g.n; ++n) f((n * g.c + c0) * g.s, (n * g.c + c1) * g.s);
}

// The fused channels-first paths alternate, on each thread, a reduction of a chunk's channels
// (reads) and their rewrite from cache (writes): with the inputs in DRAM a thread then uses the
// memory bus one way at a time. Where the inputs come from DRAM the rewrite prefetches the next
// chunk's inputs slice by slice (in each image, the planes right after the chunk's), so the
// thread's reads and writes overlap and the next reduction reads from L2. Calls alternating in
// one process, overlapped / not, the benchmark's fused channels-first training passes at batch
// 32-128: tensors over half the L3 1.02-1.32x faster (32x256x56x56 float forward 1.29x,
// 128x256x56x56 bfloat16 forward 1.22x and gradient 1.18x), operands flushed 1.05-1.39x; warm
// tensors the L3 holds lost 0.89-0.96x, so only inputs from DRAM overlap (the probe still reads
// some warm 11-14 MB bfloat16 inputs as uncached: 0.92-0.97x). Batch 1, flushed: float forwards
// 1.21-1.24x, gradients 0.95-1.10x.
constexpr double kOverlapSliceBytes = 4096;

// Prefetches elements [p0, p1) of `base` into L2.
void PrefetchToL2(const void* base, int64_t p0, int64_t p1, size_t es) {
  const char* q = static_cast<const char*>(base);
  const int64_t b1 = p1 * static_cast<int64_t>(es);
  for (int64_t b = p0 * static_cast<int64_t>(es); b < b1; b += kCacheLineBytes) {
    __builtin_prefetch(q + b, 0, 2);
  }
}

// Whether a call reads its input from DRAM: a tensor too large for the last-level cache to keep
// (RowReadOf), or one whose input was not in the calling core's cache at the call's start.
bool ReadsFromDram(const Geometry& g, size_t es, double bytes_per_element, int threads,
                   InputProbe& probe) {
  const RowRead read = RowReadOf(g, es, 2, false, threads);
  return read == RowRead::kDram || read == RowRead::kPrefetch ||
         InputFromMemory(g, bytes_per_element, probe);
}

// Calls rewrite over flat elements [f0, f1) in slices whose boundaries are multiples of
// kOverlapSliceBytes (whole cache lines, so no line has two writers), each slice preceded by the
// prefetch of its share of elements [p0, p1) of in0 (and of in1 if not null).
template <typename Rewrite>
void RewritePrefetching(int64_t f0, int64_t f1, int64_t p0, int64_t p1, size_t es, const void* in0,
                        const void* in1, Rewrite&& rewrite) {
  const int64_t slice =
      std::max<int64_t>(1, static_cast<int64_t>(kOverlapSliceBytes / static_cast<double>(es)));
  const int64_t len = f1 - f0, ahead = p1 - p0;
  for (int64_t a0 = f0; a0 < f1;) {
    const int64_t a1 = std::min(f1, (a0 / slice + 1) * slice);
    const int64_t q0 = p0 + (a0 - f0) * ahead / len, q1 = p0 + (a1 - f0) * ahead / len;
    PrefetchToL2(in0, q0, q1, es);
    if (in1 != nullptr) PrefetchToL2(in1, q0, q1, es);
    rewrite(a0, a1);
    a0 = a1;
  }
}

// Calls rewrite(f0, f1) over the flat ranges of channels [c0, c1), as ForEachImageRange; with
// `overlap`, prefetching the inputs of the next chunk [c1, c2) in the same image along the way
// (its planes follow the chunk's).
template <typename Rewrite>
void RewriteChunk(const Geometry& g, int64_t c0, int64_t c1, int64_t c2, bool overlap, size_t es,
                  const void* in0, const void* in1, Rewrite&& rewrite) {
  if (!overlap || c2 <= c1) return ForEachImageRange(g, c0, c1, rewrite);
  const int64_t next = (c2 - c1) * g.s;
  ForEachImageRange(g, c0, c1, [&](int64_t f0, int64_t f1) {
    RewritePrefetching(f0, f1, f1, f1 + next, es, in0, in1, rewrite);
  });
}

// The fused channels-first paths reduce a chunk of a task's channels, compute their coefficients
// in one call, then rewrite them. With one image a channel is one contiguous plane, and chunks
// whose inputs fit L1 let the rewrite read them from there: whole tasks (up to 256 KB, from L2)
// measured 0.75-0.82x on 1x64..256x56x56 float training gradients. With several images the
// writers' ranges (one per image) get short and scattered with small chunks: 32x512x7x7 and
// 96x192x8x8 gradients measured 1.4-1.6x faster with whole tasks.
// Inputs that come from DRAM (not in the calling core's cache) take chunks of a few KB: flushed
// 1x512x14x14 float gradients took 75 us in 16 KB chunks and 52 us in 4 KB ones.
int64_t FusedChunk(const Geometry& g, int64_t group, double bytes_per_element, InputProbe& probe) {
  if (g.n > 1) return group;
  const double channel_bytes = static_cast<double>(g.per_channel()) * bytes_per_element;
  const double chunk_bytes =
      InputFromMemory(g, bytes_per_element, probe) ? kFusedChunkFromMemoryBytes : kFusedChunkBytes;
  return std::max<int64_t>(1, static_cast<int64_t>(chunk_bytes / channel_bytes));
}

// Channels-first channels that fit one reduction task can be reduced and then rewritten while
// their data is still in cache. (Channels-last strips of channels over all rows were tried for
// small batches: with each thread keeping its rows across calls they gained nothing.)
bool FusePerChannel(const Geometry& g, double bytes_per_element) {
  if (g.channels_last) return false;
  return PartitionRuns(g.c, g.per_channel(), bytes_per_element).pieces == 1;
}

// Channels-last tensors whose rows are too few to split (batch-1 7x7x2048) are reduced in
// channel groups over all rows: each group task then owns its channels' final statistics and can
// finish them, compute its coefficients and rewrite its channels in the same parallel region,
// instead of the calling thread merging thousands of channels while the others wait (measured
// 1.6-1.9x behind oneDNN that way).
bool FuseChannelGroups(const Geometry& g, double bytes_per_element) {
  if (!g.channels_last) return false;
  const RowPartition p = PartitionRows(g.n * g.s, g.c, bytes_per_element, true);
  return p.row_tasks == 1 && p.groups > 1;
}

// The split passes overlap each channel's rewrite with the read of the next (ForEachSplitChannel)
// up to this much of the call's inputs per channel: the rewrite reads the threads' shares back
// from the last-level cache, which must then hold two channels. Calls alternating in one process,
// overlapped / not: training forwards of 1.9-8.5 MB channels 1.07-1.27x faster; training
// gradients of 3.2-4 MB (dy and x) 1.11-1.20x, of 8.3-8.5 MB 0.96-1.03x, of 12.8-17 MB
// 0.88-0.96x.
constexpr double kOverlapSplitChannelBytes = 9.0 * 1024 * 1024;

// Channels-first channels larger than one task (over 2 MB): one channel at a time, all threads
// reduce its pieces, the calling thread merges them, and each thread rewrites the pieces it
// reduced (the pool's static schedule gives a thread the same pieces in both regions) from its
// L2 or the last-level cache, instead of a second read of the whole tensor from memory. All 36
// such batch 32-128 training passes of the benchmark gained, 1.02-1.36x (128x256x56x56 float
// gradient 75 -> 57 ms); up to 32 MB channels, where the shares still come back from the
// last-level cache. Pieces and merges are those of the separate passes: same results.
bool FuseSplitChannels(const Geometry& g, double bytes_per_element) {
  if (g.channels_last) return false;
  const double channel_bytes = static_cast<double>(g.per_channel()) * bytes_per_element;
  return channel_bytes > kChannelTaskBytes && channel_bytes <= kSplitChannelBytes;
}

// Whether a split pass (`bytes_per_element` of input per element) overlaps its channels.
bool OverlapSplit(const Geometry& g, size_t es, double bytes_per_element, int threads,
                  InputProbe& probe) {
  const double channel_bytes = static_cast<double>(g.per_channel()) * bytes_per_element;
  return channel_bytes <= kOverlapSplitChannelBytes &&
         ReadsFromDram(g, es, bytes_per_element, threads, probe);
}

// The FuseSplitChannels loop: per channel c, reduce(c, piece, v0, v1) for every piece in one
// parallel region, finish(c) on the calling thread, then rewrite(f0, f1) over the flat ranges of
// the channel. In the rewrite each thread takes the block of pieces the reduction region's static
// schedule gave it, last piece first: the pieces it read last, the ones its cache still holds
// when a thread's share exceeds it, are rewritten before the older ones are fetched again.
// With `overlap` (inputs from DRAM), the rewrite of channel c prefetches the same pieces of
// channel c + 1 from in0 (and in1 if not null), as RewriteChunk does for the next chunk: the thread
// reduces those pieces next.
template <typename Reduce, typename Finish, typename Rewrite>
void ForEachSplitChannel(const Geometry& g, const RunPartition& p, int threads, bool overlap,
                         size_t es, const void* in0, const void* in1, Reduce&& reduce,
                         Finish&& finish, Rewrite&& rewrite) {
  const int64_t M = g.per_channel();
  const int64_t blocks = std::min<int64_t>(threads, p.pieces);
  for (int64_t c = 0; c < g.c; ++c) {
    threading::ParallelFor(p.pieces, threads, [&](int64_t piece) {
      reduce(c, piece, p.begin(piece), p.end(piece, M));
    });
    finish(c);
    const bool ahead = overlap && c + 1 < g.c;
    const auto rewrite_range = [&](int64_t f0, int64_t f1) {
      if (!ahead) return rewrite(f0, f1);
      RewritePrefetching(f0, f1, f0 + g.s, f1 + g.s, es, in0, in1, rewrite);
    };
    threading::ParallelFor(blocks, threads, [&](int64_t b) {
      const int64_t t0 = p.pieces * b / blocks, t1 = p.pieces * (b + 1) / blocks;
      for (int64_t piece = t1 - 1; piece >= t0; --piece) {
        ForEachPieceRange(g, c, p.begin(piece), p.end(piece, M), rewrite_range);
      }
    });
  }
}

void ForwardTrainingSplit(DataType dtype, const Geometry& g, const void* x, const void* scale,
                          const void* offset, double eps, double* mean, double* variance,
                          void* k_mean, void* k_a, void* k_b, void* y, int threads, bool stream,
                          bool overlap) {
  const KernelEntry& e = Entry(dtype);
  const bool wide = dtype == DataType::kFloat64;
  const size_t es = ElemBytes(dtype);
  const int64_t C = g.c, M = g.per_channel();
  const RunPartition p = PartitionRuns(C, M, static_cast<double>(es));
  double* partial = Scratch(2 * static_cast<size_t>(p.pieces));
  const double* w = PieceWeights(p, M);
  ForEachSplitChannel(
      g, p, threads, overlap, es, x, nullptr,
      [&](int64_t c, int64_t piece, int64_t v0, int64_t v1) {
        e.stats_run(Offset(x, c * g.s, es), C * g.s, g.s, v0, v1, &partial[2 * piece],
                    &partial[2 * piece + 1]);
      },
      [&](int64_t c) {
        MergePieceStats(p, M, w, partial, &mean[c], &variance[c]);
        FixNonFiniteMean(dtype, g, x, c, &mean[c]);
        ForwardCoefficients(wide, c, c + 1, mean, variance, scale, offset, eps, k_mean, k_a, k_b);
      },
      [&](int64_t f0, int64_t f1) {
        e.apply_flat(x, C, g.s, f0, f1, k_mean, k_a, k_b, y, stream);
      });
}

void BackwardTrainingSplit(DataType dtype, const Geometry& g, const void* dy, const void* x,
                           const void* k_mean, const double* inv, const void* k1, void* k2,
                           void* k0, double* sum_dy, double* sum_dy_xc, void* dx, int threads,
                           bool stream, bool overlap) {
  const KernelEntry& e = Entry(dtype);
  const bool wide = dtype == DataType::kFloat64;
  const size_t es = ElemBytes(dtype);
  const int64_t C = g.c, M = g.per_channel();
  const RunPartition p = PartitionRuns(C, M, 2.0 * static_cast<double>(es));
  double* partial = Scratch(2 * static_cast<size_t>(p.pieces));
  ForEachSplitChannel(
      g, p, threads, overlap, es, dy, x,
      [&](int64_t c, int64_t piece, int64_t v0, int64_t v1) {
        e.reduce_run(dy, x, c * g.s, C * g.s, g.s, v0, v1, k_mean, c, &partial[2 * piece],
                     &partial[2 * piece + 1], nullptr, nullptr, false);
      },
      [&](int64_t c) {
        MergePieceSums(p, partial, &sum_dy[c], &sum_dy_xc[c]);
        BackwardCoefficients(wide, c, c + 1, static_cast<double>(M), sum_dy, sum_dy_xc, inv, k1, k2,
                             k0);
      },
      [&](int64_t f0, int64_t f1) {
        e.backward_apply_flat(dy, x, C, g.s, f0, f1, k_mean, k1, k2, k0, dx, stream);
      });
}

void ForwardTrainingGroups(DataType dtype, const Geometry& g, const void* x, const void* scale,
                           const void* offset, double eps, double* mean, double* variance,
                           void* k_mean, void* k_a, void* k_b, void* y, ChannelStep finish) {
  const KernelEntry& e = Entry(dtype);
  const bool wide = dtype == DataType::kFloat64;
  const size_t es = ElemBytes(dtype);
  InputProbe probe(g, es, x);
  const int threads = CallThreads(g, es, 2, probe);
  const bool stream = StreamStores(g, es, 2, threads, kProbeBytes, probe);
  const int64_t C = g.c, rows = g.n * g.s;
  const RowPartition p = PartitionRows(rows, C, static_cast<double>(es), true);
  const RowRead read = RowReadOf(g, es, 2, true, threads);
  const RowRead apply_read = ApplyRead(g, es, threads, stream, probe);
  // One row range: the groups share one slot of partials (their channels are disjoint).
  const size_t slot = static_cast<size_t>(5 * C);
  double* partial = Scratch(slot);
  // On one thread (the tuning's choice), rows of a page or more are one group: whole rows then
  // take the apply's row-order tiles instead of strips, whose lines down such rows share a few
  // L1 sets (Zen 4, one thread, batch-1 7x7x2048 float 37 -> 28 us). Narrower rows keep their
  // groups (7x7x512 5.3 us as groups, 6.2 as one). Statistics are per channel: same results.
  const bool whole_rows = threads == 1 && C * static_cast<int64_t>(es) >= kPageBytes;
  const int64_t groups = whole_rows ? 1 : p.groups, width = whole_rows ? C : p.width;
  threading::ParallelFor(groups, threads, [&](int64_t t) {
    const int64_t c0 = t * width, c1 = std::min(C, c0 + width);
    e.stats_rows(x, C, c0, c1, 0, rows, partial, partial + C, partial + 2 * C, read);
    MergeRowPartials(dtype, g, x, p, rows, C, partial, slot, c0, c1, mean, variance);
    ForwardCoefficients(wide, c0, c1, mean, variance, scale, offset, eps, k_mean, k_a, k_b);
    finish(c0, c1);
    e.apply_rows(x, C, c0, c1, 0, rows, k_mean, k_a, k_b, y, stream, apply_read);
  });
}

}  // namespace

void ForwardTraining(DataType dtype, const Geometry& g, const void* x, const void* scale,
                     const void* offset, double eps, double* mean, double* variance, void* k_mean,
                     void* k_a, void* k_b, void* y, ChannelStep finish) {
  const CallTuning tuning(CallTuning::Entry::kForwardTraining, dtype, g);
  const bool wide = dtype == DataType::kFloat64;
  const size_t es = ElemBytes(dtype);
  if (const Swap how = SwapOf(g, es); how != Swap::kNo) {
    const SwappedCall call(how, dtype, g);
    void* out = call.Out(y);
    ForwardTraining(dtype, call.geometry(), call.In(x, 0), scale, offset, eps, mean, variance,
                    k_mean, k_a, k_b, out, finish);
    return call.Finish(out, y);
  }
  if (FuseChannelGroups(g, static_cast<double>(es))) {
    ForwardTrainingGroups(dtype, g, x, scale, offset, eps, mean, variance, k_mean, k_a, k_b, y,
                          finish);
    return;
  }
  const KernelEntry& e = Entry(dtype);
  InputProbe probe(g, es, x);
  const int threads = CallThreads(g, es, 2, probe);
  const bool by_image = StatsByImage(g, es);
  const bool fused = FusePerChannel(g, static_cast<double>(es)) && !by_image;
  // Decided before the statistics read x.
  const bool stream =
      StreamStores(g, es, 2, threads, kProbeBytes, probe, (fused || by_image) && StreamLines(e));
  if (!fused && !by_image && FuseSplitChannels(g, static_cast<double>(es))) {
    ForwardTrainingSplit(dtype, g, x, scale, offset, eps, mean, variance, k_mean, k_a, k_b, y,
                         threads, stream,
                         OverlapSplit(g, es, static_cast<double>(es), threads, probe));
    finish(0, g.c);
    return;
  }
  if (!fused) {
    const RowRead apply_read = ApplyRead(g, es, threads, stream, probe);
    ComputeStatsWith(dtype, g, x, CallThreads(g, es, 1, probe), probe, mean, variance);
    ForwardCoefficients(wide, 0, g.c, mean, variance, scale, offset, eps, k_mean, k_a, k_b);
    ApplyWith(dtype, g, x, k_mean, k_a, k_b, y, threads, stream, apply_read);
    finish(0, g.c);
    return;
  }
  const int64_t C = g.c, M = g.per_channel();
  const RunPartition p = PartitionRuns(C, M, static_cast<double>(es));
  // Each task is whole channels (p.pieces == 1), taken in chunks (FusedChunk): statistics of a
  // chunk's channels, their coefficients in one vector call, then the rewrite while the chunk's
  // data is still in cache.
  const int64_t chunk = FusedChunk(g, p.group, static_cast<double>(es), probe);
  const bool overlap = ReadsFromDram(g, es, static_cast<double>(es), threads, probe);
  threading::ParallelFor(p.tasks, threads, [&](int64_t t) {
    const int64_t t0 = t * p.group, t1 = std::min(C, t0 + p.group);
    for (int64_t c0 = t0; c0 < t1; c0 += chunk) {
      const int64_t c1 = std::min(t1, c0 + chunk);
      e.stats_runs(x, C, g.s, g.n, c0, c1, mean, variance);  // M2 into variance, then divided
      for (int64_t c = c0; c < c1; ++c) {
        variance[c] /= static_cast<double>(M);
        FixNonFiniteMean(dtype, g, x, c, &mean[c]);
      }
      ForwardCoefficients(wide, c0, c1, mean, variance, scale, offset, eps, k_mean, k_a, k_b);
      RewriteChunk(g, c0, c1, std::min(C, c1 + chunk), overlap, es, x, nullptr,
                   [&](int64_t f0, int64_t f1) {
                     e.apply_flat(x, C, g.s, f0, f1, k_mean, k_a, k_b, y, stream);
                   });
    }
    finish(t0, t1);  // per task: chunks can be single channels
  });
}

void BackwardTraining(DataType dtype, const Geometry& g, const void* dy, const void* x,
                      const void* k_mean, const double* inv, const void* k1, void* k2, void* k0,
                      double* sum_dy, double* sum_dy_xc, void* dx, ChannelStep prepare,
                      ChannelStep finish) {
  const CallTuning tuning(CallTuning::Entry::kBackwardTraining, dtype, g);
  const bool wide = dtype == DataType::kFloat64;
  const size_t es = ElemBytes(dtype);
  if (const Swap how = SwapOf(g, es); how != Swap::kNo) {
    const SwappedCall call(how, dtype, g);
    void* out = call.Out(dx);
    BackwardTraining(dtype, call.geometry(), call.In(dy, 0), call.In(x, 1), k_mean, inv, k1, k2, k0,
                     sum_dy, sum_dy_xc, out, prepare, finish);
    return call.Finish(out, dx);
  }
  const double n = static_cast<double>(g.per_channel());
  if (FuseChannelGroups(g, 2.0 * static_cast<double>(es))) {
    // As ForwardTrainingGroups: each channel group's sums are final within its task.
    const KernelEntry& e = Entry(dtype);
    InputProbe probe(g, es, dy);
    const int threads = CallThreads(g, es, 3, probe);
    const bool stream = StreamStores(g, es, 3, threads, kProbeBytes, probe, false, true);
    const int64_t C = g.c, rows = g.n * g.s;
    const RowPartition p = PartitionRows(rows, C, 2.0 * static_cast<double>(es), true);
    const RowRead read = RowReadOf(g, es, 3, true, threads);
    double* tmp = Scratch(2 * static_cast<size_t>(C));
    threading::ParallelFor(p.groups, threads, [&](int64_t t) {
      const int64_t c0 = t * p.width, c1 = std::min(C, c0 + p.width);
      prepare(c0, c1);
      e.reduce_rows(dy, x, C, c0, c1, 0, rows, rows, k_mean, sum_dy, sum_dy_xc, nullptr, nullptr,
                    tmp, false, read);
      BackwardCoefficients(wide, c0, c1, n, sum_dy, sum_dy_xc, inv, k1, k2, k0);
      finish(c0, c1);
      e.backward_apply_rows(dy, x, C, c0, c1, 0, rows, k_mean, k1, k2, k0, dx, stream);
    });
    return;
  }
  const KernelEntry& e = Entry(dtype);
  InputProbe probe(g, es, dy);
  const int threads = CallThreads(g, es, 3, probe);
  const bool by_image = TrainingSumsByImage(g, es);
  const bool fused = FusePerChannel(g, 2.0 * static_cast<double>(es)) && !by_image;
  // Decided before the sums read dy.
  const bool stream = StreamStores(g, es, 3, threads, kProbeBytes, probe,
                                   (fused || by_image) && StreamLines(e), true);
  if (!fused) prepare(0, g.c);
  if (!fused && !by_image && FuseSplitChannels(g, 2.0 * static_cast<double>(es))) {
    BackwardTrainingSplit(dtype, g, dy, x, k_mean, inv, k1, k2, k0, sum_dy, sum_dy_xc, dx, threads,
                          stream,
                          OverlapSplit(g, es, 2.0 * static_cast<double>(es), threads, probe));
    finish(0, g.c);
    return;
  }
  if (!fused) {
    const int sum_threads = CallThreads(g, es, 2, probe);
    ReduceImpl(dtype, g, dy, x, k_mean, nullptr, nullptr, sum_threads, false,
               ReductionRead(g, es, false, sum_threads, probe), sum_dy, sum_dy_xc);
    BackwardCoefficients(wide, 0, g.c, n, sum_dy, sum_dy_xc, inv, k1, k2, k0);
    BackwardApplyWith(dtype, g, dy, x, k_mean, k1, k2, k0, dx, threads, stream);
    finish(0, g.c);
    return;
  }
  const int64_t C = g.c, M = g.per_channel();
  const RunPartition p = PartitionRuns(C, M, 2.0 * static_cast<double>(es));
  const int64_t chunk = FusedChunk(g, p.group, 2.0 * static_cast<double>(es), probe);
  const bool overlap = ReadsFromDram(g, es, 2.0 * static_cast<double>(es), threads, probe);
  threading::ParallelFor(p.tasks, threads, [&](int64_t t) {
    const int64_t t0 = t * p.group, t1 = std::min(C, t0 + p.group);
    prepare(t0, t1);  // per task: chunks can be single channels
    for (int64_t c0 = t0; c0 < t1; c0 += chunk) {
      const int64_t c1 = std::min(t1, c0 + chunk);
      e.reduce_runs(dy, x, C, g.s, g.n, c0, c1, k_mean, sum_dy, sum_dy_xc, nullptr, nullptr, false);
      BackwardCoefficients(wide, c0, c1, n, sum_dy, sum_dy_xc, inv, k1, k2, k0);
      RewriteChunk(g, c0, c1, std::min(C, c1 + chunk), overlap, es, dy, x,
                   [&](int64_t f0, int64_t f1) {
                     e.backward_apply_flat(dy, x, C, g.s, f0, f1, k_mean, k1, k2, k0, dx, stream);
                   });
    }
    finish(t0, t1);
  });
}

}  // namespace fbn::kernels
