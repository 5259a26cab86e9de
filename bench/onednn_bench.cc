// oneDNN's side of the side-by-side benchmark: dnnl::batch_normalization_forward/backward through
// the C++ API on plain `nhwc` / `nchw` memory, f32 or bf16 data with f32 scale, shift and
// statistics, the same epsilon and the same case list as fbn_bench.
//
//   fwd_train : forward_training,  use_scale | use_shift
//   fwd_infer : forward_inference, use_global_stats | use_scale | use_shift
//   grad_train: backward,          use_scale | use_shift            (diff_src, diff_scale,
//   diff_shift) grad_infer: backward,          use_global_stats | use_scale | use_shift   (frozen
//   batch norm)
//
// The thread count is the OpenMP/TBB runtime's: run with OMP_NUM_THREADS=2 (the driver does).
//
//   onednn_bench [--cases=FILE] [benchmark flags]
//   onednn_bench --parity_dir=DIR --parity_shape=N,C,H,W
#include <benchmark/benchmark.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <unordered_map>
#include <vector>

#include "bench_util.h"
#include "case_timing.h"

namespace {

using dnnl::memory;
using dnnl::normalization_flags;
using dnnl::prop_kind;
using fbn_bench::Buffer;
using fbn_bench::Case;
using fbn_bench::Dtype;
using fbn_bench::Layout;
using fbn_bench::Pass;

constexpr float kEpsilon = 1e-3f;
bool g_failed = false;

dnnl::engine& Engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

class DnnlProblem {
 public:
  DnnlProblem(const Case& c, const std::string& parity_dir) : c_(c), stream_(Engine()) {
    const size_t tb = c.tensor_bytes(), cb = static_cast<size_t>(c.c) * 4;
    x_ = parity_dir.empty() ? fbn_bench::SharedInput(c.elements(), c.dtype, 0) : Buffer(tb);
    y_ = Buffer(tb);  // dst, or diff_src for the gradient
    scale_ = Buffer(cb);
    shift_ = Buffer(cb);
    mean_ = Buffer(cb);
    var_ = Buffer(cb);
    dscale_ = Buffer(cb);
    dshift_ = Buffer(cb);
    if (fbn_bench::IsGrad(c.pass)) {
      dy_ = parity_dir.empty() ? fbn_bench::SharedInput(c.elements(), c.dtype, 1) : Buffer(tb);
    }
    if (parity_dir.empty()) {
      fbn_bench::FillUniform(scale_.data(), c.c, Dtype::kF32, 0.5f, 1.5f, 3);
      fbn_bench::FillUniform(shift_.data(), c.c, Dtype::kF32, -0.5f, 0.5f, 4);
      fbn_bench::FillUniform(mean_.data(), c.c, Dtype::kF32, 0.0f, 1.0f, 5);
      fbn_bench::FillUniform(var_.data(), c.c, Dtype::kF32, 1.0f, 3.0f, 6);
    } else {
      const std::string in = parity_dir + "/in_" + fbn_bench::DtypeName(c.dtype) + "_" +
                             fbn_bench::LayoutName(c.layout) + "_";
      // The gradient's statistics: the saved batch stats in training, the population ones frozen.
      const bool saved = c.pass == Pass::kGradTrain;
      bool ok = fbn_bench::ReadFile(in + "x.bin", x_.data(), tb);
      if (dy_.data()) ok = ok && fbn_bench::ReadFile(in + "dy.bin", dy_.data(), tb);
      ok = ok && fbn_bench::ReadFile(parity_dir + "/scale.bin", scale_.data(), cb) &&
           fbn_bench::ReadFile(parity_dir + "/offset.bin", shift_.data(), cb) &&
           fbn_bench::ReadFile(parity_dir + (saved ? "/smean.bin" : "/mean.bin"), mean_.data(),
                               cb) &&
           fbn_bench::ReadFile(parity_dir + (saved ? "/svar.bin" : "/var.bin"), var_.data(), cb);
      if (!ok) error_ = "cannot read parity inputs under " + parity_dir;
    }
    try {
      Build(parity_dir.empty());
    } catch (const dnnl::error& e) {
      error_ = std::string("oneDNN: ") + e.what();
    }
  }

  const std::string& error() const { return error_; }
  const std::string& impl() const { return impl_; }

  void Run() {
    primitive_.execute(stream_, args_);
    stream_.wait();
  }

  // Run() for the first call of a case, turning oneDNN's exceptions into error().
  void TryRun() {
    try {
      Run();
    } catch (const dnnl::error& e) {
      error_ = std::string("oneDNN execute: ") + e.what();
    }
  }

