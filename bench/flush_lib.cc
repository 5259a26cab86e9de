// A C entry point to bench_util's cache flush, loaded with ctypes by the Python workers
// (tf_worker.py, torch_worker.py) so their cold runs flush operands exactly as the C++ programs do.
#include <cstddef>

#include "bench_util.h"

extern "C" __attribute__((visibility("default"))) void fbn_bench_flush(const void* ptr,
                                                                       size_t bytes) {
  if (ptr != nullptr && bytes > 0) fbn_bench::FlushFromCache(ptr, bytes);
}
