#include "bench_util.h"

#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

namespace fbn_bench {

const char* PassName(Pass p) {
  switch (p) {
    case Pass::kFwdTrain:
      return "fwd_train";
    case Pass::kFwdInfer:
      return "fwd_infer";
    case Pass::kGradTrain:
      return "grad_train";
    case Pass::kGradInfer:
      return "grad_infer";
  }
  return "?";
}

const char* DtypeName(Dtype d) { return d == Dtype::kF32 ? "f32" : "bf16"; }
const char* LayoutName(Layout l) { return l == Layout::kNHWC ? "nhwc" : "nchw"; }

bool ParsePass(const std::string& s, Pass* p) {
  for (Pass q : {Pass::kFwdTrain, Pass::kFwdInfer, Pass::kGradTrain, Pass::kGradInfer}) {
    if (s == PassName(q)) {
      *p = q;
      return true;
    }
  }
  return false;
}

bool ParseDtype(const std::string& s, Dtype* d) {
  if (s == "f32")
    *d = Dtype::kF32;
  else if (s == "bf16")
    *d = Dtype::kBF16;
  else
    return false;
  return true;
}

bool ParseLayout(const std::string& s, Layout* l) {
  if (s == "nhwc")
    *l = Layout::kNHWC;
  else if (s == "nchw")
    *l = Layout::kNCHW;
  else
    return false;
  return true;
}

std::vector<int64_t> Case::dims() const {
  if (layout == Layout::kNHWC) return {n, h, w, c};
  return {n, c, h, w};
}

std::string Case::BenchmarkName(const char* library) const {
  return std::string(library) + "/" + id + "/" + PassName(pass) + "/" + DtypeName(dtype) + "/" +
         LayoutName(layout) + "/" + (cold ? "cold" : "warm");
}

bool ReadCases(const std::string& path, std::vector<Case>* cases, std::string* error) {
  std::ifstream in(path);
  if (!in) {
    *error = "cannot open " + path;
    return false;
  }
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ss(line);
    Case c;
    std::string pass, dtype, layout, cache;
    ss >> c.id >> pass >> dtype >> layout >> c.n >> c.c >> c.h >> c.w >> cache >> c.reps >>
        c.min_time;
    if (ss.fail() || !ParsePass(pass, &c.pass) || !ParseDtype(dtype, &c.dtype) ||
        !ParseLayout(layout, &c.layout) || (cache != "warm" && cache != "cold")) {
      *error = path + ":" + std::to_string(lineno) + ": malformed case line: " + line;
      return false;
    }
    c.cold = cache == "cold";
    cases->push_back(c);
  }
  return true;
}

std::string TakeFlag(int* argc, char** argv, const std::string& name, const std::string& fallback) {
  const std::string prefix = "--" + name + "=";
  std::string value = fallback;
  int out = 1;
  for (int i = 1; i < *argc; ++i) {
    if (std::strncmp(argv[i], prefix.c_str(), prefix.size()) == 0) {
      value = argv[i] + prefix.size();
    } else {
      argv[out++] = argv[i];
    }
  }
  *argc = out;
  return value;
}

Buffer::Buffer(size_t bytes) : bytes_(bytes) {
  const size_t rounded = (bytes + 63) / 64 * 64 + 64;
  data_ = std::aligned_alloc(64, rounded);
  if (data_ == nullptr) {
    std::fprintf(stderr, "out of memory allocating %zu bytes\n", bytes);
    std::abort();
  }
  std::memset(data_, 0, rounded);  // fault the pages in now, not inside a timed call
}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    if (owned_) std::free(data_);
    data_ = o.data_;
    bytes_ = o.bytes_;
    owned_ = o.owned_;
    o.data_ = nullptr;
    o.bytes_ = 0;
    o.owned_ = true;
  }
  return *this;
}

Buffer::~Buffer() {
  if (owned_) std::free(data_);
}

