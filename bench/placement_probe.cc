// Where the host has put the benchmark's two CPUs, measured: the round trip of one cache line
// between a thread on the first CPU of the affinity mask and one on the second.
//
// On the 2-vCPU cloud VMs these benchmarks run on, the host moves the two vCPUs between cores
// of one L3 (a round trip of about 100 ns) and cores on different L3s (about 500 ns), in stretches
// of seconds to minutes. The two states run the same code at different speeds, for every library
// alike: a 32x56x56x64 float NHWC warm inference took fbn 470-530 us and oneDNN 470-540 us with
// the CPUs apart (each has an L3 of its own: 64 MB in all) and 920-1040 us for both with them on
// one L3; two-thread batch-1 calls take about twice as long apart (the 1x14x14x1024 float
// training forward 45-56 us against 27-29). run_bench.py runs this before and after each
// library's batch of cases and compares libraries within one state.
//
//   placement_probe [--ms=N]    prints {"round_trip_ns": median, "p10": ..., "p90": ..., "cpus":
//   [a, b]}
//
// Prints round_trip_ns 0 where the process may run on fewer than two CPUs.
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace {

alignas(64) std::atomic<int> g_ping{0};
alignas(64) std::atomic<int> g_pong{0};

bool Pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  double ms = 5.0;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--ms=", 5) == 0) ms = std::atof(argv[i] + 5);
  }
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  sched_getaffinity(0, sizeof(allowed), &allowed);
  int cpus[2] = {-1, -1};
  for (int c = 0, found = 0; c < CPU_SETSIZE && found < 2; ++c) {
    if (CPU_ISSET(c, &allowed)) cpus[found++] = c;
  }
  if (cpus[1] < 0) {
    std::printf("{\"round_trip_ns\": 0, \"median\": 0, \"p90\": 0, \"cpus\": [%d]}\n", cpus[0]);
    return 0;
  }
  std::atomic<bool> stop{false};
  std::thread echo([&] {
    Pin(cpus[1]);
    int seen = 0;
    while (!stop.load(std::memory_order_relaxed)) {
      const int v = g_ping.load(std::memory_order_acquire);
      if (v != seen) {
        seen = v;
        g_pong.store(v, std::memory_order_release);
      }
    }
  });
  Pin(cpus[0]);
  // Samples of 500 round trips (50-250 us each).
  constexpr int kTrips = 500;
  std::vector<double> samples;
  int v = 0;
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double, std::milli>(ms);
  do {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kTrips; ++i) {
      g_ping.store(++v, std::memory_order_release);
      while (g_pong.load(std::memory_order_acquire) != v) {
      }
    }
    const std::chrono::duration<double, std::nano> dt = std::chrono::steady_clock::now() - t0;
    samples.push_back(dt.count() / kTrips);
  } while (std::chrono::steady_clock::now() < end);
  stop.store(true);
  echo.join();
  std::sort(samples.begin(), samples.end());
  const size_t n = samples.size();
  std::printf("{\"round_trip_ns\": %.0f, \"median\": %.0f, \"p90\": %.0f, \"cpus\": [%d, %d]}\n",
              samples[0], samples[n / 2], samples[n * 9 / 10], cpus[0], cpus[1]);
  return 0;
}
