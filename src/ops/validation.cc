#include "ops/validation.h"

namespace fbn::ops {

Status CheckInputType(const char* op, int index, DataType got, DataType want) {
  if (got == want) return Status::Ok();
  return InvalidArgument(std::string("cannot compute ") + op + " as input #" +
                         std::to_string(index) + "(zero-based) was expected to be a " +
                         DataTypeName(want) + " tensor but is a " + DataTypeName(got) + " tensor");
}

Status AttrTypeError(const char* attr, DataType got, const char* allowed) {
  return InvalidArgument(std::string("Value for attr '") + attr + "' of " + DataTypeName(got) +
                         " is not in the list of allowed values: " + allowed);
}

Status CheckTensor(const ConstTensorView& t, const char* name) {
  Status s = t.shape.Validate(name);
  if (!s.ok()) return s;
  if (static_cast<int>(t.dtype) < 0 || static_cast<int>(t.dtype) > 3) {
    return InvalidArgument(std::string(name) + " has an unknown dtype code " +
                           std::to_string(static_cast<int>(t.dtype)));
  }
  if (t.data == nullptr && t.shape.num_elements() > 0) {
    return InvalidArgument(std::string(name) + " has " + std::to_string(t.shape.num_elements()) +
                           " elements but a null data pointer");
  }
  return Status::Ok();
}

Status CheckOutput(const TensorView& out, const TensorSpec& spec, const char* name) {
  if (out.dtype != spec.dtype || out.shape != spec.shape) {
    return InvalidArgument(std::string("output ") + name + " must have dtype " +
                           DataTypeName(spec.dtype) + " and shape " + spec.shape.DebugString() +
                           ", got dtype " + DataTypeName(out.dtype) + " and shape " +
                           out.shape.DebugString());
  }
  if (out.data == nullptr && spec.shape.num_elements() > 0) {
    return InvalidArgument(std::string("output ") + name + " has a null data pointer");
  }
  return Status::Ok();
}

}  // namespace fbn::ops
