#include "sync_checks.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <thread>
#include <utility>

#include "fbn/initializers.h"
#include "fbn/ops.h"

namespace fbn::sync_test {

// ============================================================================= ThreadGroup

namespace {
constexpr auto kDeadline = std::chrono::seconds(60);
}  // namespace

ThreadGroup::ThreadGroup(int size) : size_(size), slots_(static_cast<size_t>(size)) {}

Status ThreadGroup::Barrier(std::unique_lock<std::mutex>& lock) {
  const uint64_t gen = generation_;
  if (++arrived_ == size_) {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
    return Status::Ok();
  }
  if (!cv_.wait_for(lock, kDeadline, [&] { return generation_ != gen; })) {
    return Status(StatusCode::kInternal, "ThreadGroup: a rank never joined the collective");
  }
  return Status::Ok();
}

Status ThreadGroup::Allgather(int rank, const void* send, int64_t bytes, void* recv) {
  std::unique_lock<std::mutex> lock(mu_);
  const char* p = static_cast<const char*>(send);
  slots_[static_cast<size_t>(rank)].assign(p, p + bytes);
  Status s = Barrier(lock);
  if (!s.ok()) return s;
  bool same = true;
  for (const auto& slot : slots_) same = same && static_cast<int64_t>(slot.size()) == bytes;
  if (same) {
    for (int r = 0; r < size_; ++r) {
      if (bytes > 0) {
        std::memcpy(static_cast<char*>(recv) + r * bytes, slots_[static_cast<size_t>(r)].data(),
                    static_cast<size_t>(bytes));
      }
    }
  }
  // Nobody refills the table before every rank has read it.
  s = Barrier(lock);
  if (!s.ok()) return s;
  if (!same) {
    ADD_FAILURE() << "rank " << rank << ": Allgather with byte counts that differ between ranks";
    return Status(StatusCode::kInternal, "ThreadGroup: mismatched Allgather byte counts");
  }
  return Status::Ok();
}

void RunOnThreads(int ranks, const std::function<void(Communicator&)>& body) {
  ThreadGroup group(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&group, &body, r] {
      ThreadCommunicator comm(&group, r);
      body(comm);
    });
  }
  for (auto& t : threads) t.join();
}

std::vector<double> AllgatherDoubles(Communicator& comm, const std::vector<double>& local) {
  std::vector<double> all(local.size() * static_cast<size_t>(comm.size()));
  const Status s =
      comm.Allgather(local.data(), static_cast<int64_t>(local.size() * sizeof(double)), all.data());
  EXPECT_TRUE(s.ok()) << s.ToString();
  return all;
}

// ============================================================================= Helpers

std::vector<int64_t> PartSizes(Split split, int ranks) {
  std::vector<int64_t> parts(static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    switch (split) {
      case Split::kEqual:
        parts[static_cast<size_t>(r)] = 4;
        break;
      case Split::kUnequal:
        parts[static_cast<size_t>(r)] = 1 + (2 * r + 1) % 5;
        break;
      case Split::kEmptyPart:
        parts[static_cast<size_t>(r)] = (r == (ranks > 1 ? 1 : 0)) ? 0 : 3 + r;
        break;
      case Split::kOnePerRank:
        parts[static_cast<size_t>(r)] = 1;
        break;
    }
  }
  return parts;
}

const char* SplitName(Split split) {
  switch (split) {
    case Split::kEqual:
      return "equal";
    case Split::kUnequal:
      return "unequal";
    case Split::kEmptyPart:
      return "empty_part";
    case Split::kOnePerRank:
      return "one_per_rank";
  }
  return "?";
}

namespace {

Shape WithBatch(int64_t n, const Shape& features) {
  std::vector<int64_t> dims{n};
  for (int i = 0; i < features.rank(); ++i) dims.push_back(features.dim(i));
  return Shape(dims.data(), static_cast<int>(dims.size()));
}

// The global batch: normal values with a mean away from 0 (centring matters) and a non-unit
// spread, rounded to `dtype`; identical on every rank.
Tensor GlobalData(DataType dtype, const Shape& shape, uint32_t seed, double mean, double stddev) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> dist(mean, stddev);
  std::vector<double> v(static_cast<size_t>(shape.num_elements()));
  for (double& e : v) e = dist(gen);
  return Tensor::FromDoubles(dtype, shape, v);
}

