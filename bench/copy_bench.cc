// The machine's memory bandwidth, measured in the same run as the libraries (performance.md §7.2):
// read-only, copy with regular stores and copy with non-temporal stores, 2 threads (and 1 for the
// NT copy), over a size sweep from L2-resident to several times the LLC. Bytes counted: read = 1x,
// copy = 2x the buffer (read + write; the RFO of regular stores is not counted).
//
// Also, on the DRAM-sized buffer only, what this machine gives the simplest loops with the memory
// traffic of a training pass (float, 2 threads, AVX-512 only), as a reference for the training
// targets, which are ratios to the inference time (a copy-like sweep):
//   ref/write_nt          streaming stores alone (1x counted);
//   ref/fwd_two_sweeps    a sum of x, then y = x·a + b streamed: 2R + 1W (2x counted);
//   ref/fwd_chunked       the same per chunk of half the L2, so the second read can hit the L2:
//                         the channels-first fused pass at its best (2x counted);
//   ref/grad_two_sweeps   sums of dy and dy·x, then dx = dy·a + x·b streamed: 4R + 1W (3x counted);
//   ref/grad_chunked      the same per chunk of half the L2, dy and x together (3x counted).
// Their time over the NT copy's for the same tensor is the ratio the targets bound.
//
// With --cases=FILE (the driver's case list), instead: per case, a copy of the case's tensor (its
// bytes read, the same bytes written with streaming stores) on --threads threads, timed call by
// call as fbn_bench times a call. The driver runs it in the same rounds as the libraries, so the
// copy a forward inference is held against sees the same moments of the shared host (its
// bandwidth moves by up to 1.6x from minute to minute).
//
//   copy_bench [--max_mb=N] [benchmark flags]
//   copy_bench --cases=FILE [--threads=2] [benchmark flags]
#include <benchmark/benchmark.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "bench_util.h"
#include "case_timing.h"

