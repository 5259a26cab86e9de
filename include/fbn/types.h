// Plain data types of the public API: element types, tensor formats, shapes and non-owning views.
#ifndef FBN_TYPES_H_
#define FBN_TYPES_H_

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>

#include "fbn/export.h"
#include "fbn/status.h"

namespace fbn {

enum class DataType : int {
  kFloat16 = 0,   // IEEE binary16 ("half")
  kBFloat16 = 1,  // bfloat16, stored as its upper 16 bits of a float32
  kFloat32 = 2,
  kFloat64 = 3,
};

FBN_API size_t DataTypeSize(DataType type);
// TensorFlow's spelling: "half", "bfloat16", "float", "double".
FBN_API const char* DataTypeName(DataType type);

// Where the channel dimension lives. 2-D names (NHWC/NCHW) go with rank-4 tensors and 3-D names
// (NDHWC/NCDHW) with rank-5 ones in TensorFlow's graph shape functions; the kernels themselves
// treat NHWC and NDHWC alike (channels last), and NCHW and NCDHW alike (channels first).
enum class TensorFormat : int { kNHWC = 0, kNCHW = 1, kNDHWC = 2, kNCDHW = 3 };

FBN_API const char* TensorFormatName(TensorFormat format);
inline bool IsChannelsLast(TensorFormat f) {
  return f == TensorFormat::kNHWC || f == TensorFormat::kNDHWC;
}

// A dense, row-major shape of rank 0 to kMaxRank.
class FBN_API Shape {
 public:
  static constexpr int kMaxRank = 8;

  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  // Copies `rank` dims; a rank above kMaxRank is clamped (Validate() reports it).
  Shape(const int64_t* dims, int rank);

  int rank() const { return rank_; }
  int64_t dim(int i) const { return dims_[i]; }
  const int64_t* dims() const { return dims_; }
  void set_dim(int i, int64_t value) { dims_[i] = value; }

  // Product of the dims; only meaningful once Validate() passed.
  int64_t num_elements() const;
  // Negative dims, a rank above kMaxRank, or an element count that overflows int64 give an error
  // naming `what`.
  Status Validate(std::string_view what) const;
  // TensorFlow's TensorShape::DebugString(): "[2,2,2]", "[]".
  std::string DebugString() const;

  bool operator==(const Shape& other) const;
  bool operator!=(const Shape& other) const { return !(*this == other); }

 private:
  int rank_ = 0;
  int64_t dims_[kMaxRank] = {};
};

// Non-owning, dense, row-major views of caller memory.
struct ConstTensorView {
  const void* data = nullptr;
  DataType dtype = DataType::kFloat32;
  Shape shape;
};

struct TensorView {
  void* data = nullptr;
  DataType dtype = DataType::kFloat32;
  Shape shape;

  operator ConstTensorView() const { return ConstTensorView{data, dtype, shape}; }  // NOLINT
};

}  // namespace fbn

#endif  // FBN_TYPES_H_