// Rows [row0, row0 + rows) of `t` along dimension 0.
Tensor Rows(const Tensor& t, int64_t row0, int64_t rows) {
  const Shape& shape = t.shape();
  std::vector<int64_t> dims(shape.dims(), shape.dims() + shape.rank());
  int64_t row_elems = 1;
  for (size_t i = 1; i < dims.size(); ++i) row_elems *= dims[i];
  dims[0] = rows;
  const Shape out_shape(dims.data(), static_cast<int>(dims.size()));
  std::vector<double> v(static_cast<size_t>(rows * row_elems));
  for (int64_t i = 0; i < rows * row_elems; ++i) {
    v[static_cast<size_t>(i)] = t.Get(row0 * row_elems + i);
  }
  return Tensor::FromDoubles(t.dtype(), out_shape, v);
}

bool Close(double a, double b, double tol) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return std::fabs(a - b) <= tol * (1.0 + std::fabs(b));
}

// got[i] against want[offset + i].
void ExpectClose(const Tensor& got, const Tensor& want, int64_t offset, double tol,
                 const std::string& what) {
  int failures = 0;
  for (int64_t i = 0; i < got.num_elements() && failures < 5; ++i) {
    const double a = got.Get(i), b = want.Get(offset + i);
    if (!Close(a, b, tol)) {
      ADD_FAILURE() << what << "[" << i << "]: " << a << " vs " << b << " (tol " << tol << ")";
      ++failures;
    }
  }
}

void ExpectCloseVec(const std::vector<double>& got, const std::vector<double>& want, double tol,
                    const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int failures = 0;
  for (size_t i = 0; i < got.size() && failures < 5; ++i) {
    if (!Close(got[i], want[i], tol)) {
      ADD_FAILURE() << what << "[" << i << "]: " << got[i] << " vs " << want[i];
      ++failures;
    }
  }
}

bool BitEqual(const Tensor& a, const Tensor& b) {
  return a.valid() == b.valid() && a.dtype() == b.dtype() && a.shape() == b.shape() &&
         (a.num_bytes() == 0 || std::memcmp(a.data(), b.data(), a.num_bytes()) == 0);
}

// The rank-order sum of every rank's `local` (a parameter gradient).
std::vector<double> SumOverRanks(Communicator& comm, const std::vector<double>& local) {
  const std::vector<double> all = AllgatherDoubles(comm, local);
  std::vector<double> sum(local.size(), 0.0);
  for (int r = 0; r < comm.size(); ++r) {
    for (size_t i = 0; i < local.size(); ++i)
      sum[i] += all[static_cast<size_t>(r) * local.size() + i];
  }
  return sum;
}

// `local` is bit-identical on every rank.
void ExpectSameOnEveryRank(Communicator& comm, const std::vector<double>& local,
                           const std::string& what) {
  const std::vector<double> all = AllgatherDoubles(comm, local);
  for (int r = 1; r < comm.size(); ++r) {
    EXPECT_EQ(0, std::memcmp(all.data() + static_cast<size_t>(r) * local.size(), all.data(),
                             local.size() * sizeof(double)))
        << what << " differs between rank 0 and rank " << r;
  }
}

std::vector<std::shared_ptr<Variable>> Statistics(const layers::BatchNormalization& bn) {
  std::vector<std::shared_ptr<Variable>> v;
  for (const auto& var : {bn.moving_mean(), bn.moving_variance(), bn.moving_stddev(),
                          bn.renorm_mean(), bn.renorm_stddev()}) {
    if (var) v.push_back(var);
  }
  return v;
}

BatchNormalizationOptions Seeded(BatchNormalizationOptions o) {
  o.gamma_initializer = Initializer::RandomNormal(1.0, 0.3, 11);
  o.beta_initializer = Initializer::RandomNormal(0.2, 0.3, 12);
  o.momentum = 0.9;
  return o;
}

}  // namespace

// ============================================================================= Layer cases

