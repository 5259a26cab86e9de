// Internal kernel layer: the four batch-norm kernel families over a canonical (N, C, S) geometry,
// with threading and deterministic reductions. Inputs are already validated by the op layer.
//
// Families: stats (per-channel mean and centred sum of squares), apply (y = (x - m)·a + b),
// backward reduce (Σdy, Σdy·(x - m)), backward apply (dx = k1·dy + k2·(x - m) + k0), and the
// frozen backward that does reduce and apply in one sweep.
//
// Determinism: each reduction is split into tasks fixed by the geometry and element type alone;
// every task reduces its own range (two-pass within cache-sized blocks, blocks merged with Chan's
// formula in double), and the tasks' partials are merged in task order. The thread count decides
// only which thread runs a task, so results are bit-identical for any thread count.
#ifndef FBN_KERNELS_BATCH_NORM_KERNELS_H_
#define FBN_KERNELS_BATCH_NORM_KERNELS_H_

#include <cstdint>

#include "fbn/types.h"

namespace fbn::kernels {

struct Geometry {
  bool channels_last = true;
  int64_t n = 0;  // batch
  int64_t c = 0;  // channels
  int64_t s = 0;  // spatial elements per (batch, channel): D·H·W
  int64_t per_channel() const { return n * s; }
  int64_t elements() const { return n * c * s; }
};

// A step of the op on a range of channels [c0, c1), run by the thread that owns those channels in
// a training pass: in the task that reduces them where the pass splits by channels (channels-last
// groups, channels-first tasks), else once for all channels on the calling thread. Every channel
// is covered once. The op's per-channel inputs and outputs (inverse std before, output statistics
// after) then stay in that thread's cache: on batch-1 1x7x7x2048 float the calling thread reading
// the workers' 16 KB of statistics took 10 of a 30 us training forward.
struct ChannelStep {
  void (*fn)(void* context, int64_t c0, int64_t c1) = nullptr;
  void* context = nullptr;
  void operator()(int64_t c0, int64_t c1) const {
    if (fn != nullptr) fn(context, c0, c1);
  }
};

// A ChannelStep calling f(c0, c1); f must outlive it.
template <typename F>
ChannelStep StepFor(F& f) {
  return {[](void* context, int64_t c0, int64_t c1) { (*static_cast<F*>(context))(c0, c1); }, &f};
}

// Per-channel statistics of x: mean and biased variance (M2 / count), in double.
void ComputeStats(DataType dtype, const Geometry& g, const void* x, double* mean, double* variance);

// Training forward: statistics, then y = (x - mean)·a + offset with a = scale / sqrt(var + eps).
// Channels-first channels small enough for one reduction task are normalized right after their
// statistics, while still in cache (one DRAM read instead of two); larger ones up to 32 MB one at
// a time by all threads, each rewriting the pieces it reduced. scale/offset and the scratch
// arrays k_mean/k_a/k_b (C each, filled here) are of the accumulation type, as for Apply.
// `finish` runs on every channel range once its mean and variance are final.
void ForwardTraining(DataType dtype, const Geometry& g, const void* x, const void* scale,
                     const void* offset, double eps, double* mean, double* variance, void* k_mean,
                     void* k_a, void* k_b, void* y, ChannelStep finish = {});

// Training backward with saved statistics: sums, then dx = k1·dy + k2·(x - m) + k0 where
// k1 = scale·inv (given), k0 = -k1·Σdy/n, k2 = -k1·inv²·Σdy(x - m)/n (filled here). Fused per
// channel for channels-first tensors, like ForwardTraining. Both give the results of the separate
// passes (ComputeStats and Apply, BackwardReduce and BackwardApply) bit for bit, except on
// channels-last tensors of at most 256 rows and 128 or more channels, whose fused reductions take
// channel groups over all rows (the separate ones row ranges: equal to rounding). `prepare` runs
// on every channel range before k_mean, inv and k1 of those channels are read (it may fill them);
// `finish` once their sums are final.
void BackwardTraining(DataType dtype, const Geometry& g, const void* dy, const void* x,
                      const void* k_mean, const double* inv, const void* k1, void* k2, void* k0,
                      double* sum_dy, double* sum_dy_xc, void* dx, ChannelStep prepare = {},
                      ChannelStep finish = {});

// y = (x - mean[c]) * a[c] + b[c]. `mean`, `a`, `b` are float arrays for 16-bit and float x, double
// arrays for double x.
void Apply(DataType dtype, const Geometry& g, const void* x, const void* mean, const void* a,
           const void* b, void* y);

// sum_dy[c] = Σ dy, sum_dy_xc[c] = Σ dy·(x - mean[c]) (mean typed as for Apply).
void BackwardReduce(DataType dtype, const Geometry& g, const void* dy, const void* x,
                    const void* mean, double* sum_dy, double* sum_dy_xc);

// dx = k1[c]·dy + k2[c]·(x - mean[c]) + k0[c] (arrays typed as for Apply).
void BackwardApply(DataType dtype, const Geometry& g, const void* dy, const void* x,
                   const void* mean, const void* k1, const void* k2, const void* k0, void* dx);

// Frozen-statistics backward in one sweep: dx = k1[c]·dy while reducing Σdy and Σdy·(x - mean[c]).
// `prepare` and `finish` as for BackwardTraining.
void FrozenBackward(DataType dtype, const Geometry& g, const void* dy, const void* x,
                    const void* mean, const void* k1, void* dx, double* sum_dy, double* sum_dy_xc,
                    ChannelStep prepare = {}, ChannelStep finish = {});

}  // namespace fbn::kernels

#endif  // FBN_KERNELS_BATCH_NORM_KERNELS_H_
