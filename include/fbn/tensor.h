// An owning tensor for the layer API: variables, layer outputs and gradients live in these.
// The ops (fbn/ops.h) keep working on caller buffers through the views a Tensor hands out.
#ifndef FBN_TENSOR_H_
#define FBN_TENSOR_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fbn/export.h"
#include "fbn/types.h"

namespace fbn {

// Dense, row-major, 64-byte aligned, with value semantics: copies are deep. A default-constructed
// Tensor is "null" (no storage, valid() is false); it stands for an absent tensor, e.g. the gamma
// gradient of a layer built with scale=false.
class FBN_API Tensor {
 public:
  Tensor() = default;
  // Zero-filled. Throws fbn::Error (InvalidArgument) for an invalid shape.
  Tensor(DataType dtype, const Shape& shape);
  Tensor(const Tensor& other);
  Tensor& operator=(const Tensor& other);
  Tensor(Tensor&& other) noexcept = default;
  Tensor& operator=(Tensor&& other) noexcept = default;
  ~Tensor() = default;

  // A deep copy of caller memory.
  static Tensor Copy(const ConstTensorView& view);
  // Every element set to `value`, rounded to `dtype`.
  static Tensor Filled(DataType dtype, const Shape& shape, double value);
  // values.size() must equal the element count of `shape`; each value is rounded to `dtype`.
  static Tensor FromDoubles(DataType dtype, const Shape& shape, const std::vector<double>& values);

  bool valid() const { return static_cast<bool>(data_); }
  DataType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t num_elements() const { return valid() ? shape_.num_elements() : 0; }
  size_t num_bytes() const { return static_cast<size_t>(num_elements()) * DataTypeSize(dtype_); }

  void* data() { return data_.get(); }
  const void* data() const { return data_.get(); }
  template <typename T>
  T* data_as() {
    return static_cast<T*>(data());
  }
  template <typename T>
  const T* data_as() const {
    return static_cast<const T*>(data());
  }

  TensorView view() { return TensorView{data(), dtype_, shape_}; }
  ConstTensorView view() const { return ConstTensorView{data(), dtype_, shape_}; }

  // Element access through double (exact for every supported dtype); Set rounds to nearest even.
  double Get(int64_t i) const;
  void Set(int64_t i, double value);
  std::vector<double> ToDoubles() const;
  // The same values in another dtype (rounded to nearest even).
  Tensor Cast(DataType dtype) const;
  // The same data under another shape with the same element count.
  Tensor Reshaped(const Shape& shape) const;

 private:
  struct Free {
    void operator()(void* p) const noexcept;
  };
  DataType dtype_ = DataType::kFloat32;
  Shape shape_;
  std::unique_ptr<void, Free> data_;
};

// "(3,)", "(1, 4, 3)", "()": a shape as Python prints a tuple, as TensorFlow's layer messages do.
FBN_API std::string PyTupleString(const Shape& shape);
FBN_API std::string PyTupleString(const std::vector<int64_t>& values);

}  // namespace fbn

#endif  // FBN_TENSOR_H_