std::vector<LayerCase> LayerCases() {
  std::vector<LayerCase> cases;
  auto add = [&](std::string name, std::vector<int> axis, DataType dtype, Shape features,
                 double tol, const std::function<void(BatchNormalizationOptions&)>& tweak) {
    LayerCase c;
    c.name = std::move(name);
    c.options = Seeded({});
    c.options.axis = std::move(axis);
    c.dtype = dtype;
    c.feature_shape = features;
    c.tol = tol;
    if (tweak) tweak(c.options);
    cases.push_back(std::move(c));
  };
  const DataType f16 = DataType::kFloat16, f32 = DataType::kFloat32, f64 = DataType::kFloat64;
  add("fused_nhwc_f32", {-1}, f32, Shape{3, 2, 5}, 2e-5, {});
  add("fused_nchw_f32", {1}, f32, Shape{4, 3, 2}, 2e-5, {});
  add("fused_ndhwc_f16", {-1}, f16, Shape{2, 2, 1, 3}, 1e-2, {});
  add("fused_ncdhw_f32", {1}, f32, Shape{3, 2, 2, 2}, 2e-5, {});
  add("general_rank2_f32", {-1}, f32, Shape{6}, 2e-5, {});
  add("general_rank3_axis1_f64", {1}, f64, Shape{4, 3}, 1e-11, {});
  add("general_two_axes_f32", {1, 3}, f32, Shape{3, 2, 4}, 2e-5, {});
  add("keras_v2_f32", {-1}, f32, Shape{2, 2, 4}, 2e-5,
      [](BatchNormalizationOptions& o) { o.behavior = LayerBehavior::kKerasV2; });
  add("renorm_f32", {-1}, f32, Shape{5}, 2e-5, [](BatchNormalizationOptions& o) {
    o.renorm = true;
    o.renorm_clipping = RenormClipping{3.0, 1.0 / 3.0, 1.0};
    o.renorm_momentum = 0.8;
  });
  add("adjustment_f32", {-1}, f32, Shape{2, 4}, 2e-5, [](BatchNormalizationOptions& o) {
    o.adjustment = [](const Shape& shape) {
      const int64_t c = shape.dim(shape.rank() - 1);
      AdjustmentResult r{Tensor(DataType::kFloat32, Shape{c}),
                         Tensor(DataType::kFloat32, Shape{c})};
      for (int64_t i = 0; i < c; ++i) {
        r.scale.Set(i, 1.0 + 0.1 * static_cast<double>(i));
        r.bias.Set(i, 0.05 * static_cast<double>(i));
      }
      return r;
    };
  });
  add("no_scale_no_center_f16", {-1}, f16, Shape{3}, 1e-2, [](BatchNormalizationOptions& o) {
    o.scale = false;
    o.center = false;
  });
  add("virtual_batches_f32", {-1}, f32, Shape{3}, 2e-5,
      [](BatchNormalizationOptions& o) { o.virtual_batch_size = 2; });
  add("wide_fused_nhwc_f32", {-1}, f32, Shape{1, 2, kSyncInlineChannels + 52}, 2e-5, {});
  add("wide_general_f32", {-1}, f32, Shape{kSyncInlineChannels + 1}, 2e-5, {});
  return cases;
}

namespace {

// The unsynchronized layer to compare with: the same options, on the same path (a synchronized
// Keras V2 layer is never fused, as in Keras).
BatchNormalizationOptions PlainOptions(const BatchNormalizationOptions& o) {
  BatchNormalizationOptions p = o;
  if (p.behavior == LayerBehavior::kKerasV2) p.fused = false;
  return p;
}

struct StepResult {
  Tensor y, dx, dgamma, dbeta;
  std::vector<Tensor> stats;
};

StepResult Step(layers::BatchNormalization& bn, const Tensor& x, const Tensor& dy) {
  StepResult r;
  r.y = bn.Call(x.view(), true);
  BatchNormalizationGradients g = bn.Backward(dy.view());
  r.dx = std::move(g.dx);
  r.dgamma = std::move(g.dgamma);
  r.dbeta = std::move(g.dbeta);
  for (const auto& v : Statistics(bn)) r.stats.push_back(v->value());
  return r;
}

}  // namespace

