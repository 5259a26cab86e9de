// Concurrency stress test of fbn's public API: many std::threads call every op at once, on
// different shapes, dtypes and formats, while another thread keeps changing SetNumThreads. Every
// result must be bit-identical to the one computed serially on one thread. Built with the normal
// tests; scripts/fuzz.sh tsan runs it (and the other C++ tests) under ThreadSanitizer.
//
// FBN_STRESS_ROUNDS (default 20) sets how many passes over all cases each caller thread makes.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "fbn/fbn.h"

namespace {

using fbn::DataType;
using fbn::OpVersion;
using fbn::Shape;
using fbn::TensorFormat;

int StressRounds() {
  const char* env = std::getenv("FBN_STRESS_ROUNDS");
  const int n = env ? std::atoi(env) : 0;
  return n > 0 ? n : 20;
}

// Aborts with a message when `progress` stops moving for `seconds` (a hang inside fbn).
class Watchdog {
 public:
  Watchdog(const std::atomic<int64_t>* progress, int seconds)
      : thread_([this, progress, seconds] {
          int64_t last = progress->load();
          for (int idle = 0; !done_.load();) {
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
            const int64_t now = progress->load();
            idle = now == last ? idle + 1 : 0;
            last = now;
            if (idle > seconds * 10) {
              std::fprintf(stderr,
                           "concurrency test: no progress for %d s after %lld calls: hang\n",
                           seconds, static_cast<long long>(now));
              std::abort();
            }
          }
        }) {}
  ~Watchdog() {
    done_.store(true);
    thread_.join();
  }

 private:
  std::atomic<bool> done_{false};
  std::thread thread_;
};

// An owned, dense buffer of `dtype` values with a shape.
struct Buffer {
  DataType dtype = DataType::kFloat32;
  Shape shape;
  std::vector<unsigned char> bytes;

