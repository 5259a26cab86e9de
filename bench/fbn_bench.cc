// fbn's side of the side-by-side benchmark: FusedBatchNorm / FusedBatchNormGrad (OpVersion::kV3)
// through the public C++ API, on preallocated outputs, with fbn::SetNumThreads(--threads).
//
//   fbn_bench [--cases=FILE] [--threads=2] [benchmark flags]
//   fbn_bench --parity_dir=DIR --parity_shape=N,C,H,W
//
// Without --cases it runs a built-in smoke set (one small shape, every pass, dtype and layout).
// Cases and parity files are written by bench/run_bench.py; see bench/README.md.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "bench_util.h"
#include "case_timing.h"
#include "fbn/fbn.h"

namespace {

using fbn_bench::Buffer;
using fbn_bench::Case;
using fbn_bench::Dtype;
using fbn_bench::Layout;
using fbn_bench::Pass;

constexpr float kEpsilon = 1e-3f;  // the same epsilon in every library of the comparison
bool g_failed = false;

fbn::DataType ToFbn(Dtype d) {
  return d == Dtype::kF32 ? fbn::DataType::kFloat32 : fbn::DataType::kBFloat16;
}
fbn::TensorFormat ToFbn(Layout l) {
  return l == Layout::kNHWC ? fbn::TensorFormat::kNHWC : fbn::TensorFormat::kNCHW;
}

size_t SpecBytes(const fbn::TensorSpec& s) {
  return static_cast<size_t>(s.shape.num_elements()) * fbn::DataTypeSize(s.dtype);
}

// Every buffer of one case, built once and reused by all repetitions of that case.
class FbnProblem {
 public:
  // Inputs come from `parity_dir` when given (the driver's shared files), else from a
  // deterministic fill.
  FbnProblem(const Case& c, const std::string& parity_dir) : c_(c) {
    const std::vector<int64_t> d = c.dims();
    x_shape_ = fbn::Shape(d.data(), 4);
    c_shape_ = fbn::Shape({c.c});
    const fbn::DataType dt = ToFbn(c.dtype);
    const size_t tb = c.tensor_bytes(), cb = static_cast<size_t>(c.c) * 4;
    x_ = parity_dir.empty() ? fbn_bench::SharedInput(c.elements(), c.dtype, 0) : Buffer(tb);
    scale_ = Buffer(cb);
    offset_ = Buffer(cb);
    mean_ = Buffer(cb);
    var_ = Buffer(cb);
    saved_mean_ = Buffer(cb);
    saved_var_ = Buffer(cb);
    if (fbn_bench::IsGrad(c.pass)) {
      dy_ = parity_dir.empty() ? fbn_bench::SharedInput(c.elements(), c.dtype, 1) : Buffer(tb);
    }
    if (parity_dir.empty()) {
      fbn_bench::FillUniform(scale_.data(), c.c, Dtype::kF32, 0.5f, 1.5f, 3);
      fbn_bench::FillUniform(offset_.data(), c.c, Dtype::kF32, -0.5f, 0.5f, 4);
      fbn_bench::FillUniform(mean_.data(), c.c, Dtype::kF32, 0.0f, 1.0f, 5);
      fbn_bench::FillUniform(var_.data(), c.c, Dtype::kF32, 1.0f, 3.0f, 6);
    } else {
      const std::string in = parity_dir + "/in_" + fbn_bench::DtypeName(c.dtype) + "_" +
                             fbn_bench::LayoutName(c.layout) + "_";
      bool ok = fbn_bench::ReadFile(in + "x.bin", x_.data(), tb);
      if (dy_.data()) ok = ok && fbn_bench::ReadFile(in + "dy.bin", dy_.data(), tb);
      ok = ok && fbn_bench::ReadFile(parity_dir + "/scale.bin", scale_.data(), cb) &&
           fbn_bench::ReadFile(parity_dir + "/offset.bin", offset_.data(), cb) &&
           fbn_bench::ReadFile(parity_dir + "/mean.bin", mean_.data(), cb) &&
           fbn_bench::ReadFile(parity_dir + "/var.bin", var_.data(), cb) &&
           fbn_bench::ReadFile(parity_dir + "/smean.bin", saved_mean_.data(), cb) &&
           fbn_bench::ReadFile(parity_dir + "/svar.bin", saved_var_.data(), cb);
      if (!ok) error_ = "cannot read parity inputs under " + parity_dir;
    }

    // Forward: inputs, attributes and outputs allocated from the op's own output specs.
    fin_.x = {x_.data(), dt, x_shape_};
    fin_.scale = {scale_.data(), fbn::DataType::kFloat32, c_shape_};
    fin_.offset = {offset_.data(), fbn::DataType::kFloat32, c_shape_};
    fin_.mean = {mean_.data(), fbn::DataType::kFloat32, c_shape_};
    fin_.variance = {var_.data(), fbn::DataType::kFloat32, c_shape_};
    fattrs_.epsilon = kEpsilon;
    fattrs_.data_format = ToFbn(c.layout);
    fattrs_.is_training = c.pass != Pass::kFwdInfer;  // grad_train takes a training forward's stats
    fattrs_.exponential_avg_factor = 1.0f;
    fbn::TensorSpec specs[fbn::kMaxOpOutputs];
    int num = 0;
    if (!Check(fbn::FusedBatchNormOutputSpecs(fbn::OpVersion::kV3, fin_, fattrs_, specs, &num))) {
      return;
    }
    fbn::TensorView* fviews[] = {&fout_.y,
                                 &fout_.batch_mean,
                                 &fout_.batch_variance,
                                 &fout_.reserve_space_1,
                                 &fout_.reserve_space_2,
                                 &fout_.reserve_space_3};
    for (int i = 0; i < num; ++i) {
      // The gradient passes need only the small outputs of a forward (saved stats).
      const bool skip_y = i == 0 && fbn_bench::IsGrad(c.pass);
      fwd_out_.emplace_back(skip_y ? 64 : SpecBytes(specs[i]));
      *fviews[i] = {fwd_out_.back().data(), specs[i].dtype, specs[i].shape};
    }
    if (!fbn_bench::IsGrad(c.pass)) return;

    // The gradient's saved statistics: the driver's reference values for parity, else a
    // training forward's (written into a scratch y that is then dropped).
    Buffer scratch_y;
    if (c.pass == Pass::kGradTrain && parity_dir.empty()) {
      scratch_y = Buffer(tb);
      fbn::FusedBatchNormOutputs o = fout_;
      o.y.data = scratch_y.data();
      if (!Check(fbn::FusedBatchNorm(fbn::OpVersion::kV3, fin_, fattrs_, o))) return;
      std::memcpy(saved_mean_.data(), fout_.reserve_space_1.data, cb);
      std::memcpy(saved_var_.data(), fout_.reserve_space_2.data, cb);
    }
    const bool train = c.pass == Pass::kGradTrain;
    gin_.y_backprop = {dy_.data(), dt, x_shape_};
    gin_.x = fin_.x;
    gin_.scale = fin_.scale;
    gin_.reserve_space_1 = {train ? saved_mean_.data() : mean_.data(), fbn::DataType::kFloat32,
                            c_shape_};
    gin_.reserve_space_2 = {train ? saved_var_.data() : var_.data(), fbn::DataType::kFloat32,
                            c_shape_};
    gin_.reserve_space_3 = fout_.reserve_space_3;
    gattrs_.epsilon = kEpsilon;
    gattrs_.data_format = ToFbn(c.layout);
    gattrs_.is_training = train;
    if (!Check(
            fbn::FusedBatchNormGradOutputSpecs(fbn::OpVersion::kV3, gin_, gattrs_, specs, &num))) {
      return;
    }
    fbn::TensorView* gviews[] = {&gout_.x_backprop, &gout_.scale_backprop, &gout_.offset_backprop,
                                 &gout_.reserve_space_a, &gout_.reserve_space_b};
    for (int i = 0; i < num && i < 5; ++i) {
      grad_out_.emplace_back(SpecBytes(specs[i]));
      *gviews[i] = {grad_out_.back().data(), specs[i].dtype, specs[i].shape};
    }
  }