namespace {

enum Kind { kRead, kCopyRegular, kCopyNT };
enum RefKind { kWriteNT, kFwdTwoSweeps, kFwdChunked, kGradTwoSweeps, kGradChunked };

// Buffers shared by all sizes; each thread works on its own contiguous half.
float* g_src = nullptr;
float* g_dst = nullptr;
float* g_src2 = nullptr;  // the second input (x) of the gradient references
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

// The reference loops: elements [0, n) of x (and x2) in chunks of `chunk`, each reduced, then
// rewritten into y with streaming stores. n and chunk are multiples of 64.
__attribute__((target("avx512f"))) float FwdRef(const float* x, float* y, size_t n, size_t chunk) {
  float sink = 0;
  for (size_t c0 = 0; c0 < n; c0 += chunk) {
    const size_t c1 = std::min(n, c0 + chunk);
    __m512 a = _mm512_setzero_ps(), b = a, c = a, d = a;
    for (size_t i = c0; i < c1; i += 64) {
      a = _mm512_add_ps(a, _mm512_load_ps(x + i));
      b = _mm512_add_ps(b, _mm512_load_ps(x + i + 16));
      c = _mm512_add_ps(c, _mm512_load_ps(x + i + 32));
      d = _mm512_add_ps(d, _mm512_load_ps(x + i + 48));
    }
    alignas(64) float t[16];
    _mm512_store_ps(t, _mm512_add_ps(_mm512_add_ps(a, b), _mm512_add_ps(c, d)));
    const __m512 k = _mm512_set1_ps(1.0f / (1.0f + t[0] * t[0])), m = _mm512_set1_ps(t[15]);
    for (size_t i = c0; i < c1; i += 16) {
      _mm512_stream_ps(y + i, _mm512_fmadd_ps(_mm512_sub_ps(_mm512_load_ps(x + i), m), k, m));
    }
    sink += t[1];
  }
  _mm_sfence();
  return sink;
}

__attribute__((target("avx512f"))) float GradRef(const float* dy, const float* x, float* dx,
                                                 size_t n, size_t chunk) {
  float sink = 0;
  for (size_t c0 = 0; c0 < n; c0 += chunk) {
    const size_t c1 = std::min(n, c0 + chunk);
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, q0 = s0, q1 = s0;
    for (size_t i = c0; i < c1; i += 32) {
      const __m512 g0 = _mm512_load_ps(dy + i), g1 = _mm512_load_ps(dy + i + 16);
      s0 = _mm512_add_ps(s0, g0);
      s1 = _mm512_add_ps(s1, g1);
      q0 = _mm512_fmadd_ps(g0, _mm512_load_ps(x + i), q0);
      q1 = _mm512_fmadd_ps(g1, _mm512_load_ps(x + i + 16), q1);
    }
    alignas(64) float t[16], u[16];
    _mm512_store_ps(t, _mm512_add_ps(s0, s1));
    _mm512_store_ps(u, _mm512_add_ps(q0, q1));
    const __m512 a = _mm512_set1_ps(1.0f / (1.0f + t[0] * t[0]));
    const __m512 b = _mm512_set1_ps(1.0f / (1.0f + u[0] * u[0]));
    for (size_t i = c0; i < c1; i += 16) {
      _mm512_stream_ps(dx + i, _mm512_fmadd_ps(_mm512_load_ps(dy + i), a,
                                               _mm512_mul_ps(_mm512_load_ps(x + i), b)));
    }
    sink += t[1] + u[1];
  }
  _mm_sfence();
  return sink;
}

__attribute__((target("avx512f"))) void WriteNT(float* y, size_t n) {
  const __m512 v = _mm512_set1_ps(1.0f);
  for (size_t i = 0; i < n; i += 16) _mm512_stream_ps(y + i, v);
  _mm_sfence();
}

// Half the L2 of one core (sysfs; 512 KB where it is not reported), in floats.
size_t RefChunkFloats() {
  size_t l2_kb = 0;
  std::FILE* f = std::fopen("/sys/devices/system/cpu/cpu0/cache/index2/size", "r");
  if (f != nullptr) {
    if (std::fscanf(f, "%zu", &l2_kb) != 1) l2_kb = 0;
    std::fclose(f);
  }
  if (l2_kb == 0) l2_kb = 1024;
  return l2_kb * 1024 / 2 / sizeof(float) / 64 * 64;
}

void BM_Reference(benchmark::State& state, RefKind kind, size_t bytes) {
  const size_t n = bytes / sizeof(float);
  const size_t per_thread = n / static_cast<size_t>(state.threads()) / 64 * 64;
  const size_t offset = per_thread * static_cast<size_t>(state.thread_index());
  const float* x = g_src + offset;
  const float* x2 = g_src2 + offset;
  float* y = g_dst + offset;
  const size_t chunk = RefChunkFloats();
  for (auto _ : state) {
    float r = 0;
    switch (kind) {
      case kWriteNT:
        WriteNT(y, per_thread);
        break;
      case kFwdTwoSweeps:
        r = FwdRef(x, y, per_thread, per_thread);
        break;
      case kFwdChunked:
        r = FwdRef(x, y, per_thread, chunk);
        break;
      case kGradTwoSweeps:
        r = GradRef(x, x2, y, per_thread, per_thread);
        break;
      case kGradChunked:
        r = GradRef(x, x2, y, per_thread, chunk);
        break;
    }
    g_sink[state.thread_index() * 16] += r;
    benchmark::ClobberMemory();
  }
  const int64_t tensor = static_cast<int64_t>(per_thread * sizeof(float));
  const int64_t counted = kind == kWriteNT                                 ? tensor
                          : (kind == kFwdTwoSweeps || kind == kFwdChunked) ? 2 * tensor
                                                                           : 3 * tensor;
  state.SetBytesProcessed(counted * state.iterations());
}

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

// Bytes [0, bytes) of s copied to d with streaming stores; s and d 64-byte aligned.
void CopyBytesNT(const char* s, char* d, size_t bytes) {
  const size_t body = bytes / 256 * 256;
  const float* fs = reinterpret_cast<const float*>(s);
  float* fd = reinterpret_cast<float*>(d);
  if (kHasAvx512) {
    Copy512(fs, fd, body / sizeof(float), true);
  } else {
    Copy256(fs, fd, body / sizeof(float), true);
  }
  std::memcpy(d + body, s + body, bytes - body);
}

// The threads of the per-case copies: the caller takes the first slice, workers that stay up for
// the whole program take the others (as a library's thread pool would), so a call pays a wake-up,
// not a thread start.
class CopyTeam {
 public:
  explicit CopyTeam(int threads) {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { Loop(i); });
  }
  ~CopyTeam() {
    quit_.store(true);
    generation_.fetch_add(1);
    for (std::thread& t : workers_) t.join();
  }
  CopyTeam(const CopyTeam&) = delete;
  CopyTeam& operator=(const CopyTeam&) = delete;

