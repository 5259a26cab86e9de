// Shared harness for the C++ benchmark programs (fbn_bench, onednn_bench, copy_bench): case lists,
// aligned buffers, deterministic fills, cache flushing and the parity-file exchange with
// bench/run_bench.py. Nothing here is part of fbn.
#ifndef FBN_BENCH_BENCH_UTIL_H_
#define FBN_BENCH_BENCH_UTIL_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace fbn_bench {

enum class Pass { kFwdTrain, kFwdInfer, kGradTrain, kGradInfer };
enum class Dtype { kF32, kBF16 };
enum class Layout { kNHWC, kNCHW };

const char* PassName(Pass p);      // fwd_train, fwd_infer, grad_train, grad_infer
const char* DtypeName(Dtype d);    // f32, bf16
const char* LayoutName(Layout l);  // nhwc, nchw
bool ParsePass(const std::string& s, Pass* p);
bool ParseDtype(const std::string& s, Dtype* d);
bool ParseLayout(const std::string& s, Layout* l);
inline size_t DtypeSize(Dtype d) { return d == Dtype::kF32 ? 4 : 2; }
inline bool IsTraining(Pass p) { return p == Pass::kFwdTrain || p == Pass::kGradTrain; }
inline bool IsGrad(Pass p) { return p == Pass::kGradTrain || p == Pass::kGradInfer; }

// One timed configuration. The driver writes these one per line:
//   id pass dtype layout N C H W cache reps min_time
// (cache is warm or cold; min_time in seconds per repetition).
struct Case {
  std::string id;
  Pass pass = Pass::kFwdInfer;
  Dtype dtype = Dtype::kF32;
  Layout layout = Layout::kNHWC;
  int64_t n = 1, c = 1, h = 1, w = 1;
  bool cold = false;
  int reps = 3;
  double min_time = 0.05;

  int64_t elements() const { return n * c * h * w; }
  size_t tensor_bytes() const { return static_cast<size_t>(elements()) * DtypeSize(dtype); }
  // Logical NCHW dims permuted into the memory order of `layout`.
  std::vector<int64_t> dims() const;
  std::string BenchmarkName(const char* library) const;
};

// Reads a case file; returns false and sets *error on a malformed line.
bool ReadCases(const std::string& path, std::vector<Case>* cases, std::string* error);

// Takes "--name=value" out of argv (so Google Benchmark does not reject it); returns the value or
// `fallback`.
std::string TakeFlag(int* argc, char** argv, const std::string& name, const std::string& fallback);

// 64-byte aligned, page-touched heap buffer, or a non-owning view of one (View()).
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t bytes);
  static Buffer View(void* data, size_t bytes) {
    Buffer b;
    b.data_ = data;
    b.bytes_ = bytes;
    b.owned_ = false;
    return b;
  }
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();

  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  bool owned_ = true;
};

// The timing runs' input activations (which = 0: x in [-2, 3), 1: dy in [-1, 1)), shared by
// consecutive cases of the same element count and dtype: filling a 400 MB tensor takes longer
// than timing it. The returned view stays valid until a call with another count or dtype. The
// libraries only read their inputs, so sharing does not change what is timed.
Buffer SharedInput(int64_t count, Dtype dtype, int which);

uint16_t FloatToBF16(float f);  // round to nearest even, as TF/oneDNN/PyTorch do
float BF16ToFloat(uint16_t b);

// Deterministic pseudo-random values in [lo, hi) (fast: the fill of a 400 MB tensor must not
// dominate the run); dtype decides whether 4-byte floats or 2-byte bf16 are written.
void FillUniform(void* dst, int64_t count, Dtype dtype, float lo, float hi, uint64_t seed);

// Evicts [ptr, ptr+bytes) from every cache level (clflush), then fences. Used for the cold runs:
// only the operands are flushed; library-internal scratch is not.
void FlushFromCache(const void* ptr, size_t bytes);

// Raw files for the parity check (little-endian, no header).
bool ReadFile(const std::string& path, void* dst, size_t bytes);
bool WriteFile(const std::string& path, const void* src, size_t bytes);
// Writes `count` elements of `dtype` data as float32.
bool WriteAsF32(const std::string& path, const void* src, int64_t count, Dtype dtype);

// Median of per-call times (reorders *v). The programs report the median call of each
// repetition: on a 2-core machine shared with other work, one preempted call must not decide a
// repetition's value, as it would with Google Benchmark's per-repetition mean.
double MedianOf(std::vector<double>* v);

// "L2=2048K L3=266240K" from sysfs, and the CPU model name from /proc/cpuinfo.
std::string CacheSizesString();
std::string CpuModelName();

}  // namespace fbn_bench

#endif  // FBN_BENCH_BENCH_UTIL_H_