  const std::string& error() const { return error_; }

  fbn::Status Run() const {
    if (fbn_bench::IsGrad(c_.pass)) {
      return fbn::FusedBatchNormGrad(fbn::OpVersion::kV3, gin_, gattrs_, gout_);
    }
    return fbn::FusedBatchNorm(fbn::OpVersion::kV3, fin_, fattrs_, fout_);
  }

  // Cold runs: every operand the call touches leaves the caches.
  void Flush() const {
    fbn_bench::FlushFromCache(x_.data(), x_.bytes());
    if (dy_.data()) fbn_bench::FlushFromCache(dy_.data(), dy_.bytes());
    for (const Buffer& b : fwd_out_) fbn_bench::FlushFromCache(b.data(), b.bytes());
    for (const Buffer& b : grad_out_) fbn_bench::FlushFromCache(b.data(), b.bytes());
    for (const Buffer* b : {&scale_, &offset_, &mean_, &var_, &saved_mean_, &saved_var_}) {
      fbn_bench::FlushFromCache(b->data(), b->bytes());
    }
  }

  // Writes this pass's outputs as float32 files named out_fbn_<pass>_<dtype>_<layout>_<what>.
  bool WriteOutputs(const std::string& dir) const {
    const std::string p = dir + "/out_fbn_" + fbn_bench::PassName(c_.pass) + "_" +
                          fbn_bench::DtypeName(c_.dtype) + "_" + fbn_bench::LayoutName(c_.layout) +
                          "_";
    const int64_t n = c_.elements(), ch = c_.c;
    if (fbn_bench::IsGrad(c_.pass)) {
      return fbn_bench::WriteAsF32(p + "dx.f32", gout_.x_backprop.data, n, c_.dtype) &&
             fbn_bench::WriteAsF32(p + "dscale.f32", gout_.scale_backprop.data, ch, Dtype::kF32) &&
             fbn_bench::WriteAsF32(p + "doffset.f32", gout_.offset_backprop.data, ch, Dtype::kF32);
    }
    bool ok = fbn_bench::WriteAsF32(p + "y.f32", fout_.y.data, n, c_.dtype);
    if (c_.pass == Pass::kFwdTrain) {
      ok = ok &&
           fbn_bench::WriteAsF32(p + "mean.f32", fout_.reserve_space_1.data, ch, Dtype::kF32) &&
           fbn_bench::WriteAsF32(p + "var.f32", fout_.reserve_space_2.data, ch, Dtype::kF32);
    }
    return ok;
  }