void CheckLayerCase(Communicator& comm, const LayerCase& c, Split split) {
  const int R = comm.size(), rank = comm.rank();
  SCOPED_TRACE(c.name + " split=" + SplitName(split) + " rank=" + std::to_string(rank) + "/" +
               std::to_string(R));
  const std::vector<int64_t> parts = PartSizes(split, R);
  int64_t N = 0, row0 = 0;
  for (int r = 0; r < R; ++r) {
    if (r < rank) row0 += parts[static_cast<size_t>(r)];
    N += parts[static_cast<size_t>(r)];
  }
  const int64_t n = parts[static_cast<size_t>(rank)];
  const int64_t row_elems = c.feature_shape.num_elements();

  auto counting = std::make_shared<CountingCommunicator>(&comm);
  BatchNormalizationOptions so = c.options;
  so.synchronized = true;
  so.communicator = counting;
  BatchNormalizationOptions po = PlainOptions(c.options);
  if (po.virtual_batch_size) po.virtual_batch_size = *po.virtual_batch_size * R;

  if (c.options.virtual_batch_size && split != Split::kEqual) {
    // Ghost batches need the same number of virtual batches on every rank: a rank whose part the
    // virtual batch size does not divide fails, and every other rank fails with it.
    layers::BatchNormalization sync(so);
    const Tensor x = Rows(GlobalData(c.dtype, WithBatch(N, c.feature_shape), 1, 3.0, 2.0), row0, n);
    EXPECT_THROW(sync.Call(x.view(), true), Error);
    return;
  }

  layers::BatchNormalization plain(po);
  layers::BatchNormalization sync(so);
  std::optional<StepResult> first;
  const int64_t vbs_groups = c.options.virtual_batch_size ? n / *c.options.virtual_batch_size : 1;
  for (uint32_t step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const Tensor xg = GlobalData(c.dtype, WithBatch(N, c.feature_shape), 100 + step, 3.0, 2.0);
    const Tensor dyg = GlobalData(c.dtype, WithBatch(N, c.feature_shape), 200 + step, 0.5, 1.0);
    const Tensor x = Rows(xg, row0, n), dy = Rows(dyg, row0, n);
    const StepResult want = Step(plain, xg, dyg);
    const int64_t calls_before = counting->calls();
    const Tensor y = sync.Call(x.view(), true);
    const int64_t forward_calls = counting->calls() - calls_before;
    BatchNormalizationGradients g = sync.Backward(dy.view());
    const int64_t backward_calls = counting->calls() - calls_before - forward_calls;

    // One collective call per pass while the partials fit the record, two above.
    const int64_t slots = sync.moving_mean()->value().num_elements() * vbs_groups;
    const int64_t expected = R == 1 ? 0 : (slots <= kSyncInlineChannels ? 1 : 2);
    EXPECT_EQ(forward_calls, expected);
    EXPECT_EQ(backward_calls, expected);

    ExpectClose(y, want.y, row0 * row_elems, c.tol, "y");
    ExpectClose(g.dx, want.dx, row0 * row_elems, c.tol, "dx");
    ASSERT_EQ(g.dgamma.valid(), want.dgamma.valid());
    ASSERT_EQ(g.dbeta.valid(), want.dbeta.valid());
    if (g.dgamma.valid()) {
      ExpectCloseVec(SumOverRanks(comm, g.dgamma.ToDoubles()), want.dgamma.ToDoubles(), c.tol,
                     "sum of dgamma");
    }
    if (g.dbeta.valid()) {
      ExpectCloseVec(SumOverRanks(comm, g.dbeta.ToDoubles()), want.dbeta.ToDoubles(), c.tol,
                     "sum of dbeta");
    }
    const auto stats = Statistics(sync);
    ASSERT_EQ(stats.size(), want.stats.size());
    for (size_t i = 0; i < stats.size(); ++i) {
      ExpectClose(stats[i]->value(), want.stats[i], 0, c.tol, stats[i]->name());
      ExpectSameOnEveryRank(comm, stats[i]->value().ToDoubles(), stats[i]->name());
    }
    if (step == 0) {
      first = StepResult{y, g.dx, g.dgamma, g.dbeta, {}};
      for (const auto& v : stats) first->stats.push_back(v->value());
    }
  }
  // Inference: the moving statistics, nothing exchanged.
  {
    const Tensor xg = GlobalData(c.dtype, WithBatch(N, c.feature_shape), 300, 3.0, 2.0);
    const int64_t calls_before = counting->calls();
    const Tensor y = sync.Call(Rows(xg, row0, n).view(), false);
    EXPECT_EQ(counting->calls(), calls_before);
    ExpectClose(y, plain.Call(xg.view(), false), row0 * row_elems, c.tol, "inference y");
  }
  // Determinism: a fresh layer repeats the first step bit for bit.
  {
    layers::BatchNormalization again(so);
    const Tensor xg = GlobalData(c.dtype, WithBatch(N, c.feature_shape), 100, 3.0, 2.0);
    const Tensor dyg = GlobalData(c.dtype, WithBatch(N, c.feature_shape), 200, 0.5, 1.0);
    const StepResult r = Step(again, Rows(xg, row0, n), Rows(dyg, row0, n));
    EXPECT_TRUE(BitEqual(r.y, first->y));
    EXPECT_TRUE(BitEqual(r.dx, first->dx));
    EXPECT_TRUE(BitEqual(r.dgamma, first->dgamma));
    EXPECT_TRUE(BitEqual(r.dbeta, first->dbeta));
    ASSERT_EQ(r.stats.size(), first->stats.size());
    for (size_t i = 0; i < r.stats.size(); ++i) EXPECT_TRUE(BitEqual(r.stats[i], first->stats[i]));
  }
}

