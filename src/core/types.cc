#include "fbn/types.h"

#include <algorithm>
#include <limits>

namespace fbn {

size_t DataTypeSize(DataType type) {
  switch (type) {
    case DataType::kFloat16:
    case DataType::kBFloat16:
      return 2;
    case DataType::kFloat32:
      return 4;
    case DataType::kFloat64:
      return 8;
  }
  return 0;
}

const char* DataTypeName(DataType type) {
  switch (type) {
    case DataType::kFloat16:
      return "half";
    case DataType::kBFloat16:
      return "bfloat16";
    case DataType::kFloat32:
      return "float";
    case DataType::kFloat64:
      return "double";
  }
  return "unknown";
}

const char* TensorFormatName(TensorFormat format) {
  switch (format) {
    case TensorFormat::kNHWC:
      return "NHWC";
    case TensorFormat::kNCHW:
      return "NCHW";
    case TensorFormat::kNDHWC:
      return "NDHWC";
    case TensorFormat::kNCDHW:
      return "NCDHW";
  }
  return "unknown";
}

Shape::Shape(std::initializer_list<int64_t> dims)
    : Shape(dims.begin(), static_cast<int>(dims.size())) {}

Shape::Shape(const int64_t* dims, int rank) {
  // A rank beyond kMaxRank is remembered as kMaxRank + 1 so Validate() can reject it.
  rank_ = std::clamp(rank, 0, kMaxRank + 1);
  std::copy(dims, dims + std::min(rank_, kMaxRank), dims_);
}

int64_t Shape::num_elements() const {
  int64_t n = 1;
  for (int i = 0; i < std::min(rank_, kMaxRank); ++i) n *= dims_[i];
  return n;
}

Status Shape::Validate(std::string_view what) const {
  if (rank_ > kMaxRank) {
    return InvalidArgument(std::string(what) + " has rank above " + std::to_string(kMaxRank) +
                           ", which fbn does not support");
  }
  for (int i = 0; i < rank_; ++i) {
    if (dims_[i] < 0) {
      return InvalidArgument(std::string(what) + " has a negative dimension: " + DebugString());
    }
  }
  // The product of the non-zero dims must fit too, also when a zero dim makes the tensor empty:
  // num_elements(), the kernels' geometry and the strides multiply dims in varying orders.
  int64_t n = 1;
  for (int i = 0; i < rank_; ++i) {
    if (dims_[i] == 0) continue;
    if (n > std::numeric_limits<int64_t>::max() / dims_[i]) {
      return InvalidArgument(std::string(what) + " has too many elements: the product of " +
                             DebugString() + " overflows a 64-bit integer");
    }
    n *= dims_[i];
  }
  return Status::Ok();
}

std::string Shape::DebugString() const {
  std::string s = "[";
  for (int i = 0; i < std::min(rank_, kMaxRank); ++i) {
    if (i) s += ",";
    s += std::to_string(dims_[i]);
  }
  if (rank_ > kMaxRank) s += ",...";
  return s + "]";
}

bool Shape::operator==(const Shape& other) const {
  if (rank_ != other.rank_) return false;
  return std::equal(dims_, dims_ + std::min(rank_, kMaxRank), other.dims_);
}

}  // namespace fbn