Buffer SharedInput(int64_t count, Dtype dtype, int which) {
  static int64_t cached_count = -1;
  static Dtype cached_dtype = Dtype::kF32;
  static Buffer inputs[2];
  if (count != cached_count || dtype != cached_dtype) {
    inputs[0] = Buffer();
    inputs[1] = Buffer();
    cached_count = count;
    cached_dtype = dtype;
  }
  Buffer& b = inputs[which];
  if (b.data() == nullptr) {
    b = Buffer(static_cast<size_t>(count) * DtypeSize(dtype));
    if (which == 0) {
      FillUniform(b.data(), count, dtype, -2.0f, 3.0f, 1);
    } else {
      FillUniform(b.data(), count, dtype, -1.0f, 1.0f, 2);
    }
  }
  return Buffer::View(b.data(), b.bytes());
}

uint16_t FloatToBF16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float BF16ToFloat(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

void FillUniform(void* dst, int64_t count, Dtype dtype, float lo, float hi, uint64_t seed) {
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
  const float scale = (hi - lo) / 16777216.0f;
  for (int64_t i = 0; i < count; ++i) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;  // PCG-style LCG, top 24 bits
    const float v = lo + static_cast<float>(s >> 40) * scale;
    if (dtype == Dtype::kF32) {
      static_cast<float*>(dst)[i] = v;
    } else {
      static_cast<uint16_t*>(dst)[i] = FloatToBF16(v);
    }
  }
}

namespace {

// clflushopt is not ordered against other flushes, so it streams several times faster than
// clflush: the cold runs' flushes then cost about as much as the timed call, not several times it.
__attribute__((target("clflushopt"))) void FlushOpt(const char* p, size_t bytes) {
  for (size_t off = 0; off < bytes; off += 64)
    _mm_clflushopt(const_cast<char*>(p + off));  // GCC 12 declares it non-const
}

bool HasClflushopt() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return (b >> 23) & 1u;
}

}  // namespace

void FlushFromCache(const void* ptr, size_t bytes) {
  static const bool has_opt = HasClflushopt();
  const char* p = static_cast<const char*>(ptr);
  if (has_opt) {
    FlushOpt(p, bytes);
  } else {
    for (size_t off = 0; off < bytes; off += 64) _mm_clflush(p + off);
  }
  _mm_mfence();
}

bool ReadFile(const std::string& path, void* dst, size_t bytes) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return false;
  const bool ok = std::fread(dst, 1, bytes, f) == bytes;
  std::fclose(f);
  return ok;
}

bool WriteFile(const std::string& path, const void* src, size_t bytes) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return false;
  const bool ok = std::fwrite(src, 1, bytes, f) == bytes;
  return std::fclose(f) == 0 && ok;
}

bool WriteAsF32(const std::string& path, const void* src, int64_t count, Dtype dtype) {
  if (dtype == Dtype::kF32) return WriteFile(path, src, static_cast<size_t>(count) * 4);
  std::vector<float> tmp(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) tmp[i] = BF16ToFloat(static_cast<const uint16_t*>(src)[i]);
  return WriteFile(path, tmp.data(), tmp.size() * 4);
}

double MedianOf(std::vector<double>* v) {
  if (v->empty()) return 0.0;
  const size_t mid = v->size() / 2;
  std::nth_element(v->begin(), v->begin() + static_cast<std::ptrdiff_t>(mid), v->end());
  double m = (*v)[mid];
  if (v->size() % 2 == 0) {
    m = (m + *std::max_element(v->begin(), v->begin() + static_cast<std::ptrdiff_t>(mid))) / 2;
  }
  return m;
}

namespace {
std::string ReadFirstLine(const std::string& path) {
  std::ifstream in(path);
  std::string s;
  std::getline(in, s);
  return s;
}
}  // namespace

std::string CacheSizesString() {
  std::string out;
  for (int i = 0; i < 8; ++i) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
    const std::string level = ReadFirstLine(dir + "level");
    if (level.empty()) break;
    const std::string type = ReadFirstLine(dir + "type");
    if (type == "Instruction") continue;
    if (!out.empty()) out += " ";
    out += "L" + level + (type == "Data" ? "d" : "") + "=" + ReadFirstLine(dir + "size");
  }
  return out;
}

std::string CpuModelName() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) return line.substr(colon + 2);
    }
  }
  return "unknown";
}

}  // namespace fbn_bench