// ============================================================================= Op cases

namespace {

struct OpCase {
  OpVersion version;
  TensorFormat format;
  DataType dtype;
  float avg_factor;
  int64_t channels;
  double tol;
};

Shape OpShape(TensorFormat f, int64_t n, int64_t c) {
  switch (f) {
    case TensorFormat::kNHWC:
      return Shape{n, 2, 3, c};
    case TensorFormat::kNCHW:
      return Shape{n, c, 2, 3};
    case TensorFormat::kNDHWC:
      return Shape{n, 2, 1, 2, c};
    case TensorFormat::kNCDHW:
      return Shape{n, c, 2, 1, 2};
  }
  return Shape{};
}

struct ForwardOut {
  std::vector<Tensor> t;  // y, batch_mean, batch_variance, rs1, rs2, rs3
  FusedBatchNormOutputs views() {
    return FusedBatchNormOutputs{t[0].view(), t[1].view(), t[2].view(),
                                 t[3].view(), t[4].view(), t[5].view()};
  }
};

ForwardOut MakeForwardOut(DataType dtype, const Shape& x, int64_t c) {
  const DataType u = dtype == DataType::kFloat64 ? DataType::kFloat64 : DataType::kFloat32;
  return ForwardOut{{Tensor(dtype, x), Tensor(u, Shape{c}), Tensor(u, Shape{c}),
                     Tensor(u, Shape{c}), Tensor(u, Shape{c}), Tensor(u, Shape{})}};
}

struct GradOut {
  std::vector<Tensor> t;  // x_backprop, scale_backprop, offset_backprop, two placeholders
  FusedBatchNormGradOutputs views() {
    return FusedBatchNormGradOutputs{t[0].view(), t[1].view(), t[2].view(), t[3].view(),
                                     t[4].view()};
  }
};

GradOut MakeGradOut(DataType dtype, const Shape& x, int64_t c) {
  const DataType u = dtype == DataType::kFloat64 ? DataType::kFloat64 : DataType::kFloat32;
  return GradOut{{Tensor(dtype, x), Tensor(u, Shape{c}), Tensor(u, Shape{c}), Tensor(u, Shape{0}),
                  Tensor(u, Shape{0})}};
}

}  // namespace