 private:
  bool Check(const fbn::Status& s) {
    if (!s.ok()) error_ = s.ToString();
    return s.ok();
  }

  Case c_;
  std::string error_;
  fbn::Shape x_shape_, c_shape_;
  Buffer x_, dy_, scale_, offset_, mean_, var_, saved_mean_, saved_var_;
  std::vector<Buffer> fwd_out_, grad_out_;
  fbn::FusedBatchNormInputs fin_;
  fbn::FusedBatchNormOutputs fout_;
  fbn::FusedBatchNormAttrs fattrs_;
  fbn::FusedBatchNormGradInputs gin_;
  fbn::FusedBatchNormGradOutputs gout_;
  fbn::FusedBatchNormGradAttrs gattrs_;
};

// One problem alive at a time: Google Benchmark runs all repetitions of a case back to back.
FbnProblem* GetProblem(const Case& c, fbn::Status* first) {
  static std::unique_ptr<FbnProblem> problem;
  static std::string key;
  static fbn::Status status;
  const std::string k = c.BenchmarkName("fbn");
  if (key != k) {
    problem.reset();  // free the previous case's buffers before allocating the next
    problem = std::make_unique<FbnProblem>(c, "");
    key = k;
    // Untimed calls: first touch of the outputs and thread-pool start-up (one is enough for a
    // tensor that takes a quarter second per call).
    status = problem->error().empty() ? problem->Run() : fbn::InvalidArgument(problem->error());
    if (status.ok() && c.tensor_bytes() <= (64u << 20)) status = problem->Run();
  }
  *first = status;
  return problem.get();
}

void BM_Fbn(benchmark::State& state, Case c) {
  fbn::Status s;
  FbnProblem* p = GetProblem(c, &s);
  if (!s.ok()) {
    state.SkipWithError(s.ToString().c_str());
    g_failed = true;
    return;
  }
  fbn_bench::TimeCalls(
      state, c,
      [p, &s] {
        s = p->Run();
        benchmark::DoNotOptimize(s);
      },
      [p] { p->Flush(); });
}

std::vector<Case> SmokeCases() {
  std::vector<Case> out;
  for (Dtype d : {Dtype::kF32, Dtype::kBF16}) {
    for (Layout l : {Layout::kNHWC, Layout::kNCHW}) {
      for (Pass p : {Pass::kFwdTrain, Pass::kFwdInfer, Pass::kGradTrain, Pass::kGradInfer}) {
        Case c;
        c.id = "smoke_mb2ic32ih7iw7";
        c.pass = p;
        c.dtype = d;
        c.layout = l;
        c.n = 2;
        c.c = 32;
        c.h = c.w = 7;
        c.reps = 0;  // 0: take --benchmark_repetitions / --benchmark_min_time from the command line
        c.min_time = 0;
        out.push_back(c);
      }
    }
  }
  return out;
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
        FbnProblem prob(c, dir);
        fbn::Status s = prob.error().empty() ? prob.Run() : fbn::InvalidArgument(prob.error());
        if (!s.ok() || !prob.WriteOutputs(dir)) {
          std::fprintf(stderr, "parity %s: %s\n", c.BenchmarkName("fbn").c_str(),
                       s.ToString().c_str());
          ++failures;
        }
      }
    }
  }
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string cases_path = fbn_bench::TakeFlag(&argc, argv, "cases", "");
  const int threads = std::stoi(fbn_bench::TakeFlag(&argc, argv, "threads", "2"));
  const std::string parity_dir = fbn_bench::TakeFlag(&argc, argv, "parity_dir", "");
  const std::string parity_shape = fbn_bench::TakeFlag(&argc, argv, "parity_shape", "2,32,7,7");
  fbn::SetNumThreads(threads);
  if (!parity_dir.empty()) return RunParity(parity_dir, parity_shape);

  std::vector<Case> cases;
  if (cases_path.empty()) {
    cases = SmokeCases();
  } else {
    std::string error;
    if (!fbn_bench::ReadCases(cases_path, &cases, &error)) {
      std::fprintf(stderr, "%s\n", error.c_str());
      return 2;
    }
  }
  for (const Case& c : cases) {
    fbn_bench::RegisterCase("fbn", c, BM_Fbn);
  }
  benchmark::AddCustomContext("library", "fbn");
  benchmark::AddCustomContext("fbn_version", FBN_VERSION_STRING);
  benchmark::AddCustomContext("fbn_threads", std::to_string(fbn::GetNumThreads()));
  benchmark::AddCustomContext("cpu_model", fbn_bench::CpuModelName());
  benchmark::AddCustomContext("caches", fbn_bench::CacheSizesString());
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return g_failed ? 1 : 0;
}
