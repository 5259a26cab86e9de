// Threads used by fbn's ops. Results never depend on the thread count: reductions run over chunks
// fixed by the shape alone and are combined in chunk order.
#ifndef FBN_THREADING_H_
#define FBN_THREADING_H_

#include "fbn/export.h"

namespace fbn {

// Sets the number of threads fbn's ops use (the caller's thread included). n <= 0 restores the
// default: FBN_NUM_THREADS from the environment if set, else the hardware concurrency.
FBN_API void SetNumThreads(int n);
FBN_API int GetNumThreads();

}  // namespace fbn

#endif  // FBN_THREADING_H_
