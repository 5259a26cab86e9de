// The per-target kernel bodies, as one table per SIMD target (built in batch_norm_kernels.cc and
// chosen at run time by Highway's dynamic dispatch). Each entry serves one storage type; the
// per-channel arrays (mean, a, b, k*) are of that type's accumulation type.
#ifndef FBN_KERNELS_KERNEL_TABLE_H_
#define FBN_KERNELS_KERNEL_TABLE_H_

#include <cstdint>

namespace fbn::kernels {

// Channels-last rows a whole number of pages apart map a strip's lines down the rows to the
// same few L1 sets; the kernels and the driver's read and partition rules both test for it.
constexpr int64_t kPageBytes = 4096;

// Channels-last gradient sums of rows up to this many channels gained nothing from reading ahead
// or in row order; the driver's read rule and ReduceRows both test for it.
constexpr int64_t kNarrowSumChannels = 128;

// Where a channels-last kernel's rows come from, decided by the driver from the tensor's size
// (and, for kFlushed, from the cache probe).
enum class RowRead : uint8_t {
  kL2,        // the call's tensors fit the threads' L2 caches
  kL3,        // larger: from the last-level cache, or beyond it
  kDram,      // larger than the last-level cache keeps: rows come from DRAM
  kPrefetch,  // from DRAM, and software prefetches of the next block help
  kFlushed,   // rows not in cache although they could be (the probe), or, for statistics, from
              // DRAM beyond the L3. reduce_rows: kL3's strips with kPrefetch's prefetches (sums
              // alone of rows over kNarrowSumChannels: rows in order); stats_rows: kL3's
              // blocks, the first pass in row order; apply_rows storing regularly: row order
};

struct KernelEntry {
  // Channels-last kernels work on rows [r0, r1) and channels [c0, c1) of rows of C channels;
  // their per-channel arrays are indexed by channel.
  // Statistics: per-channel mean and M2 of the range. tmp: 3·C accumulators of scratch.
  // `read`: where x comes from (RowRead).
  void (*stats_rows)(const void* x, int64_t C, int64_t c0, int64_t c1, int64_t r0, int64_t r1,
                     double* mean, double* m2, void* tmp, RowRead read);
  // The statistics in two sweeps of the range: mean_rows writes bm (accumulation type, indexed by
  // channel) = K + Σ(x - K)/n with K row r0 (with kFlushed reading rows in order, the same
  // values); deviation_rows writes s1 = Σ(x - m) and s2 = Σ(x - m)² about m (accumulation type).
  // tmp: 2·C accumulators of scratch.
  void (*mean_rows)(const void* x, int64_t C, int64_t c0, int64_t c1, int64_t r0, int64_t r1,
                    void* bm, void* tmp, RowRead read);
  void (*deviation_rows)(const void* x, int64_t C, int64_t c0, int64_t c1, int64_t r0, int64_t r1,
                         const void* m, double* s1, double* s2, void* tmp);
  // Channels-first statistics of elements [v0, v1) of one channel laid out as planes of S.
  void (*stats_run)(const void* base, int64_t plane_stride, int64_t S, int64_t v0, int64_t v1,
                    double* mean, double* m2);
  // The same for whole channels [c0, c1) of an images x C x S tensor (mean and m2 indexed by
  // channel): several channels at a time where they are short.
  void (*stats_runs)(const void* x, int64_t C, int64_t S, int64_t images, int64_t c0, int64_t c1,
                     double* mean, double* m2);
  // Statistics of channels [c0, c1) over images [n0, n1) of an images x C x S tensor, read in
  // memory order (one block per plane, merged image by image).
  void (*stats_images)(const void* x, int64_t C, int64_t S, int64_t c0, int64_t c1, int64_t n0,
                       int64_t n1, double* mean, double* m2);
  // Element-wise writers take `stream`: bypass the cache for outputs larger than it.
  void (*apply_rows)(const void* x, int64_t C, int64_t c0, int64_t c1, int64_t r0, int64_t r1,
                     const void* mean, const void* a, const void* b, void* y, bool stream,
                     RowRead read);
  void (*apply_flat)(const void* x, int64_t C, int64_t S, int64_t f0, int64_t f1, const void* mean,
                     const void* a, const void* b, void* y, bool stream);
  // Σdy and Σdy·(x - m) over rows [r0, r1); with k1 non-null also dx = k1·dy. tmp: 2·C
  // accumulators of scratch. `read` as for stats_rows; with kPrefetch and kFlushed the last block
  // prefetches the next one up to `rows`, the tensor's: a task's last block fetches the next
  // task's first.
  void (*reduce_rows)(const void* dy, const void* x, int64_t C, int64_t c0, int64_t c1, int64_t r0,
                      int64_t r1, int64_t rows, const void* mean, double* sum_dy, double* sum_dy_xc,
                      const void* k1, void* dx, void* tmp, bool stream, RowRead read);
  void (*reduce_run)(const void* dy, const void* x, int64_t base, int64_t plane_stride, int64_t S,
                     int64_t v0, int64_t v1, const void* mean, int64_t c, double* sum_dy,
                     double* sum_dy_xc, const void* k1, void* dx, bool stream);
  // Σdy and Σdy·(x - m) of whole channels [c0, c1) of an images x C x S tensor, as reduce_run
  // per channel gives them (with k1 non-null also dx = k1·dy).
  void (*reduce_runs)(const void* dy, const void* x, int64_t C, int64_t S, int64_t images,
                      int64_t c0, int64_t c1, const void* mean, double* sum_dy, double* sum_dy_xc,
                      const void* k1, void* dx, bool stream);
  // The same for channels [c0, c1) over images [n0, n1), read in memory order: per channel the
  // per-plane sums of reduce_runs, added in image order.
  void (*reduce_images)(const void* dy, const void* x, int64_t C, int64_t S, int64_t c0, int64_t c1,
                        int64_t n0, int64_t n1, const void* mean, double* sum_dy, double* sum_dy_xc,
                        const void* k1, void* dx, bool stream);
  void (*backward_apply_rows)(const void* dy, const void* x, int64_t C, int64_t c0, int64_t c1,
                              int64_t r0, int64_t r1, const void* mean, const void* k1,
                              const void* k2, const void* k0, void* dx, bool stream);
  void (*backward_apply_flat)(const void* dy, const void* x, int64_t C, int64_t S, int64_t f0,
                              int64_t f1, const void* mean, const void* k1, const void* k2,
                              const void* k0, void* dx, bool stream);
  // Per image, dst[j·rows + i] = src[i·cols + j]: the (rows x cols) planes of `images` images
  // transposed (a call whose inner dimension is short runs on copies in the other layout).
  void (*transpose)(const void* src, void* dst, int64_t images, int64_t rows, int64_t cols);
  // Bytes of one streaming store of the channels-first writers, which stream only from aligned
  // starts (0 where they never stream).
  int64_t stream_unit_bytes = 0;
};

struct KernelTable {
  KernelEntry entries[4];  // indexed by fbn::DataType
  const char* target_name = "";
};

// The table of the best target this CPU supports.
const KernelTable& ActiveKernels();

}  // namespace fbn::kernels

#endif  // FBN_KERNELS_KERNEL_TABLE_H_
