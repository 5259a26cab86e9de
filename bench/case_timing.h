// How the per-case programs (fbn_bench, onednn_bench, copy_bench --cases) time and register a
// case, in one place so that every library is timed the same way. Header-only: it needs Google
// Benchmark, which the shared helper library does not link.
#ifndef FBN_BENCH_CASE_TIMING_H_
#define FBN_BENCH_CASE_TIMING_H_

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <utility>
#include <vector>

#include "bench_util.h"

namespace fbn_bench {

// Times every call on its own (steady_clock costs ~20 ns, under 2% of the smallest case): run()
// per iteration, flush() before it for cold cases (then the iteration time is the call's alone).
// Reports the repetition's median call (call_med_us), fastest call (call_min_us) and tensor_bytes.
template <class Run, class Flush>
void TimeCalls(benchmark::State& state, const Case& c, Run&& run, Flush&& flush) {
  std::vector<double> calls;
  calls.reserve(4096);
  for (auto _ : state) {
    if (c.cold) flush();
    const auto t0 = std::chrono::steady_clock::now();
    run();
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (c.cold) state.SetIterationTime(dt);
    calls.push_back(dt);
    benchmark::ClobberMemory();
  }
  if (!calls.empty()) {
    state.counters["call_min_us"] = 1e6 * *std::min_element(calls.begin(), calls.end());
    state.counters["call_med_us"] = 1e6 * MedianOf(&calls);
  }
  state.counters["tensor_bytes"] = static_cast<double>(c.tensor_bytes());
}

// Registers fn(state, c, args...) under the case's name for `library`, with the case's
// repetitions and minimum time, manual time for cold cases, and a "min" aggregate.
template <class Fn, class... Args>
void RegisterCase(const char* library, const Case& c, Fn fn, Args... args) {
  auto* b = benchmark::RegisterBenchmark(c.BenchmarkName(library).c_str(), fn, c, args...);
  b->Unit(benchmark::kMicrosecond);
  if (c.reps > 0) b->Repetitions(c.reps);
  if (c.min_time > 0) b->MinTime(c.min_time);
  if (c.cold) b->UseManualTime();
  b->ComputeStatistics(
      "min", [](const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); });
}

}  // namespace fbn_bench

#endif  // FBN_BENCH_CASE_TIMING_H_