void CheckOpCases(Communicator& comm, Split split) {
  const int R = comm.size(), rank = comm.rank();
  const std::vector<int64_t> parts = PartSizes(split, R);
  int64_t N = 0, row0 = 0;
  for (int r = 0; r < R; ++r) {
    if (r < rank) row0 += parts[static_cast<size_t>(r)];
    N += parts[static_cast<size_t>(r)];
  }
  const int64_t n = parts[static_cast<size_t>(rank)];
  const OpCase cases[] = {
      {OpVersion::kV3, TensorFormat::kNHWC, DataType::kFloat32, 1.0f, 4, 2e-5},
      {OpVersion::kV3, TensorFormat::kNCHW, DataType::kFloat32, 0.3f, 5, 2e-5},
      {OpVersion::kV2, TensorFormat::kNHWC, DataType::kFloat16, 1.0f, 3, 1e-2},
      {OpVersion::kV2, TensorFormat::kNCHW, DataType::kBFloat16, 1.0f, 3, 5e-2},
      {OpVersion::kV3, TensorFormat::kNCDHW, DataType::kFloat64, 0.5f, 2, 1e-11},
      {OpVersion::kV3, TensorFormat::kNDHWC, DataType::kFloat32, 1.0f, 2 * kSyncInlineChannels,
       2e-5},
  };
  uint64_t tag = 1000;
  for (const OpCase& c : cases) {
    SCOPED_TRACE(std::string(FusedBatchNormOpName(c.version)) + " " + TensorFormatName(c.format) +
                 " " + DataTypeName(c.dtype) + " split=" + SplitName(split) +
                 " rank=" + std::to_string(rank));
    const int64_t C = c.channels;
    const DataType u = c.dtype == DataType::kFloat64 ? DataType::kFloat64 : DataType::kFloat32;
    const Shape gshape = OpShape(c.format, N, C);
    const Tensor xg = GlobalData(c.dtype, gshape, 7, -2.0, 1.5);
    const Tensor dyg = GlobalData(c.dtype, gshape, 8, 0.3, 1.0);
    const Tensor x = Rows(xg, row0, n), dy = Rows(dyg, row0, n);
    const Tensor scale = GlobalData(u, Shape{C}, 9, 1.0, 0.3);
    const Tensor offset = GlobalData(u, Shape{C}, 10, 0.0, 0.3);
    const Tensor mean = GlobalData(u, Shape{C}, 11, 0.5, 0.1);
    const Tensor var = GlobalData(u, Shape{C}, 12, 2.0, 0.1);
    FusedBatchNormAttrs attrs;
    attrs.epsilon = 0.001f;
    attrs.data_format = c.format;
    attrs.exponential_avg_factor = c.avg_factor;
    ForwardOut want = MakeForwardOut(c.dtype, gshape, C);
    ASSERT_TRUE(FusedBatchNorm(c.version,
                               {xg.view(), scale.view(), offset.view(), mean.view(), var.view()},
                               attrs, want.views())
                    .ok());
    ForwardOut got = MakeForwardOut(c.dtype, x.shape(), C);
    const Status s = SyncFusedBatchNorm(
        comm, c.version, {x.view(), scale.view(), offset.view(), mean.view(), var.view()}, attrs,
        got.views(), tag++);
    ASSERT_TRUE(s.ok()) << s.ToString();
    const int64_t row = gshape.num_elements() / std::max<int64_t>(N, 1);
    ExpectClose(got.t[0], want.t[0], row0 * row, c.tol, "y");
    const char* names[] = {"batch_mean", "batch_variance", "reserve_space_1", "reserve_space_2"};
    for (int i = 1; i <= 4; ++i) {
      ExpectClose(got.t[i], want.t[i], 0, 2e-5, names[i - 1]);
      ExpectSameOnEveryRank(comm, got.t[i].ToDoubles(), names[i - 1]);
    }

    // Gradient with each side's own saved statistics.
    FusedBatchNormGradAttrs gattrs;
    gattrs.epsilon = attrs.epsilon;
    gattrs.data_format = c.format;
    GradOut gwant = MakeGradOut(c.dtype, gshape, C);
    ASSERT_TRUE(FusedBatchNormGrad(c.version,
                                   {dyg.view(), xg.view(), scale.view(), want.t[3].view(),
                                    want.t[4].view(), want.t[5].view()},
                                   gattrs, gwant.views())
                    .ok());
    GradOut ggot = MakeGradOut(c.dtype, x.shape(), C);
    const Status gs = SyncFusedBatchNormGrad(
        comm, c.version,
        {dy.view(), x.view(), scale.view(), got.t[3].view(), got.t[4].view(), got.t[5].view()},
        gattrs, ggot.views(), tag++);
    ASSERT_TRUE(gs.ok()) << gs.ToString();
    ExpectClose(ggot.t[0], gwant.t[0], row0 * row, c.tol, "x_backprop");
    ExpectCloseVec(SumOverRanks(comm, ggot.t[1].ToDoubles()), gwant.t[1].ToDoubles(), 1e-4,
                   "sum of scale_backprop");
    ExpectCloseVec(SumOverRanks(comm, ggot.t[2].ToDoubles()), gwant.t[2].ToDoubles(), 1e-4,
                   "sum of offset_backprop");
  }
}

// ============================================================================= One member

void CheckSingleMember(Communicator& comm) {
  ASSERT_EQ(comm.size(), 1);
  auto counting = std::make_shared<CountingCommunicator>(&comm);
  for (const LayerCase& c : LayerCases()) {
    SCOPED_TRACE(c.name);
    BatchNormalizationOptions so = c.options;
    so.synchronized = true;
    so.communicator = counting;
    layers::BatchNormalization plain(PlainOptions(c.options)), sync(so);
    for (uint32_t step = 0; step < 2; ++step) {
      const Shape shape = WithBatch(4, c.feature_shape);
      const Tensor x = GlobalData(c.dtype, shape, 40 + step, 3.0, 2.0);
      const Tensor dy = GlobalData(c.dtype, shape, 50 + step, 0.5, 1.0);
      const StepResult a = Step(plain, x, dy), b = Step(sync, x, dy);
      EXPECT_TRUE(BitEqual(a.y, b.y));
      EXPECT_TRUE(BitEqual(a.dx, b.dx));
      EXPECT_TRUE(BitEqual(a.dgamma, b.dgamma));
      EXPECT_TRUE(BitEqual(a.dbeta, b.dbeta));
      ASSERT_EQ(a.stats.size(), b.stats.size());
      for (size_t i = 0; i < a.stats.size(); ++i) EXPECT_TRUE(BitEqual(a.stats[i], b.stats[i]));
    }
    EXPECT_EQ(sync.fused(), plain.fused());
  }
  // The op: FusedBatchNorm's results, bit for bit.
  const Shape shape{3, 2, 2, 4};
  const Tensor x = GlobalData(DataType::kFloat32, shape, 60, 1.0, 2.0);
  const Tensor scale = GlobalData(DataType::kFloat32, Shape{4}, 61, 1.0, 0.3);
  const Tensor offset = GlobalData(DataType::kFloat32, Shape{4}, 62, 0.0, 0.3);
  const Tensor empty(DataType::kFloat32, Shape{0});
  ForwardOut a = MakeForwardOut(DataType::kFloat32, shape, 4);
  ForwardOut b = MakeForwardOut(DataType::kFloat32, shape, 4);
  const FusedBatchNormInputs in{x.view(), scale.view(), offset.view(), empty.view(), empty.view()};
  ASSERT_TRUE(FusedBatchNorm(OpVersion::kV3, in, {}, a.views()).ok());
  ASSERT_TRUE(SyncFusedBatchNorm(*counting, OpVersion::kV3, in, {}, b.views()).ok());
  for (size_t i = 0; i < a.t.size(); ++i) EXPECT_TRUE(BitEqual(a.t[i], b.t[i]));
  EXPECT_EQ(counting->calls(), 0);
}

