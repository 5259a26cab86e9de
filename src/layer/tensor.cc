#include "fbn/tensor.h"

#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <string>

#include "kernels/convert.h"

namespace fbn {

void Tensor::Free::operator()(void* p) const noexcept { std::free(p); }

Tensor::Tensor(DataType dtype, const Shape& shape) : dtype_(dtype), shape_(shape) {
  ThrowIfError(shape.Validate("tensor"));
  const uint64_t elements = static_cast<uint64_t>(shape.num_elements());
  const size_t element_bytes = DataTypeSize(dtype);
  auto exhausted = [&](const std::string& why) {
    return Error(Status(StatusCode::kResourceExhausted,
                        "could not allocate a " + std::string(DataTypeName(dtype)) +
                            " tensor of shape " + shape.DebugString() + ": " + why));
  };
  // The byte count (rounded up to the alignment, plus one line so it is never zero) must not
  // wrap around size_t: a wrapped count would give a buffer smaller than the shape.
  if (element_bytes != 0 && elements > (std::numeric_limits<size_t>::max() - 128) / element_bytes) {
    throw exhausted("its size in bytes overflows");
  }
  const size_t bytes = static_cast<size_t>(elements) * element_bytes;
  const size_t alloc = ((bytes + 63) / 64) * 64 + 64;
  void* p = std::aligned_alloc(64, alloc);
  if (!p) throw exhausted(std::to_string(bytes) + " bytes are not available");
  std::memset(p, 0, alloc);
  data_.reset(p);
}

Tensor::Tensor(const Tensor& other) : dtype_(other.dtype_), shape_(other.shape_) {
  if (other.valid()) {
    Tensor copy(other.dtype_, other.shape_);
    std::memcpy(copy.data(), other.data(), other.num_bytes());
    data_ = std::move(copy.data_);
  }
}

Tensor& Tensor::operator=(const Tensor& other) {
  if (this != &other) {
    Tensor copy(other);
    *this = std::move(copy);
  }
  return *this;
}

Tensor Tensor::Copy(const ConstTensorView& view) {
  Tensor t(view.dtype, view.shape);
  if (t.num_bytes() > 0) std::memcpy(t.data(), view.data, t.num_bytes());
  return t;
}

Tensor Tensor::Filled(DataType dtype, const Shape& shape, double value) {
  Tensor t(dtype, shape);
  for (int64_t i = 0; i < t.num_elements(); ++i) t.Set(i, value);
  return t;
}

Tensor Tensor::FromDoubles(DataType dtype, const Shape& shape, const std::vector<double>& values) {
  Tensor t(dtype, shape);
  if (static_cast<int64_t>(values.size()) != t.num_elements()) {
    throw Error(InvalidArgument("FromDoubles: " + std::to_string(values.size()) +
                                " values for shape " + shape.DebugString()));
  }
  for (int64_t i = 0; i < t.num_elements(); ++i) t.Set(i, values[static_cast<size_t>(i)]);
  return t;
}

double Tensor::Get(int64_t i) const {
  switch (dtype_) {
    case DataType::kFloat16:
      return kernels::ToFloat(data_as<kernels::Half>()[i]);
    case DataType::kBFloat16:
      return kernels::ToFloat(data_as<kernels::BFloat16>()[i]);
    case DataType::kFloat32:
      return data_as<float>()[i];
    case DataType::kFloat64:
      return data_as<double>()[i];
  }
  return 0.0;
}

void Tensor::Set(int64_t i, double value) {
  switch (dtype_) {
    case DataType::kFloat16:
      // Through float: double -> float -> half can double-round, but only for values that are
      // not representable as float in the first place, which fbn never produces here.
      data_as<kernels::Half>()[i] = kernels::ToHalf(static_cast<float>(value));
      return;
    case DataType::kBFloat16:
      data_as<kernels::BFloat16>()[i] = kernels::ToBFloat16(static_cast<float>(value));
      return;
    case DataType::kFloat32:
      data_as<float>()[i] = static_cast<float>(value);
      return;
    case DataType::kFloat64:
      data_as<double>()[i] = value;
      return;
  }
}

std::vector<double> Tensor::ToDoubles() const {
  std::vector<double> out(static_cast<size_t>(num_elements()));
  for (int64_t i = 0; i < num_elements(); ++i) out[static_cast<size_t>(i)] = Get(i);
  return out;
}

Tensor Tensor::Cast(DataType dtype) const {
  if (!valid()) return Tensor();
  if (dtype == dtype_) return *this;
  Tensor t(dtype, shape_);
  for (int64_t i = 0; i < num_elements(); ++i) t.Set(i, Get(i));
  return t;
}

Tensor Tensor::Reshaped(const Shape& shape) const {
  ThrowIfError(shape.Validate("shape"));
  if (shape.num_elements() != num_elements()) {
    throw Error(InvalidArgument("Cannot reshape a tensor with " + std::to_string(num_elements()) +
                                " elements to shape " + shape.DebugString()));
  }
  Tensor t(*this);
  t.shape_ = shape;
  return t;
}

std::string PyTupleString(const std::vector<int64_t>& values) {
  std::string s = "(";
  for (size_t i = 0; i < values.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(values[i]);
  }
  if (values.size() == 1) s += ",";
  return s + ")";
}

std::string PyTupleString(const Shape& shape) {
  return PyTupleString(std::vector<int64_t>(shape.dims(), shape.dims() + shape.rank()));
}

}  // namespace fbn
