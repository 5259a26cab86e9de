// A small persistent pool: the caller's thread plus NumThreads()-1 workers run the tasks of one
// ParallelFor at a time. Which thread runs a task never affects results: callers split work into
// tasks fixed by the problem shape and combine per-task partials in task order.
#ifndef FBN_THREADING_THREAD_POOL_H_
#define FBN_THREADING_THREAD_POOL_H_

#include <cstdint>
#include <utility>

namespace fbn::threading {

using TaskFn = void (*)(void* context, int64_t task);

// Runs fn(context, t) for t in [0, num_tasks), on up to `max_threads` threads of the process pool
// (the calling thread included). Nested calls, calls while another thread holds the pool, and
// max_threads <= 1 run inline on the calling thread.
void ParallelForRaw(int64_t num_tasks, int max_threads, TaskFn fn, void* context);

template <typename F>
void ParallelFor(int64_t num_tasks, int max_threads, F&& f) {
  auto trampoline = [](void* context, int64_t task) { (*static_cast<F*>(context))(task); };
  ParallelForRaw(num_tasks, max_threads, trampoline,
                 const_cast<void*>(static_cast<const void*>(&f)));
}

// The thread count that SetNumThreads() set (or the default).
int NumThreads();

// Threads worth using for `bytes` of memory traffic: one thread below a small-tensor threshold,
// where waking a worker costs more than it saves.
int ThreadsForWork(int64_t bytes);

}  // namespace fbn::threading

#endif  // FBN_THREADING_THREAD_POOL_H_