  void Copy(const char* s, char* d, size_t bytes) {
    src_ = s;
    dst_ = d;
    bytes_ = bytes;
    pending_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
    CopySlice(0);
    while (pending_.load(std::memory_order_acquire) != 0) _mm_pause();
  }

 private:
  // Slice i of T: page-aligned boundaries, the last slice takes the rest.
  void CopySlice(int i) {
    const size_t t = workers_.size() + 1;
    const size_t per = bytes_ / t / 4096 * 4096;
    const size_t begin = per * static_cast<size_t>(i);
    const size_t end = static_cast<size_t>(i) + 1 == t ? bytes_ : begin + per;
    CopyBytesNT(src_ + begin, dst_ + begin, end - begin);
  }

  void Loop(int i) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t g;
      int spins = 0;
      while ((g = generation_.load(std::memory_order_acquire)) == seen) {
        if (++spins < 1 << 16) {
          _mm_pause();
        } else {
          std::this_thread::yield();  // idle between cases: give the core back
        }
      }
      seen = g;
      if (quit_.load()) return;
      CopySlice(i);
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  const char* src_ = nullptr;
  char* dst_ = nullptr;
  size_t bytes_ = 0;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> quit_{false};
  std::vector<std::thread> workers_;
};

void BM_CaseCopy(benchmark::State& state, fbn_bench::Case c, CopyTeam* team) {
  // One case's buffers alive at a time; x is the input the libraries read (same fill).
  static fbn_bench::Buffer x, y;
  static std::string key;
  if (key != c.BenchmarkName("copy")) {
    y = fbn_bench::Buffer();  // free the previous case's output first
    x = fbn_bench::SharedInput(c.elements(), c.dtype, 0);
    y = fbn_bench::Buffer(c.tensor_bytes());
    key = c.BenchmarkName("copy");
    team->Copy(x.as<char>(), y.as<char>(), c.tensor_bytes());  // untimed, as fbn_bench's first
  }
  fbn_bench::TimeCalls(
      state, c, [&] { team->Copy(x.as<char>(), y.as<char>(), c.tensor_bytes()); },
      [&] {
        fbn_bench::FlushFromCache(x.data(), x.bytes());
        fbn_bench::FlushFromCache(y.data(), y.bytes());
      });
}

int RunCases(const std::string& path, int threads, int argc, char** argv) {
  std::vector<fbn_bench::Case> cases;
  std::string error;
  if (!fbn_bench::ReadCases(path, &cases, &error)) {
    std::fprintf(stderr, "%s\n", error.c_str());
    return 2;
  }
  static CopyTeam team(std::max(1, threads));
  for (const fbn_bench::Case& c : cases) {
    fbn_bench::RegisterCase("copy", c, BM_CaseCopy, &team);
  }
  benchmark::AddCustomContext("library", "copy");
  benchmark::AddCustomContext("copy_threads", std::to_string(threads));
  benchmark::AddCustomContext("cpu_model", fbn_bench::CpuModelName());
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string cases_path = fbn_bench::TakeFlag(&argc, argv, "cases", "");
  const int threads = std::stoi(fbn_bench::TakeFlag(&argc, argv, "threads", "2"));
  if (!cases_path.empty()) return RunCases(cases_path, threads, argc, argv);
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
  fbn_bench::Buffer src2(kHasAvx512 ? max_bytes : 64);
  g_src2 = src2.as<float>();
  if (kHasAvx512) {
    fbn_bench::FillUniform(g_src2, static_cast<int64_t>(max_bytes / 4), fbn_bench::Dtype::kF32,
                           -1.f, 1.f, 8);
  }

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
  if (kHasAvx512) {
    const char* ref_names[] = {"write_nt", "fwd_two_sweeps", "fwd_chunked", "grad_two_sweeps",
                               "grad_chunked"};
    for (RefKind k : {kWriteNT, kFwdTwoSweeps, kFwdChunked, kGradTwoSweeps, kGradChunked}) {
      const std::string name =
          std::string("ref/") + ref_names[k] + "/" + std::to_string(max_mb) + "MB";
      benchmark::RegisterBenchmark(name.c_str(), BM_Reference, k, max_bytes)
          ->Threads(2)
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    }
    benchmark::AddCustomContext("ref_chunk_kb", std::to_string(RefChunkFloats() * 4 / 1024));
  }
  benchmark::AddCustomContext("cpu_model", fbn_bench::CpuModelName());
  benchmark::AddCustomContext("caches", fbn_bench::CacheSizesString());
  benchmark::AddCustomContext("dram_buffer_mb", std::to_string(max_mb));
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
