// Validation helpers shared by the ops: TensorFlow's attribute and dtype texts, output checks.
#ifndef FBN_OPS_VALIDATION_H_
#define FBN_OPS_VALIDATION_H_

#include <string>

#include "fbn/ops.h"
#include "fbn/status.h"
#include "fbn/types.h"

namespace fbn::ops {

// "cannot compute <op> as input #<i>(zero-based) was expected to be a <want> tensor but is a
// <got> tensor", TensorFlow's text for an input of the wrong dtype.
Status CheckInputType(const char* op, int index, DataType got, DataType want);

// "Value for attr '<attr>' of <got> is not in the list of allowed values: <allowed>".
Status AttrTypeError(const char* attr, DataType got, const char* allowed);

// Rejects negative dims, ranks above Shape::kMaxRank, element-count overflow, and a null data
// pointer for a non-empty tensor.
Status CheckTensor(const ConstTensorView& t, const char* name);

// An output view must have exactly the spec's dtype and shape and non-null data when non-empty.
Status CheckOutput(const TensorView& out, const TensorSpec& spec, const char* name);

// Validates the inputs (FusedBatchNormOutputSpecs) and then every output view against its spec,
// naming the output; `specs` receives the specs. Shared by the ops and synchronized batch norm.
Status CheckForwardOutputs(OpVersion version, const FusedBatchNormInputs& in,
                           const FusedBatchNormAttrs& attrs, const FusedBatchNormOutputs& out,
                           TensorSpec specs[kMaxOpOutputs]);
Status CheckGradOutputs(OpVersion version, const FusedBatchNormGradInputs& in,
                        const FusedBatchNormGradAttrs& attrs, const FusedBatchNormGradOutputs& out,
                        TensorSpec specs[kMaxOpOutputs]);

// Runs f(), turning an escaping std::bad_alloc into ResourceExhausted: the op entry points are
// noexcept.
template <typename F>
Status Guarded(F&& f) noexcept {
  try {
    return f();
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kResourceExhausted, "fbn could not allocate working memory");
  } catch (const std::exception& e) {
    return Status(StatusCode::kInternal, e.what());
  }
}

}  // namespace fbn::ops

#endif  // FBN_OPS_VALIDATION_H_
