// The machine's memory bandwidth, measured in the same run as the libraries (performance.md §7.2):
// read-only, copy with regular stores and copy with non-temporal stores, 2 threads (and 1 for the
// NT copy), over a size sweep from L2-resident to several times the LLC. Bytes counted: read = 1x,
// copy = 2x the buffer (read + write; the RFO of regular stores is not counted).
//
//   copy_bench [--max_mb=N] [benchmark flags]
#include <benchmark/benchmark.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "bench_util.h"

namespace {

enum Kind { kRead, kCopyRegular, kCopyNT };

// Buffers shared by all sizes; each thread works on its own contiguous half.
float* g_src = nullptr;
float* g_dst = nullptr;
float g_sink[64];

__attribute__((target("avx512f"))) float Read512(const float* s, size_t n) {
  __m512 a = _mm512_setzero_ps(), b = a, c = a, d = a;
  for (size_t i = 0; i < n; i += 64) {
    a = _mm512_add_ps(a, _mm512_load_ps(s + i));
    b = _mm512_add_ps(b, _mm512_load_ps(s + i + 16));
    c = _mm512_add_ps(c, _mm512_load_ps(s + i + 32));
    d = _mm512_add_ps(d, _mm512_load_ps(s + i + 48));
  }
  alignas(64) float t[16];  // not _mm512_reduce_add_ps: GCC 12's header trips -Wuninitialized
  _mm512_store_ps(t, _mm512_add_ps(_mm512_add_ps(a, b), _mm512_add_ps(c, d)));
  return t[0] + t[15];
}

__attribute__((target("avx512f"))) void Copy512(const float* s, float* d, size_t n, bool nt) {
  if (nt) {
    for (size_t i = 0; i < n; i += 64) {
      const __m512 a = _mm512_load_ps(s + i), b = _mm512_load_ps(s + i + 16),
                   c = _mm512_load_ps(s + i + 32), e = _mm512_load_ps(s + i + 48);
      _mm512_stream_ps(d + i, a);
      _mm512_stream_ps(d + i + 16, b);
      _mm512_stream_ps(d + i + 32, c);
      _mm512_stream_ps(d + i + 48, e);
    }
    _mm_sfence();
  } else {
    for (size_t i = 0; i < n; i += 64) {
      const __m512 a = _mm512_load_ps(s + i), b = _mm512_load_ps(s + i + 16),
                   c = _mm512_load_ps(s + i + 32), e = _mm512_load_ps(s + i + 48);
      _mm512_store_ps(d + i, a);
      _mm512_store_ps(d + i + 16, b);
      _mm512_store_ps(d + i + 32, c);
      _mm512_store_ps(d + i + 48, e);
    }
  }
}

__attribute__((target("avx2"))) float Read256(const float* s, size_t n) {
  __m256 a = _mm256_setzero_ps(), b = a;
  for (size_t i = 0; i < n; i += 16) {
    a = _mm256_add_ps(a, _mm256_load_ps(s + i));
    b = _mm256_add_ps(b, _mm256_load_ps(s + i + 8));
  }
  float t[8];
  _mm256_storeu_ps(t, _mm256_add_ps(a, b));
  return t[0] + t[7];
}

__attribute__((target("avx2"))) void Copy256(const float* s, float* d, size_t n, bool nt) {
  for (size_t i = 0; i < n; i += 8) {
    const __m256 a = _mm256_load_ps(s + i);
    if (nt) {
      _mm256_stream_ps(d + i, a);
    } else {
      _mm256_store_ps(d + i, a);
    }
  }
  if (nt) _mm_sfence();
}

const bool kHasAvx512 = __builtin_cpu_supports("avx512f");

void BM_Memory(benchmark::State& state, Kind kind, size_t bytes) {
  const size_t n = bytes / sizeof(float);
  const size_t per_thread = n / static_cast<size_t>(state.threads()) / 64 * 64;
  const float* s = g_src + per_thread * static_cast<size_t>(state.thread_index());
  float* d = g_dst + per_thread * static_cast<size_t>(state.thread_index());
  for (auto _ : state) {
    if (kind == kRead) {
      g_sink[state.thread_index() * 16] +=
          kHasAvx512 ? Read512(s, per_thread) : Read256(s, per_thread);
    } else if (kHasAvx512) {
      Copy512(s, d, per_thread, kind == kCopyNT);
    } else {
      Copy256(s, d, per_thread, kind == kCopyNT);
    }
    benchmark::ClobberMemory();
  }
  const int64_t counted =
      static_cast<int64_t>(per_thread * sizeof(float)) * (kind == kRead ? 1 : 2);
  state.SetBytesProcessed(counted * state.iterations());
}

}  // namespace

int main(int argc, char** argv) {
  // Default: 2x the L3 that sysfs reports (at least 512 MiB), so src + dst span 4x the LLC.
  const std::string max_mb_flag = fbn_bench::TakeFlag(&argc, argv, "max_mb", "0");
  size_t max_mb = std::stoul(max_mb_flag);
  if (max_mb == 0) {
    size_t l3_kb = 0;
    std::FILE* f = std::fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r");
    if (f != nullptr) {
      if (std::fscanf(f, "%zu", &l3_kb) != 1) l3_kb = 0;
      std::fclose(f);
    }
    max_mb = std::max<size_t>(512, 2 * l3_kb / 1024);
  }
  const size_t max_bytes = max_mb << 20;
  fbn_bench::Buffer src(max_bytes), dst(max_bytes);
  g_src = src.as<float>();
  g_dst = dst.as<float>();
  fbn_bench::FillUniform(g_src, static_cast<int64_t>(max_bytes / 4), fbn_bench::Dtype::kF32, 0.f,
                         1.f, 7);

  std::vector<size_t> sizes_mb = {1, 4, 16, 32, 64, 128, 256};
  sizes_mb.erase(
      std::remove_if(sizes_mb.begin(), sizes_mb.end(), [&](size_t mb) { return mb >= max_mb; }),
      sizes_mb.end());
  sizes_mb.push_back(max_mb);
  const char* names[] = {"read", "copy_regular", "copy_nt"};
  for (size_t mb : sizes_mb) {
    for (Kind k : {kRead, kCopyRegular, kCopyNT}) {
      const std::string name = std::string("mem/") + names[k] + "/" + std::to_string(mb) + "MB";
      benchmark::RegisterBenchmark(name.c_str(), BM_Memory, k, mb << 20)
          ->Threads(2)
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
  // One core alone, for reference (one core nearly saturates DRAM on some machines).
  benchmark::RegisterBenchmark(("mem/copy_nt/" + std::to_string(max_mb) + "MB").c_str(), BM_Memory,
                               kCopyNT, max_bytes)
      ->Threads(1)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::AddCustomContext("cpu_model", fbn_bench::CpuModelName());
  benchmark::AddCustomContext("caches", fbn_bench::CacheSizesString());
  benchmark::AddCustomContext("dram_buffer_mb", std::to_string(max_mb));
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