  void Flush() const {
    for (const Buffer* b : {&x_, &y_, &dy_, &scale_, &shift_, &mean_, &var_, &dscale_, &dshift_}) {
      if (b->data()) fbn_bench::FlushFromCache(b->data(), b->bytes());
    }
  }

  bool WriteOutputs(const std::string& dir) const {
    const std::string p = dir + "/out_onednn_" + fbn_bench::PassName(c_.pass) + "_" +
                          fbn_bench::DtypeName(c_.dtype) + "_" + fbn_bench::LayoutName(c_.layout) +
                          "_";
    const int64_t n = c_.elements(), ch = c_.c;
    if (fbn_bench::IsGrad(c_.pass)) {
      return fbn_bench::WriteAsF32(p + "dx.f32", y_.data(), n, c_.dtype) &&
             fbn_bench::WriteAsF32(p + "dscale.f32", dscale_.data(), ch, Dtype::kF32) &&
             fbn_bench::WriteAsF32(p + "doffset.f32", dshift_.data(), ch, Dtype::kF32);
    }
    bool ok = fbn_bench::WriteAsF32(p + "y.f32", y_.data(), n, c_.dtype);
    if (c_.pass == Pass::kFwdTrain) {
      ok = ok && fbn_bench::WriteAsF32(p + "mean.f32", mean_.data(), ch, Dtype::kF32) &&
           fbn_bench::WriteAsF32(p + "var.f32", var_.data(), ch, Dtype::kF32);
    }
    return ok;
  }

 private:
  void Build(bool own_saved_stats) {
    dnnl::engine& eng = Engine();
    const memory::dims dims = {c_.n, c_.c, c_.h, c_.w};  // oneDNN dims are always logical NCHW
    const memory::data_type dt =
        c_.dtype == Dtype::kF32 ? memory::data_type::f32 : memory::data_type::bf16;
    const memory::format_tag tag =
        c_.layout == Layout::kNHWC ? memory::format_tag::nhwc : memory::format_tag::nchw;
    const memory::desc md(dims, dt, tag);
    const memory::desc cmd({c_.c}, memory::data_type::f32, memory::format_tag::x);
    const normalization_flags ss = normalization_flags::use_scale | normalization_flags::use_shift;
    const normalization_flags gss = ss | normalization_flags::use_global_stats;
    auto mem = [&](const memory::desc& d, const Buffer& b) { return memory(d, eng, b.data()); };
    const memory x = mem(md, x_), y = mem(md, y_), scale = mem(cmd, scale_),
                 shift = mem(cmd, shift_), mean = mem(cmd, mean_), var = mem(cmd, var_);
    switch (c_.pass) {
      case Pass::kFwdTrain:
      case Pass::kFwdInfer: {
        const bool train = c_.pass == Pass::kFwdTrain;
        dnnl::batch_normalization_forward::primitive_desc pd(
            eng, train ? prop_kind::forward_training : prop_kind::forward_inference, md, md,
            kEpsilon, train ? ss : gss);
        impl_ = pd.impl_info_str();
        primitive_ = dnnl::batch_normalization_forward(pd);
        args_ = {{DNNL_ARG_SRC, x},       {DNNL_ARG_DST, y},     {DNNL_ARG_SCALE, scale},
                 {DNNL_ARG_SHIFT, shift}, {DNNL_ARG_MEAN, mean}, {DNNL_ARG_VARIANCE, var}};
        break;
      }
      case Pass::kGradTrain:
      case Pass::kGradInfer: {
        const bool train = c_.pass == Pass::kGradTrain;
        dnnl::batch_normalization_forward::primitive_desc hint(eng, prop_kind::forward_training, md,
                                                               md, kEpsilon, train ? ss : gss);
        if (train && own_saved_stats) {
          // Saved statistics from a training forward of this x (into y, overwritten later).
          dnnl::batch_normalization_forward(hint).execute(stream_, {{DNNL_ARG_SRC, x},
                                                                    {DNNL_ARG_DST, y},
                                                                    {DNNL_ARG_SCALE, scale},
                                                                    {DNNL_ARG_SHIFT, shift},
                                                                    {DNNL_ARG_MEAN, mean},
                                                                    {DNNL_ARG_VARIANCE, var}});
          stream_.wait();
        }
        dnnl::batch_normalization_backward::primitive_desc pd(eng, prop_kind::backward, md, md, md,
                                                              kEpsilon, train ? ss : gss, hint);
        impl_ = pd.impl_info_str();
        primitive_ = dnnl::batch_normalization_backward(pd);
        args_ = {{DNNL_ARG_SRC, x},
                 {DNNL_ARG_DIFF_DST, mem(md, dy_)},
                 {DNNL_ARG_MEAN, mean},
                 {DNNL_ARG_VARIANCE, var},
                 {DNNL_ARG_SCALE, scale},
                 {DNNL_ARG_DIFF_SRC, y},
                 {DNNL_ARG_DIFF_SCALE, mem(cmd, dscale_)},
                 {DNNL_ARG_DIFF_SHIFT, mem(cmd, dshift_)}};
        break;
      }
    }
  }

