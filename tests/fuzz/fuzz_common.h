// Shared pieces of fbn's libFuzzer harnesses: hostile shapes, dtypes and attributes drawn from the
// fuzzer's bytes, and buffers allocated to exactly the size the declared shape needs, so that
// AddressSanitizer reports any read or write beyond what the caller described.
//
// Every harness checks, besides "no crash, no sanitizer report, no hang":
//   - a tensor with an invalid shape (negative dim, rank above kMaxRank, element count above
//     int64) or an invalid dtype code is rejected;
//   - an op that fails writes nothing (outputs are pre-filled with a canary and compared);
//   - an op never writes its inputs;
//   - the op agrees with its OutputSpec(s) function (same error, or success with exact outputs);
//   - a successful op writes every output byte and gives bit-identical results for another
//     thread count (the second run uses another canary and another SetNumThreads value).
#ifndef FBN_TESTS_FUZZ_FUZZ_COMMON_H_
#define FBN_TESTS_FUZZ_FUZZ_COMMON_H_

#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "fbn/fbn.h"

namespace fbn_fuzz {

// Largest buffer a harness allocates for one tensor; shapes needing more are "too big": their
// OutputSpecs are still checked, but the op itself is not run (there is no memory to describe).
inline constexpr size_t kMaxTensorBytes = size_t{1} << 20;

[[noreturn]] inline void Fail(const char* what, const std::string& detail) {
  std::fprintf(stderr, "fbn fuzz check failed: %s\n  %s\n", what, detail.c_str());
  std::fflush(stderr);
  std::abort();
}

#define FBN_FUZZ_CHECK(cond, detail)                \
  do {                                              \
    if (!(cond)) ::fbn_fuzz::Fail(#cond, (detail)); \
  } while (false)

inline bool ValidDtypeCode(fbn::DataType t) {
  const int v = static_cast<int>(t);
  return v >= 0 && v <= 3;
}

// Bytes of one element; 0 for an invalid code.
inline size_t ElementBytes(fbn::DataType t) { return ValidDtypeCode(t) ? fbn::DataTypeSize(t) : 0; }

// The harness's own view of a shape, computed independently of fbn::Shape::Validate.
enum class ShapeClass {
  kValid,    // fbn must accept the shape itself
  kInvalid,  // fbn must reject it: negative dim, rank above kMaxRank, or a product of its
             // non-zero dims above int64 (even when a zero dim makes it empty)
};

struct ShapeInfo {
  ShapeClass cls = ShapeClass::kValid;
  int64_t elements = 0;         // meaningful when valid
  bool overflow = false;        // the product of its non-zero dims overflows int64
  int64_t nonzero_product = 1;  // product of the non-zero dims, saturated at int64's maximum
};

inline ShapeInfo Classify(const int64_t* dims, int rank) {
  ShapeInfo info;
  if (rank > fbn::Shape::kMaxRank) {
    info.cls = ShapeClass::kInvalid;
    return info;
  }
  bool zero = false;
  __int128 product = 1;
  for (int i = 0; i < rank; ++i) {
    if (dims[i] < 0) {
      info.cls = ShapeClass::kInvalid;
      return info;
    }
    if (dims[i] == 0) {
      zero = true;
      continue;
    }
    product *= dims[i];
    if (product > std::numeric_limits<int64_t>::max()) {
      info.overflow = true;
      product = std::numeric_limits<int64_t>::max();  // saturate, keep scanning for zeros
    }
  }
  info.nonzero_product = static_cast<int64_t>(product);
  if (info.overflow) {
    // Also with a zero dim: fbn's products of dims (element counts, strides, the kernels'
    // geometry) would overflow, so such a shape is "too many elements".
    info.cls = ShapeClass::kInvalid;
  } else if (zero) {
    info.elements = 0;
  } else {
    info.elements = static_cast<int64_t>(product);
  }
  return info;
}

// Dimensions a caller might pass: mostly small, some at the interesting edges.
inline int64_t ConsumeDim(FuzzedDataProvider& fdp) {
  static constexpr int64_t kEdges[] = {0,
                                       1,
                                       2,
                                       3,
                                       -1,
                                       -2,
                                       std::numeric_limits<int64_t>::min(),
                                       std::numeric_limits<int64_t>::max(),
                                       std::numeric_limits<int32_t>::max(),
                                       int64_t{1} << 31,
                                       (int64_t{1} << 32) - 1,
                                       int64_t{1} << 32,
                                       (int64_t{1} << 32) + 1,
                                       int64_t{1} << 40,
                                       int64_t{1} << 62,
                                       3037000500,  // ceil(sqrt(2^63))
                                       65536,
                                       -(int64_t{1} << 40)};
  switch (fdp.ConsumeIntegralInRange<int>(0, 9)) {
    case 0:
    case 1:
    case 2:
    case 3:
    case 4:
      return fdp.ConsumeIntegralInRange<int64_t>(0, 6);
    case 5:
    case 6:
      return fdp.ConsumeIntegralInRange<int64_t>(0, 64);
    case 7:
      return fdp.ConsumeIntegralInRange<int64_t>(0, 4096);
    case 8:
      return fdp.PickValueInArray(kEdges);
    default:
      return fdp.ConsumeIntegral<int64_t>();
  }
}

// A rank: usually `preferred`, sometimes anything from -3 to 12.
inline int ConsumeRank(FuzzedDataProvider& fdp, int preferred) {
  if (fdp.ConsumeIntegralInRange<int>(0, 7) != 0) return preferred;
  return fdp.ConsumeIntegralInRange<int>(-3, 12);
}

inline fbn::DataType ConsumeDtype(FuzzedDataProvider& fdp, fbn::DataType preferred) {
  switch (fdp.ConsumeIntegralInRange<int>(0, 11)) {
    case 0:
      return static_cast<fbn::DataType>(fdp.ConsumeIntegralInRange<int>(0, 3));
    case 1:
      return static_cast<fbn::DataType>(fdp.ConsumeIntegral<int>());  // mostly invalid codes
    default:
      return preferred;
  }
}

inline float ConsumeAttrFloat(FuzzedDataProvider& fdp, float usual) {
  static constexpr float kEdges[] = {0.0f,
                                     -0.0f,
                                     1.0f,
                                     0.5f,
                                     -1.0f,
                                     1e-3f,
                                     1e-5f,
                                     -1e-4f,
                                     2.0f,
                                     std::numeric_limits<float>::denorm_min(),
                                     std::numeric_limits<float>::max(),
                                     -std::numeric_limits<float>::max(),
                                     std::numeric_limits<float>::infinity(),
                                     -std::numeric_limits<float>::infinity(),
                                     std::numeric_limits<float>::quiet_NaN(),
                                     std::numeric_limits<float>::signaling_NaN()};
  switch (fdp.ConsumeIntegralInRange<int>(0, 5)) {
    case 0:
    case 1:
    case 2:
      return usual;
    case 3:
    case 4:
      return fdp.PickValueInArray(kEdges);
    default: {
      const uint32_t bits = fdp.ConsumeIntegral<uint32_t>();
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
  }
}

// A tensor the harness owns. Its buffer holds exactly bytes() bytes (a zero-byte allocation for an
// empty tensor, so any access is reported), unless the shape is invalid or too big, in which case
// a 1-byte dummy is used: fbn must reject the former and is never run on the latter.
class Tensor {
 public:
  Tensor() = default;
  Tensor(fbn::DataType dtype, const int64_t* dims, int rank) { Reset(dtype, dims, rank); }

  void Reset(fbn::DataType dtype, const int64_t* dims, int rank) {
    dtype_ = dtype;
    shape_ = fbn::Shape(dims, rank);  // fbn clamps a negative rank to 0
    declared_rank_ = rank;
    info_ = Classify(dims, rank < 0 ? 0 : rank);
    null_data_ = false;
    bytes_ = 0;
    too_big_ = false;
    if (info_.cls == ShapeClass::kValid) {
      const size_t eb = ElementBytes(dtype) ? ElementBytes(dtype) : 8;
      const uint64_t elements = static_cast<uint64_t>(info_.elements);
      if (elements > kMaxTensorBytes / eb) {
        too_big_ = true;
      } else {
        bytes_ = static_cast<size_t>(elements) * eb;
      }
    }
    mem_.reset(new unsigned char[too_big_ || info_.cls != ShapeClass::kValid ? 1 : bytes_]);
  }

  fbn::DataType dtype() const { return dtype_; }
  const fbn::Shape& shape() const { return shape_; }
  const ShapeInfo& info() const { return info_; }
  // Shape invalid or dtype code invalid: fbn must reject the call if it reads this tensor.
  bool must_reject() const { return info_.cls == ShapeClass::kInvalid || !ValidDtypeCode(dtype_); }
  // A null pointer for a tensor with elements: also a must-reject.
  bool null_with_elements() const {
    return null_data_ && info_.cls == ShapeClass::kValid && info_.elements > 0;
  }
  bool too_big() const { return too_big_; }
  bool runnable() const { return !too_big_ && !must_reject() && !null_data_; }
  size_t bytes() const { return bytes_; }
  unsigned char* data() { return null_data_ ? nullptr : mem_.get(); }
  const unsigned char* data() const { return null_data_ ? nullptr : mem_.get(); }
  void set_null_data(bool v) { null_data_ = v; }

  fbn::ConstTensorView cview() const { return fbn::ConstTensorView{data(), dtype_, shape_}; }
  fbn::TensorView view() { return fbn::TensorView{data(), dtype_, shape_}; }

  // Fills the buffer cyclically with `pattern` (the fuzzer's bytes: NaN, Inf, subnormals...).
  void Fill(const std::vector<uint8_t>& pattern) {
    if (!runnable() || bytes_ == 0) return;
    if (pattern.empty()) {
      std::memset(mem_.get(), 0, bytes_);
      return;
    }
    for (size_t i = 0; i < bytes_; ++i) mem_[i] = pattern[i % pattern.size()];
  }
  void FillByte(unsigned char b) {
    if (runnable() && bytes_) std::memset(mem_.get(), b, bytes_);
  }
  bool AllBytesAre(unsigned char b) const {
    if (!runnable()) return true;
    for (size_t i = 0; i < bytes_; ++i) {
      if (mem_[i] != b) return false;
    }
    return true;
  }
  std::vector<unsigned char> Snapshot() const {
    if (!runnable() || bytes_ == 0) return {};
    return std::vector<unsigned char>(mem_.get(), mem_.get() + bytes_);
  }
  bool Equals(const std::vector<unsigned char>& snap) const {
    if (!runnable() || bytes_ == 0) return snap.empty();
    return snap.size() == bytes_ && std::memcmp(snap.data(), mem_.get(), bytes_) == 0;
  }

 private:
  fbn::DataType dtype_ = fbn::DataType::kFloat32;
  fbn::Shape shape_;
  int declared_rank_ = 0;
  ShapeInfo info_;
  bool null_data_ = false;
  bool too_big_ = false;
  size_t bytes_ = 0;
  std::unique_ptr<unsigned char[]> mem_{new unsigned char[1]};
};

// Consumes a shape of rank ConsumeRank(preferred) with ConsumeDim dims.
inline void ConsumeShape(FuzzedDataProvider& fdp, int preferred_rank, int64_t dims[16], int* rank) {
  *rank = ConsumeRank(fdp, preferred_rank);
  for (int i = 0; i < 16; ++i) dims[i] = 0;
  for (int i = 0; i < *rank && i < 16; ++i) dims[i] = ConsumeDim(fdp);
}

// The per-channel shape: [c] most of the time, a hostile shape otherwise.
inline void ConsumeVectorShape(FuzzedDataProvider& fdp, int64_t c, int64_t dims[16], int* rank) {
  if (fdp.ConsumeIntegralInRange<int>(0, 9) != 0) {
    *rank = 1;
    for (int i = 0; i < 16; ++i) dims[i] = 0;
    dims[0] = c;
    return;
  }
  ConsumeShape(fdp, 1, dims, rank);
}

inline std::string Describe(const fbn::Status& s) { return s.ToString(); }

inline std::string ShapeText(const Tensor& t) {
  return t.shape().DebugString() + " dtype " + std::to_string(static_cast<int>(t.dtype()));
}

// Alternates the thread count between runs so that a second run of the same op goes through
// another partition of threads (results must not change).
inline void UseThreads(int n) { fbn::SetNumThreads(n); }

// Scalar decoding for the harnesses' reference checks.
inline double HalfToDouble(uint16_t h) {
  const int sign = (h >> 15) & 1;
  const int exp = (h >> 10) & 0x1F;
  const int mant = h & 0x3FF;
  double v;
  if (exp == 0x1F) {
    v = mant ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else if (exp == 0) {
    v = std::ldexp(static_cast<double>(mant), -24);
  } else {
    v = std::ldexp(static_cast<double>(mant | 0x400), exp - 25);
  }
  return sign ? -v : v;
}

inline double LoadAsDouble(const void* p, fbn::DataType t, int64_t i) {
  switch (t) {
    case fbn::DataType::kFloat16: {
      uint16_t h;
      std::memcpy(&h, static_cast<const unsigned char*>(p) + 2 * i, 2);
      return HalfToDouble(h);
    }
    case fbn::DataType::kBFloat16: {
      uint16_t h;
      std::memcpy(&h, static_cast<const unsigned char*>(p) + 2 * i, 2);
      const uint32_t u = static_cast<uint32_t>(h) << 16;
      float f;
      std::memcpy(&f, &u, 4);
      return f;
    }
    case fbn::DataType::kFloat32: {
      float f;
      std::memcpy(&f, static_cast<const unsigned char*>(p) + 4 * i, 4);
      return f;
    }
    case fbn::DataType::kFloat64: {
      double d;
      std::memcpy(&d, static_cast<const unsigned char*>(p) + 8 * i, 8);
      return d;
    }
  }
  return 0;
}

// Relative tolerance of a value stored in `t` after computing in double.
inline double Tolerance(fbn::DataType t) {
  switch (t) {
    case fbn::DataType::kFloat16:
      return 2e-3;
    case fbn::DataType::kBFloat16:
      return 1e-2;
    case fbn::DataType::kFloat32:
      return 2e-6;
    case fbn::DataType::kFloat64:
      return 1e-12;
  }
  return 0;
}

// Spacing of the subnormals of `t`: the absolute error of rounding a tiny result.
inline double SubnormalStep(fbn::DataType t) {
  switch (t) {
    case fbn::DataType::kFloat16:
      return 6e-8;
    case fbn::DataType::kBFloat16:
    case fbn::DataType::kFloat32:
      return 1e-38;
    case fbn::DataType::kFloat64:
      return 0;
  }
  return 0;
}

// Largest finite magnitude of `t` (16-bit results beyond it legitimately become Inf).
inline double MaxFinite(fbn::DataType t) {
  return t == fbn::DataType::kFloat16 ? 65504.0 : std::numeric_limits<float>::max();
}

// The same bytes: for copies and echoes of inputs.
inline bool SameBytes(const Tensor& a, const Tensor& b) {
  return a.bytes() == b.bytes() &&
         (a.bytes() == 0 || std::memcmp(a.data(), b.data(), a.bytes()) == 0);
}

// Results of two runs (other thread counts, aliased buffers): the same bits, except that where
// both are NaN the payload and sign may differ. x86 returns the NaN of the first operand, and
// the compiler may order a multiply's operands differently in a kernel's vector body and its
// tail, which fall on other elements for another thread count.
inline bool SameResults(const Tensor& a, const Tensor& b) {
  if (SameBytes(a, b)) return true;
  if (a.dtype() != b.dtype() || a.bytes() != b.bytes() || !ValidDtypeCode(a.dtype())) return false;
  const size_t es = ElementBytes(a.dtype());
  const auto* pa = static_cast<const unsigned char*>(a.data());
  const auto* pb = static_cast<const unsigned char*>(b.data());
  for (size_t i = 0; i < a.bytes() / es; ++i) {
    if (std::memcmp(pa + i * es, pb + i * es, es) == 0) continue;
    const auto k = static_cast<int64_t>(i);
    if (!std::isnan(LoadAsDouble(pa, a.dtype(), k)) ||
        !std::isnan(LoadAsDouble(pb, b.dtype(), k))) {
      return false;
    }
  }
  return true;
}

}  // namespace fbn_fuzz

#endif  // FBN_TESTS_FUZZ_FUZZ_COMMON_H_
