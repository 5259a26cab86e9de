// The layer's general (non-fused) path: tf.nn.moments + tf.nn.batch_normalization over any set of
// axes, with ghost batches (strided virtual batches), batch renormalization and `adjustment`, and
// its backward pass. Internal to fbn.
#ifndef FBN_LAYER_GENERAL_PATH_H_
#define FBN_LAYER_GENERAL_PATH_H_

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "fbn/types.h"

namespace fbn::layer_impl {

// Where each element of an input goes: its parameter index p (flattened over the axis dims, in
// order) and its statistics slot group * P + p, where group = n % G for batch index n (the
// strided virtual batches of TensorFlow's [vbs, N/vbs, ...] reshape; G = 1 without them).
class Geometry {
 public:
  Geometry() = default;
  // `axes`: sorted, distinct, non-negative. `groups` >= 1 divides shape.dim(0) (or is 0 for an
  // empty batch).
  Geometry(const Shape& shape, const std::vector<int>& axes, int64_t groups);

  int64_t num_elements() const { return n_; }
  int64_t params() const { return params_; }
  int64_t groups() const { return groups_; }
  int64_t slots() const { return params_ * groups_; }
  // Elements per slot (0 for an empty input).
  int64_t count() const { return slots() > 0 ? n_ / slots() : 0; }

  // Calls f(offset, len, p0, pstep, group) for consecutive runs covering the input in memory
  // order: elements offset..offset+len-1 have parameter index p0 + j * pstep (pstep is 0 or 1).
  template <typename F>
  void ForEachRun(F&& f) const;

 private:
  int64_t n_ = 0;
  int64_t params_ = 1;
  int64_t groups_ = 1;
  int64_t batch_ = 1;
  int64_t pstride0_ = 0;
  std::vector<int64_t> block_size_;     // collapsed dims 1..rank-1
  std::vector<int64_t> block_pstride_;  // parameter stride of each block (0: reduced)
  std::vector<bool> block_is_axis_;
};

template <typename F>
void Geometry::ForEachRun(F&& f) const {
  if (n_ == 0) return;
  const size_t nb = block_size_.size();
  const int64_t run = nb ? block_size_[nb - 1] : 1;
  const int64_t pstep = nb ? (block_is_axis_[nb - 1] ? 1 : 0) : 0;
  std::vector<int64_t> idx(nb, 0);
  int64_t offset = 0;
  for (int64_t b = 0; b < batch_; ++b) {
    const int64_t group = groups_ > 1 ? b % groups_ : 0;
    const int64_t pbase = b * pstride0_;
    if (nb == 0) {
      f(offset, int64_t{1}, pbase, int64_t{0}, group);
      ++offset;
      continue;
    }
    std::fill(idx.begin(), idx.end(), 0);
    while (true) {
      int64_t p0 = pbase;
      for (size_t k = 0; k + 1 < nb; ++k) p0 += idx[k] * block_pstride_[k];
      f(offset, run, p0, pstep, group);
      offset += run;
      // Advance the odometer over the outer blocks.
      size_t k = nb - 1;
      bool done = true;
      while (k > 0) {
        --k;
        if (++idx[k] < block_size_[k]) {
          done = false;
          break;
        }
        idx[k] = 0;
      }
      if (done) break;
    }
  }
}

// Parameters of a general-path forward call, in the compute type T (float for 16-bit and float
// layers, double for double). Pointers are to P-element arrays unless noted; null when absent.
template <typename T>
struct GeneralParams {
  const T* gamma = nullptr;
  const T* beta = nullptr;
  const T* moving_mean = nullptr;
  const T* moving_variance = nullptr;
  const T* adj_scale = nullptr;  // N elements (broadcast to the input), training only
  const T* adj_bias = nullptr;   // N elements
  bool renorm = false;
  const T* renorm_mean = nullptr;
  const T* renorm_stddev = nullptr;
  std::optional<double> rmax, rmin, dmax;
  double epsilon = 1e-3;
};

template <typename T>
struct GeneralOutputs {
  std::vector<T> y;                  // N elements
  std::vector<T> mean, variance;     // per slot (batch statistics; training only)
  std::vector<T> new_mean, new_var;  // per parameter: the means over the groups
  std::vector<T> stddev;             // per parameter, renorm: sqrt(new_var + eps)
  std::vector<T> r, d;               // per parameter, renorm (1 and 0 otherwise)
};

// Cross-process statistics of a synchronized layer: each call merges this process's per-slot
// partials with the other processes' and returns the global values (identical on every process).
class StatsSync {
 public:
  virtual ~StatsSync() = default;
  // In: the elements per slot here, and per slot the mean and the centred sum of squares (M2) of
  // this process's elements. Out: the global mean and M2, and the global elements per slot.
  virtual void MergeMoments(int64_t count, std::vector<double>* mean, std::vector<double>* m2,
                            int64_t* total) = 0;
  // In: per slot, this process's sums of g and g·xhat. Out: the global sums and elements per slot.
  virtual void SumGradients(int64_t count, std::vector<double>* sum_g, std::vector<double>* sum_gx,
                            int64_t* total) = 0;
};

// Training (batch statistics) when `batch_stats`, else inference with the moving statistics.
// `sync` (training only; null: this process's batch alone) makes the statistics those of the
// global batch: local two-pass moments around the local mean, merged by `sync`.
template <typename T>
void GeneralForward(const Geometry& g, const T* x, const GeneralParams<T>& p, bool batch_stats,
                    GeneralOutputs<T>* out, StatsSync* sync = nullptr);

// What the backward pass needs from a forward call, in double (values as the forward rounded
// them).
struct GeneralSaved {
  bool batch_stats = false;
  std::vector<double> mean, variance;       // per slot (training) or per parameter (inference)
  std::vector<double> gamma;                // per parameter; empty: 1
  std::vector<double> r, d;                 // per parameter; empty: 1 and 0
  std::vector<double> adj_scale, adj_bias;  // per element; empty: 1 and 0
  double epsilon = 1e-3;
};

// dx (N), dgamma and dbeta (P) for the output gradient dy, in double. With `sync` (a training
// call that was synchronized), dx uses the global sums; dgamma and dbeta stay this process's.
void GeneralBackward(const Geometry& g, const double* x, const double* dy, const GeneralSaved& s,
                     std::vector<double>* dx, std::vector<double>* dgamma,
                     std::vector<double>* dbeta, StatsSync* sync = nullptr);

}  // namespace fbn::layer_impl

#endif  // FBN_LAYER_GENERAL_PATH_H_