  Buffer() = default;
  Buffer(DataType t, Shape s) : dtype(t), shape(s) {
    bytes.assign(static_cast<size_t>(s.num_elements()) * fbn::DataTypeSize(t), 0);
  }
  fbn::TensorView view() {
    return fbn::TensorView{bytes.empty() ? nullptr : bytes.data(), dtype, shape};
  }
  fbn::ConstTensorView cview() const {
    return fbn::ConstTensorView{bytes.empty() ? nullptr : bytes.data(), dtype, shape};
  }
};

uint16_t ToHalfBits(float f) {
  // Round-to-nearest-even float -> binary16 for the finite, normal range used here.
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  int32_t exp = static_cast<int32_t>((u >> 23) & 0xFF) - 127 + 15;
  uint32_t mant = u & 0x7FFFFFu;
  if (exp <= 0) return static_cast<uint16_t>(sign);
  uint32_t h = (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

// Random values in [lo, hi) stored as `b.dtype`.
void FillRandom(Buffer* b, std::mt19937* rng, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  const int64_t n = b->shape.num_elements();
  for (int64_t i = 0; i < n; ++i) {
    const float v = dist(*rng);
    unsigned char* p = b->bytes.data() + static_cast<size_t>(i) * fbn::DataTypeSize(b->dtype);
    switch (b->dtype) {
      case DataType::kFloat16: {
        const uint16_t h = ToHalfBits(v);
        std::memcpy(p, &h, 2);
        break;
      }
      case DataType::kBFloat16: {
        uint32_t u;
        std::memcpy(&u, &v, 4);
        const uint16_t h = static_cast<uint16_t>(u >> 16);
        std::memcpy(p, &h, 2);
        break;
      }
      case DataType::kFloat32:
        std::memcpy(p, &v, 4);
        break;
      case DataType::kFloat64: {
        const double d = v;
        std::memcpy(p, &d, 8);
        break;
      }
    }
  }
}

DataType StatsType(DataType t) {
  return t == DataType::kFloat64 ? DataType::kFloat64 : DataType::kFloat32;
}

Shape MakeX(TensorFormat f, int64_t n, int64_t c, int64_t h, int64_t w, int64_t d = 0) {
  switch (f) {
    case TensorFormat::kNHWC:
      return Shape{n, h, w, c};
    case TensorFormat::kNCHW:
      return Shape{n, c, h, w};
    case TensorFormat::kNDHWC:
      return Shape{n, d, h, w, c};
    case TensorFormat::kNCDHW:
      return Shape{n, c, d, h, w};
  }
  return Shape{};
}

// One op call on fixed inputs. Run() writes the outputs into fresh buffers and returns their
// bytes concatenated, or "" with `error` set on failure.
struct Case {
  std::string name;
  std::function<std::vector<unsigned char>(std::string* error)> run;
};

std::vector<unsigned char> Concat(const std::vector<Buffer*>& outs) {
  std::vector<unsigned char> all;
  for (const Buffer* b : outs) all.insert(all.end(), b->bytes.begin(), b->bytes.end());
  return all;
}

Case ForwardCase(OpVersion v, DataType t, TensorFormat f, Shape x_shape, bool training,
                 float factor, uint32_t seed) {
  auto x = std::make_shared<Buffer>(t, x_shape);
  const bool last = f == TensorFormat::kNHWC || f == TensorFormat::kNDHWC;
  const int64_t c = last ? x_shape.dim(x_shape.rank() - 1) : x_shape.dim(1);
  const DataType u = v == OpVersion::kV1 ? t : StatsType(t);
  auto p = std::make_shared<std::vector<Buffer>>(4, Buffer(u, Shape{c}));
  std::mt19937 rng(seed);
  FillRandom(x.get(), &rng, -3.0f, 5.0f);
  FillRandom(&(*p)[0], &rng, 0.5f, 2.0f);
  FillRandom(&(*p)[1], &rng, -1.0f, 1.0f);
  FillRandom(&(*p)[2], &rng, -1.0f, 1.0f);
  FillRandom(&(*p)[3], &rng, 0.5f, 3.0f);
  std::string name = std::string(fbn::FusedBatchNormOpName(v)) + "_" + fbn::DataTypeName(t) + "_" +
                     fbn::TensorFormatName(f) + "_" + x_shape.DebugString() +
                     (training ? "_train" : "_infer");
  return Case{name, [=](std::string* error) {
                fbn::FusedBatchNormAttrs attrs;
                attrs.epsilon = 1e-3f;
                attrs.exponential_avg_factor = factor;
                attrs.data_format = f;
                attrs.is_training = training;
                Buffer y(t, x_shape), m(u, Shape{c}), var(u, Shape{c}), r1(u, Shape{c}),
                    r2(u, Shape{c}), r3(u, Shape{});
                const fbn::FusedBatchNormInputs in{x->cview(), (*p)[0].cview(), (*p)[1].cview(),
                                                   (*p)[2].cview(), (*p)[3].cview()};
                const fbn::Status s = fbn::FusedBatchNorm(
                    v, in, attrs,
                    {y.view(), m.view(), var.view(), r1.view(), r2.view(), r3.view()});
                if (!s.ok()) {
                  *error = s.ToString();
                  return std::vector<unsigned char>();
                }
                std::vector<Buffer*> outs = {&y, &m, &var, &r1, &r2};
                if (v == OpVersion::kV3) outs.push_back(&r3);
                return Concat(outs);
              }};
}

Case GradCase(OpVersion v, DataType t, TensorFormat f, Shape x_shape, bool training,
              uint32_t seed) {
  auto x = std::make_shared<Buffer>(t, x_shape);
  auto dy = std::make_shared<Buffer>(t, x_shape);
  const bool last = f == TensorFormat::kNHWC || f == TensorFormat::kNDHWC;
  const int64_t c = last ? x_shape.dim(x_shape.rank() - 1) : x_shape.dim(1);
  const DataType u = v == OpVersion::kV1 ? t : StatsType(t);
  auto p = std::make_shared<std::vector<Buffer>>(3, Buffer(u, Shape{c}));
  std::mt19937 rng(seed);
  FillRandom(x.get(), &rng, -2.0f, 2.0f);
  FillRandom(dy.get(), &rng, -1.0f, 1.0f);
  FillRandom(&(*p)[0], &rng, 0.5f, 2.0f);
  FillRandom(&(*p)[1], &rng, -0.2f, 0.2f);
  FillRandom(&(*p)[2], &rng, 0.5f, 2.0f);
  std::string name = std::string(fbn::FusedBatchNormGradOpName(v)) + "_" + fbn::DataTypeName(t) +
                     "_" + fbn::TensorFormatName(f) + "_" + x_shape.DebugString() +
                     (training ? "_train" : "_infer");
  return Case{
      name, [=](std::string* error) {
        fbn::FusedBatchNormGradAttrs attrs;
        attrs.epsilon = 1e-3f;
        attrs.data_format = f;
        attrs.is_training = training;
        Buffer dx(t, x_shape), ds(u, Shape{c}), doff(u, Shape{c}), ra(u, Shape{0}), rb(u, Shape{0});
        Buffer r3(u, Shape{0});
        const fbn::FusedBatchNormGradInputs in{dy->cview(),     x->cview(),      (*p)[0].cview(),
                                               (*p)[1].cview(), (*p)[2].cview(), r3.cview()};
        const fbn::Status s = fbn::FusedBatchNormGrad(
            v, in, attrs, {dx.view(), ds.view(), doff.view(), ra.view(), rb.view()});
        if (!s.ok()) {
          *error = s.ToString();
          return std::vector<unsigned char>();
        }
        return Concat({&dx, &ds, &doff});
      }};
}

Case MomentsCase(DataType t, Shape x_shape, std::vector<int> axes, bool keepdims, uint32_t seed) {
  auto x = std::make_shared<Buffer>(t, x_shape);
  std::mt19937 rng(seed);
  FillRandom(x.get(), &rng, -4.0f, 4.0f);
  return Case{std::string("Moments_") + fbn::DataTypeName(t) + "_" + x_shape.DebugString(),
              [=](std::string* error) {
                fbn::TensorSpec spec;
                fbn::Status s = fbn::MomentsOutputSpec(
                    x->cview(), axes.data(), static_cast<int>(axes.size()), keepdims, &spec);
                if (!s.ok()) {
                  *error = s.ToString();
                  return std::vector<unsigned char>();
                }
                Buffer m(spec.dtype, spec.shape), var(spec.dtype, spec.shape);
                s = fbn::Moments(x->cview(), axes.data(), static_cast<int>(axes.size()), keepdims,
                                 m.view(), var.view());
                if (!s.ok()) {
                  *error = s.ToString();
                  return std::vector<unsigned char>();
                }
                return Concat({&m, &var});
              }};
}

Case BatchNormalizationCase(DataType t, Shape x_shape, Shape p_shape, uint32_t seed) {
  auto x = std::make_shared<Buffer>(t, x_shape);
  auto p = std::make_shared<std::vector<Buffer>>(4, Buffer(t, p_shape));
  std::mt19937 rng(seed);
  FillRandom(x.get(), &rng, -3.0f, 3.0f);
  FillRandom(&(*p)[0], &rng, -1.0f, 1.0f);
  FillRandom(&(*p)[1], &rng, 0.5f, 2.0f);
  FillRandom(&(*p)[2], &rng, -1.0f, 1.0f);
  FillRandom(&(*p)[3], &rng, 0.5f, 2.0f);
  return Case{
      std::string("BatchNormalization_") + fbn::DataTypeName(t) + "_" + x_shape.DebugString(),
      [=](std::string* error) {
        Buffer y(t, x_shape);
        const fbn::Status s =
            fbn::BatchNormalization(x->cview(), (*p)[0].cview(), (*p)[1].cview(), (*p)[2].cview(),
                                    (*p)[3].cview(), 1e-3f, y.view());
        if (!s.ok()) {
          *error = s.ToString();
          return std::vector<unsigned char>();
        }
        return Concat({&y});
      }};
}

// A mix of shapes large enough for the thread pool (above ~192 KB of traffic) and small ones that
// run inline, over every op, dtype and layout family.
std::vector<Case> AllCases() {
  std::vector<Case> cases;
  uint32_t seed = 1;
  using TF = TensorFormat;
  cases.push_back(ForwardCase(OpVersion::kV3, DataType::kFloat32, TF::kNHWC,
                              MakeX(TF::kNHWC, 8, 32, 16, 16), true, 1.0f, seed++));
  cases.push_back(ForwardCase(OpVersion::kV3, DataType::kFloat32, TF::kNCHW,
                              MakeX(TF::kNCHW, 4, 16, 32, 32), true, 0.25f, seed++));
  cases.push_back(ForwardCase(OpVersion::kV3, DataType::kFloat32, TF::kNCHW,
                              MakeX(TF::kNCHW, 2, 3, 128, 128), true, 1.0f, seed++));
  cases.push_back(ForwardCase(OpVersion::kV2, DataType::kBFloat16, TF::kNHWC,
                              MakeX(TF::kNHWC, 16, 24, 16, 16), true, 1.0f, seed++));
  cases.push_back(ForwardCase(OpVersion::kV3, DataType::kFloat16, TF::kNCDHW,
                              MakeX(TF::kNCDHW, 2, 8, 16, 16, 16), true, 1.0f, seed++));
  cases.push_back(ForwardCase(OpVersion::kV1, DataType::kFloat32, TF::kNHWC,
                              MakeX(TF::kNHWC, 8, 64, 8, 16), false, 1.0f, seed++));
  cases.push_back(ForwardCase(OpVersion::kV3, DataType::kFloat64, TF::kNDHWC,
                              MakeX(TF::kNDHWC, 2, 16, 8, 8, 16), true, 1.0f, seed++));
  cases.push_back(ForwardCase(OpVersion::kV3, DataType::kFloat32, TF::kNHWC,
                              MakeX(TF::kNHWC, 2, 3, 4, 5), true, 1.0f, seed++));
  cases.push_back(ForwardCase(OpVersion::kV3, DataType::kFloat32, TF::kNHWC,
                              MakeX(TF::kNHWC, 0, 7, 4, 4), true, 1.0f, seed++));
  cases.push_back(GradCase(OpVersion::kV3, DataType::kFloat32, TF::kNHWC,
                           MakeX(TF::kNHWC, 8, 32, 16, 16), true, seed++));
  cases.push_back(GradCase(OpVersion::kV3, DataType::kFloat32, TF::kNCHW,
                           MakeX(TF::kNCHW, 4, 16, 32, 32), true, seed++));
  cases.push_back(GradCase(OpVersion::kV2, DataType::kBFloat16, TF::kNCHW,
                           MakeX(TF::kNCHW, 2, 4, 96, 96), true, seed++));
  cases.push_back(GradCase(OpVersion::kV3, DataType::kFloat32, TF::kNHWC,
                           MakeX(TF::kNHWC, 8, 32, 16, 16), false, seed++));
  cases.push_back(GradCase(OpVersion::kV1, DataType::kFloat64, TF::kNCHW,
                           MakeX(TF::kNCHW, 4, 8, 16, 32), false, seed++));
  cases.push_back(MomentsCase(DataType::kFloat32, Shape{16, 32, 64}, {0, 1}, false, seed++));
  cases.push_back(MomentsCase(DataType::kFloat16, Shape{4, 8, 8, 6}, {0, 2, 3}, true, seed++));
  cases.push_back(BatchNormalizationCase(DataType::kFloat32, Shape{16, 32, 64}, Shape{64}, seed++));
  cases.push_back(BatchNormalizationCase(DataType::kFloat64, Shape{4, 8, 16}, Shape{8, 1}, seed++));
  return cases;
}

struct Reference {
  std::vector<Case> cases;
  std::vector<std::vector<unsigned char>> serial;
};

const Reference& GetReference() {
  static const Reference* ref = [] {
    auto* r = new Reference{AllCases(), {}};
    fbn::SetNumThreads(1);
    for (const Case& c : r->cases) {
      std::string error;
      r->serial.push_back(c.run(&error));
      EXPECT_EQ(error, "") << c.name;
    }
    fbn::SetNumThreads(0);
    return r;
  }();
  return *ref;
}

TEST(Concurrency, SerialResultsDoNotDependOnTheThreadCount) {
  const Reference& ref = GetReference();
  for (int threads : {2, 3, 4, 8}) {
    fbn::SetNumThreads(threads);
    for (size_t i = 0; i < ref.cases.size(); ++i) {
      std::string error;
      EXPECT_TRUE(ref.cases[i].run(&error) == ref.serial[i])
          << ref.cases[i].name << " with " << threads << " threads " << error;
    }
  }
  fbn::SetNumThreads(0);
}

// Caller threads run every case in their own order while SetNumThreads keeps changing.
void RunConcurrently(int callers, bool churn_thread_count) {
  const Reference& ref = GetReference();
  const int rounds = StressRounds();
  std::atomic<int> mismatches{0};
  std::atomic<int> running{callers};
  std::atomic<int64_t> progress{0};
  Watchdog watchdog(&progress, 60);
  std::atomic<bool> stop_churn{false};
  std::vector<std::string> first_error(static_cast<size_t>(callers));
  std::thread churn;
  if (churn_thread_count) {
    churn = std::thread([&] {
      const int counts[] = {1, 2, 3, 4, 8, 0, 16, 2};
      for (int k = 0; !stop_churn.load(); ++k) {
        fbn::SetNumThreads(counts[k % 8]);
        (void)fbn::GetNumThreads();
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    });
  }
  std::vector<std::thread> threads;
  for (int t = 0; t < callers; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(static_cast<uint32_t>(1000 + t));
      std::vector<size_t> order(ref.cases.size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = i;
      for (int r = 0; r < rounds; ++r) {
        std::shuffle(order.begin(), order.end(), rng);
        for (size_t i : order) {
          std::string error;
          const bool same = ref.cases[i].run(&error) == ref.serial[i];
          progress.fetch_add(1);
          if (!same) {
            if (mismatches.fetch_add(1) == 0 || first_error[static_cast<size_t>(t)].empty()) {
              first_error[static_cast<size_t>(t)] = ref.cases[i].name + " " + error;
            }
          }
        }
      }
      running.fetch_sub(1);
    });
  }
  for (auto& th : threads) th.join();
  stop_churn.store(true);
  if (churn.joinable()) churn.join();
  fbn::SetNumThreads(0);
  std::string errors;
  for (const std::string& e : first_error) {
    if (!e.empty()) errors += e + "\n";
  }
  EXPECT_EQ(mismatches.load(), 0) << errors;
}

TEST(Concurrency, ManyCallersMatchSerial) { RunConcurrently(6, false); }

TEST(Concurrency, ManyCallersWhileSetNumThreadsChanges) { RunConcurrently(6, true); }

// One caller, many back-to-back calls: each op runs several ParallelFor phases with different
// thread counts (statistics, then normalization), which is what a training loop does.
TEST(Concurrency, BackToBackCallsFromOneThread) {
  const Reference& ref = GetReference();
  std::atomic<int64_t> progress{0};
  Watchdog watchdog(&progress, 60);
  fbn::SetNumThreads(8);
  int mismatches = 0;
  const int calls = 400 * StressRounds();
  for (int k = 0; k < calls; ++k) {
    const size_t i = static_cast<size_t>(k) % ref.cases.size();
    std::string error;
    if (ref.cases[i].run(&error) != ref.serial[i]) ++mismatches;
    progress.fetch_add(1);
  }
  fbn::SetNumThreads(0);
  EXPECT_EQ(mismatches, 0);
}

// Threads that make one call and exit (their thread_local scratch is freed at exit).
TEST(Concurrency, ShortLivedCallerThreads) {
  const Reference& ref = GetReference();
  fbn::SetNumThreads(4);
  std::atomic<int> mismatches{0};
  for (int wave = 0; wave < 4; ++wave) {
    std::vector<std::thread> threads;
    for (size_t i = 0; i < ref.cases.size(); ++i) {
      threads.emplace_back([&, i] {
        std::string error;
        if (ref.cases[i].run(&error) != ref.serial[i]) mismatches.fetch_add(1);
      });
    }
    for (auto& th : threads) th.join();
  }
  fbn::SetNumThreads(0);
  EXPECT_EQ(mismatches.load(), 0);
}

// Errors from many threads at once: each gets its own, intact message.
TEST(Concurrency, ConcurrentErrorsKeepTheirMessages) {
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        const int64_t c = 2 + t;
        Buffer x(DataType::kFloat32, Shape{1, 2, 2, c});
        Buffer scale(DataType::kFloat32, Shape{c + 1});
        Buffer other(DataType::kFloat32, Shape{c});
        Buffer y(DataType::kFloat32, x.shape), v1(DataType::kFloat32, Shape{c}),
            v2(DataType::kFloat32, Shape{c}), v3(DataType::kFloat32, Shape{c}),
            v4(DataType::kFloat32, Shape{c}), v5(DataType::kFloat32, Shape{});
        const fbn::Status s = fbn::FusedBatchNorm(
            OpVersion::kV3, {x.cview(), scale.cview(), other.cview(), other.cview(), other.cview()},
            fbn::FusedBatchNormAttrs{},
            {y.view(), v1.view(), v2.view(), v3.view(), v4.view(), v5.view()});
        const std::string want =
            "scale must have the same number of elements as the channels of x, got " +
            std::to_string(c + 1) + " and " + std::to_string(c);
        if (s.ok() || s.message() != want) wrong.fetch_add(1);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(wrong.load(), 0);
}

}  // namespace
