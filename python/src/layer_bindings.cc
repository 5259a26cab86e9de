// Bindings of the batch-normalization layer, graph and optimizer (fbn/layer.h). Owned by the
// layer work; kept apart from fbn_ext.cc so the op bindings and the layer bindings evolve
// independently.
#include <nanobind/nanobind.h>

namespace nb = nanobind;

void BindLayers(nb::module_& m) {
  (void)m;  // The layer's classes are registered here as they land.
}
