// Umbrella header: everything a C++ user of fbn needs.
#ifndef FBN_FBN_H_
#define FBN_FBN_H_

#include "fbn/graph.h"
#include "fbn/initializers.h"
#include "fbn/layer.h"
#include "fbn/ops.h"
#include "fbn/optimizer.h"
#include "fbn/status.h"
#include "fbn/tensor.h"
#include "fbn/threading.h"
#include "fbn/types.h"
#include "fbn/version.h"

#endif  // FBN_FBN_H_