  Case c_;
  std::string error_, impl_;
  dnnl::stream stream_;
  Buffer x_, y_, dy_, scale_, shift_, mean_, var_, dscale_, dshift_;
  dnnl::primitive primitive_;
  std::unordered_map<int, memory> args_;
};

DnnlProblem* GetProblem(const Case& c) {
  static std::unique_ptr<DnnlProblem> problem;
  static std::string key;
  const std::string k = c.BenchmarkName("onednn");
  if (key != k) {
    problem.reset();
    problem = std::make_unique<DnnlProblem>(c, "");
    key = k;
    const int warmups = c.tensor_bytes() <= (64u << 20) ? 2 : 1;  // as fbn_bench
    for (int i = 0; i < warmups && problem->error().empty(); ++i) problem->TryRun();
  }
  return problem.get();
}

void BM_Onednn(benchmark::State& state, Case c) {
  DnnlProblem* p = GetProblem(c);
  if (!p->error().empty()) {
    state.SkipWithError(p->error().c_str());
    g_failed = true;
    return;
  }
  state.SetLabel(p->impl());
  fbn_bench::TimeCalls(
      state, c, [p] { p->Run(); }, [p] { p->Flush(); });
}

int RunParity(const std::string& dir, const std::string& shape) {
  Case base;
  if (std::sscanf(shape.c_str(), "%ld,%ld,%ld,%ld", &base.n, &base.c, &base.h, &base.w) != 4) {
    std::fprintf(stderr, "bad --parity_shape=%s (want N,C,H,W)\n", shape.c_str());
    return 2;
  }
  int failures = 0;
  for (Dtype d : {Dtype::kF32, Dtype::kBF16}) {
    for (Layout l : {Layout::kNHWC, Layout::kNCHW}) {
      for (Pass p : {Pass::kFwdTrain, Pass::kFwdInfer, Pass::kGradTrain, Pass::kGradInfer}) {
        Case c = base;
        c.id = "parity";
        c.pass = p;
        c.dtype = d;
        c.layout = l;
        DnnlProblem prob(c, dir);
        if (prob.error().empty()) prob.TryRun();
        if (!prob.error().empty() || !prob.WriteOutputs(dir)) {
          std::fprintf(stderr, "parity %s: %s\n", c.BenchmarkName("onednn").c_str(),
                       prob.error().c_str());
          ++failures;
        }
      }
    }
  }
  return failures == 0 ? 0 : 1;
}

// The OpenMP runtime's thread count, looked up without linking the runtime ourselves.
int RuntimeThreads() {
  using Fn = int (*)();
  auto fn = reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, "omp_get_max_threads"));
  return fn ? fn() : -1;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string cases_path = fbn_bench::TakeFlag(&argc, argv, "cases", "");
  const std::string parity_dir = fbn_bench::TakeFlag(&argc, argv, "parity_dir", "");
  const std::string parity_shape = fbn_bench::TakeFlag(&argc, argv, "parity_shape", "2,32,7,7");
  try {
    (void)Engine();
  } catch (const dnnl::error& e) {
    std::fprintf(stderr, "cannot create a oneDNN CPU engine: %s\n", e.what());
    return 3;
  }
  if (!parity_dir.empty()) return RunParity(parity_dir, parity_shape);

  std::vector<Case> cases;
  std::string error;
  if (cases_path.empty() || !fbn_bench::ReadCases(cases_path, &cases, &error)) {
    std::fprintf(stderr, "%s\n", cases_path.empty() ? "--cases=FILE is required" : error.c_str());
    return 2;
  }
  for (const Case& c : cases) {
    fbn_bench::RegisterCase("onednn", c, BM_Onednn);
  }
  const dnnl_version_t* v = dnnl_version();
  benchmark::AddCustomContext("library", "onednn");
  benchmark::AddCustomContext("onednn_version",
                              std::to_string(v->major) + "." + std::to_string(v->minor) + "." +
                                  std::to_string(v->patch) + " (" + v->hash + ")");
  benchmark::AddCustomContext("onednn_cpu_runtime", std::to_string(v->cpu_runtime));
  benchmark::AddCustomContext("onednn_threads", std::to_string(RuntimeThreads()));
  benchmark::AddCustomContext("cpu_model", fbn_bench::CpuModelName());
  benchmark::AddCustomContext("caches", fbn_bench::CacheSizesString());
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return g_failed ? 1 : 0;
}