// ============================================================================= Failures

namespace {

BatchNormalizationOptions SyncOptions(Communicator& comm, std::vector<int> axis = {-1}) {
  BatchNormalizationOptions o;
  o.axis = std::move(axis);
  o.synchronized = true;
  // A non-owning shared_ptr: the communicator outlives every layer of a check.
  o.communicator = std::shared_ptr<Communicator>(&comm, [](Communicator*) {});
  return o;
}

// The call throws an exception whose text contains `text`.
template <typename F>
void ExpectErrorContaining(F&& f, const std::string& text) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one containing \"" << text << "\"";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

// The group still works: a synchronized training step on every rank succeeds.
void ExpectGroupWorks(Communicator& comm) {
  layers::BatchNormalization bn(SyncOptions(comm));
  const Tensor x = GlobalData(DataType::kFloat32, Shape{2, 3}, 70 + comm.rank(), 0.0, 1.0);
  EXPECT_NO_THROW({
    bn.Call(x.view(), true);
    bn.Backward(x.view());
  });
}

}  // namespace

void CheckChannelMismatch(Communicator& comm) {
  {
    layers::BatchNormalization bn(SyncOptions(comm));
    const int64_t c = comm.rank() == 0 ? 4 : 5;
    const Tensor x = GlobalData(DataType::kFloat32, Shape{2, 2, 2, c}, 80, 0.0, 1.0);
    ExpectErrorContaining([&] { bn.Call(x.view(), true); }, "the ranks disagree");
  }
  {
    // The op, with channel counts on both sides of the record's capacity: still one fixed-size
    // collective that every rank posts identically.
    const int64_t c = comm.rank() == 0 ? 3 : 2 * kSyncInlineChannels;
    const Shape shape{2, 1, 1, c};
    const Tensor x = GlobalData(DataType::kFloat32, shape, 81, 0.0, 1.0);
    const Tensor scale = Tensor::Filled(DataType::kFloat32, Shape{c}, 1.0);
    const Tensor empty(DataType::kFloat32, Shape{0});
    ForwardOut out = MakeForwardOut(DataType::kFloat32, shape, c);
    const Status s = SyncFusedBatchNorm(
        comm, OpVersion::kV3, {x.view(), scale.view(), scale.view(), empty.view(), empty.view()},
        {}, out.views());
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("channels"), std::string::npos) << s.message();
  }
  ExpectGroupWorks(comm);
}

void CheckDtypeMismatch(Communicator& comm) {
  {
    layers::BatchNormalization bn(SyncOptions(comm));
    const DataType t = comm.rank() == 0 ? DataType::kFloat32 : DataType::kFloat64;
    const Tensor x = GlobalData(t, Shape{3, 4}, 82, 0.0, 1.0);
    ExpectErrorContaining([&] { bn.Call(x.view(), true); }, "the ranks disagree");
  }
  ExpectGroupWorks(comm);
}

