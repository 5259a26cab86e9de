// Small naming helpers shared by the layer sources.
#ifndef FBN_LAYER_NAMES_H_
#define FBN_LAYER_NAMES_H_

#include <string>

#include "fbn/types.h"

namespace fbn::layer_impl {

// TensorFlow's Python dtype names: "float16", "bfloat16", "float32", "float64".
inline std::string PyDtypeName(DataType t) {
  switch (t) {
    case DataType::kFloat16:
      return "float16";
    case DataType::kBFloat16:
      return "bfloat16";
    case DataType::kFloat32:
      return "float32";
    case DataType::kFloat64:
      return "float64";
  }
  return "unknown";
}

}  // namespace fbn::layer_impl

#endif  // FBN_LAYER_NAMES_H_
