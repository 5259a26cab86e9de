// Pieces shared by the forward and gradient ops: type rules, formats, geometry.
#ifndef FBN_OPS_OP_COMMON_H_
#define FBN_OPS_OP_COMMON_H_

#include <initializer_list>

#include "fbn/ops.h"
#include "kernels/batch_norm_kernels.h"

namespace fbn::ops {

// Type of the per-channel tensors for an x of type t: double for double x, else float.
inline DataType StatsType(DataType t) {
  return t == DataType::kFloat64 ? DataType::kFloat64 : DataType::kFloat32;
}

// An OpVersion outside kV1..kV3 (any int converts to the enum): InvalidArgument naming the
// argument `version` and `function`. Every entry point taking a version checks it first.
Status CheckVersion(const char* function, OpVersion version);

// TensorFlow's registration rules for (T, U): V1 has one type T for everything (float; double as
// an fbn extension); V2/V3 take T in {half, bfloat16, float} (and double) with U = StatsType(T).
// `stats` lists the per-channel inputs in order, starting at input index 1 (forward) or as given.
Status CheckOpTypes(const char* op, OpVersion version, DataType t,
                    std::initializer_list<DataType> stats, int first_index = 1);

// V1 and V2 accept only the 2-D format names, as TensorFlow's attribute lists do.
Status CheckFormat(TensorFormat format, OpVersion version);

int64_t ChannelCount(const Shape& x, TensorFormat format);
kernels::Geometry MakeGeometry(const Shape& x, TensorFormat format);

}  // namespace fbn::ops

#endif  // FBN_OPS_OP_COMMON_H_