void CheckCallOrderMismatch(Communicator& comm) {
  const Tensor x = GlobalData(DataType::kFloat32, Shape{2, 4}, 83, 0.0, 1.0);
  layers::BatchNormalization a(SyncOptions(comm)), b(SyncOptions(comm));
  ASSERT_NO_THROW(a.Call(x.view(), true));
  // Rank 0 goes backward while the others call forward again.
  if (comm.rank() == 0) {
    ExpectErrorContaining([&] { a.Backward(x.view()); }, "the ranks disagree");
  } else {
    ExpectErrorContaining([&] { a.Call(x.view(), true); }, "the ranks disagree");
  }
  // Rank 0 calls a fresh layer while the others call `a` again: same shape, different tags.
  if (comm.rank() == 0) {
    ExpectErrorContaining([&] { b.Call(x.view(), true); }, "tag 2");
  } else {
    ExpectErrorContaining([&] { a.Call(x.view(), true); }, "tag 2");
  }
  ExpectGroupWorks(comm);
}

void CheckLocalFailurePropagates(Communicator& comm) {
  const int last = comm.size() - 1;
  layers::BatchNormalization bn(SyncOptions(comm));
  const Tensor x = GlobalData(DataType::kFloat32, Shape{2, 4}, 84, 0.0, 1.0);
  const Tensor wrong = GlobalData(DataType::kFloat32, Shape{2, 5}, 85, 0.0, 1.0);
  ASSERT_NO_THROW(bn.Call(x.view(), true));
  // The last rank's input does not match the built layer: its own ValueError there, and on every
  // other rank an error naming it.
  if (comm.rank() == last) {
    ExpectErrorContaining([&] { bn.Call(wrong.view(), true); }, "expected axis 1");
  } else {
    ExpectErrorContaining([&] { bn.Call(x.view(), true); },
                          "rank " + std::to_string(last) + " failed: layer \"batch_normalization");
  }
  // Backward: rank 0's dy has the wrong shape.
  if (comm.rank() == 0) {
    ExpectErrorContaining([&] { bn.Backward(wrong.view()); }, "dy has shape");
  } else {
    ExpectErrorContaining([&] { bn.Backward(x.view()); }, "rank 0 failed");
  }
  // The layer itself goes on working.
  EXPECT_NO_THROW({
    bn.Call(x.view(), true);
    bn.Backward(x.view());
  });
  ExpectGroupWorks(comm);
}

void CheckOpFailurePropagates(Communicator& comm) {
  const Shape shape{2, 2, 2, 3};
  const Tensor x = GlobalData(DataType::kFloat32, shape, 86, 0.0, 1.0);
  const Tensor scale = Tensor::Filled(DataType::kFloat32, Shape{3}, 1.0);
  const Tensor bad_scale = Tensor::Filled(DataType::kFloat32, Shape{2}, 1.0);
  const Tensor empty(DataType::kFloat32, Shape{0});
  ForwardOut out = MakeForwardOut(DataType::kFloat32, shape, 3);
  const Tensor& my_scale = comm.rank() == 0 ? bad_scale : scale;
  const Status s = SyncFusedBatchNorm(
      comm, OpVersion::kV3, {x.view(), my_scale.view(), scale.view(), empty.view(), empty.view()},
      {}, out.views(), 5);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  const std::string want = comm.rank() == 0 ? "scale must have the same number of elements"
                                            : "rank 0 failed: scale must have";
  EXPECT_NE(s.message().find(want), std::string::npos) << s.message();

  // The gradient: the last rank passes a y_backprop of another shape.
  const int last = comm.size() - 1;
  ASSERT_TRUE(SyncFusedBatchNorm(comm, OpVersion::kV3,
                                 {x.view(), scale.view(), scale.view(), empty.view(), empty.view()},
                                 {}, out.views(), 6)
                  .ok());
  const Tensor dy_bad = GlobalData(DataType::kFloat32, Shape{2, 2, 1, 3}, 87, 0.0, 1.0);
  const Tensor& dy = comm.rank() == last ? dy_bad : x;
  GradOut g = MakeGradOut(DataType::kFloat32, shape, 3);
  const Status gs = SyncFusedBatchNormGrad(
      comm, OpVersion::kV3,
      {dy.view(), x.view(), scale.view(), out.t[3].view(), out.t[4].view(), out.t[5].view()}, {},
      g.views(), 7);
  EXPECT_EQ(gs.code(), StatusCode::kInvalidArgument);
  const std::string gwant = comm.rank() == last
                                ? "x and y_backprop must have same shape"
                                : "rank " + std::to_string(last) + " failed: x and y_backprop";
  EXPECT_NE(gs.message().find(gwant), std::string::npos) << gs.message();
  ExpectGroupWorks(comm);
}

}  // namespace fbn::sync_test
