// The C++ layer API: paths, moving statistics, graph collections and deferred updates, reuse,
// failed calls, gradients by finite differences, initializers, regularizers, constraints and SGD.
#include "fbn/layer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "fbn/graph.h"
#include "fbn/initializers.h"
#include "fbn/optimizer.h"

namespace fbn {
namespace {

using layers::ApplyBatchNormalization;
using layers::BatchNormalization;

Tensor Random(DataType dtype, const Shape& shape, uint32_t seed, double scale = 1.0,
              double shift = 0.0) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> dist(shift, scale);
  Tensor t(dtype, shape);
  for (int64_t i = 0; i < t.num_elements(); ++i) t.Set(i, dist(gen));
  return t;
}

double Dot(const Tensor& a, const Tensor& b) {
  double s = 0.0;
  for (int64_t i = 0; i < a.num_elements(); ++i) s += a.Get(i) * b.Get(i);
  return s;
}

// TensorFlow's test_bessels_correction: the fused path's moving variance follows the unbiased
// batch variance: x = [0, 2], momentum 0.5, initial variance 0 gives exactly 1.
TEST(LayerTest, FusedMovingVarianceIsBesselCorrected) {
  for (const Shape& shape : {Shape{2, 1, 1, 1}, Shape{2, 1, 1, 1, 1}}) {
    BatchNormalizationOptions o;
    o.momentum = 0.5;
    o.moving_variance_initializer = Initializer::Zeros();
    BatchNormalization bn(o);
    Tensor x = Tensor::FromDoubles(DataType::kFloat32, shape, {0.0, 2.0});
    bn.Call(x.view(), true);
    EXPECT_EQ(bn.fused(), std::optional<bool>(true));
    EXPECT_EQ(bn.moving_variance()->value().Get(0), 1.0);
    EXPECT_EQ(bn.moving_mean()->value().Get(0), 0.5);
  }
}

// The general path tracks the biased variance: the same data with fused=false gives 0.5.
TEST(LayerTest, GeneralMovingVarianceIsBiased) {
  BatchNormalizationOptions o;
  o.momentum = 0.5;
  o.fused = false;
  o.moving_variance_initializer = Initializer::Zeros();
  BatchNormalization bn(o);
  Tensor x = Tensor::FromDoubles(DataType::kFloat32, Shape{2, 1, 1, 1}, {0.0, 2.0});
  bn.Call(x.view(), true);
  EXPECT_EQ(bn.fused(), std::optional<bool>(false));
  EXPECT_EQ(bn.moving_variance()->value().Get(0), 0.5);
}

TEST(LayerTest, FusedFallsBackSilentlyAsTheV1Layer) {
  struct Case {
    std::vector<int> axis;
    Shape shape;
    DataType dtype;
    bool renorm;
    bool fused;
  };
  const Case cases[] = {
      {{-1}, Shape{2, 3, 4, 5}, DataType::kFloat32, false, true},
      {{1}, Shape{2, 3, 4, 5}, DataType::kFloat32, false, true},
      {{2}, Shape{2, 3, 4, 5}, DataType::kFloat32, false, false},
      {{1, 3}, Shape{2, 3, 4, 5}, DataType::kFloat32, false, false},
      {{-1}, Shape{2, 3, 4, 5}, DataType::kFloat64, false, false},
      {{-1}, Shape{2, 3, 4, 5}, DataType::kFloat32, true, false},
      {{3}, Shape{2, 3, 4, 5, 6}, DataType::kFloat32, false, false},
      {{4}, Shape{2, 3, 4, 5, 6}, DataType::kFloat16, false, true},
      {{-1}, Shape{2, 3}, DataType::kFloat32, false, false},
  };
  for (const Case& c : cases) {
    BatchNormalizationOptions o;
    o.axis = c.axis;
    o.renorm = c.renorm;
    BatchNormalization bn(o);
    EXPECT_EQ(bn.fused(), std::optional<bool>(true));  // V1: None means True until built
    bn.Call(Random(c.dtype, c.shape, 1).view(), true);
    EXPECT_EQ(bn.fused(), std::optional<bool>(c.fused)) << c.shape.DebugString();
  }
}

TEST(LayerTest, KerasV2RaisesWhereV1FallsBack) {
  BatchNormalizationOptions o;
  o.behavior = LayerBehavior::kKerasV2;
  o.fused = true;
  o.renorm = true;
  EXPECT_THROW(BatchNormalization bn(o), ValueError);
  o.renorm = false;
  o.axis = {2};
  EXPECT_THROW(BatchNormalization bn(o), ValueError);
  o.axis = {-1};
  BatchNormalization bn(o);
  EXPECT_THROW(bn.Call(Random(DataType::kFloat32, Shape{2, 3, 4}, 1).view(), true), ValueError);
  EXPECT_FALSE(bn.built());
}

TEST(LayerTest, GraphDefersUpdatesUntilRun) {
  auto graph = Graph::Create();
  auto guard = graph->AsDefault();
  BatchNormalizationOptions o;
  o.axis = {1};
  BatchNormalization bn(o);
  Tensor x = Random(DataType::kFloat32, Shape{5, 4, 3}, 7, 2.0, 3.0);
  bn.Call(x.view(), true);
  ASSERT_EQ(graph->update_ops().size(), 2u);
  EXPECT_EQ(bn.updates().size(), 2u);
  EXPECT_EQ(graph->global_variables().size(), 4u);
  EXPECT_EQ(graph->trainable_variables().size(), 2u);
  EXPECT_EQ(bn.gamma()->name(), "batch_normalization/gamma:0");
  EXPECT_EQ(bn.moving_variance()->name(), "batch_normalization/moving_variance:0");
  for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(bn.moving_mean()->value().Get(i), 0.0);
  RunUpdateOps(graph->update_ops());
  // moving_mean = 0.99 * 0 + 0.01 * batch mean.
  for (int64_t c = 0; c < 4; ++c) {
    double sum = 0.0;
    for (int64_t n = 0; n < 5; ++n) {
      for (int64_t k = 0; k < 3; ++k) sum += x.Get((n * 4 + c) * 3 + k);
    }
    EXPECT_NEAR(bn.moving_mean()->value().Get(c), 0.01 * sum / 15.0, 1e-6);
  }
  // Static training=false adds no update ops; a runtime flag always adds two.
  bn.Call(x.view(), false);
  EXPECT_EQ(graph->update_ops().size(), 2u);
  auto flag = std::make_shared<TrainingFlag>(false);
  bn.Call(x.view(), flag);
  EXPECT_EQ(graph->update_ops().size(), 4u);
}

TEST(LayerTest, FunctionalFormNamesReuseAndNeedsAGraph) {
  Tensor x = Random(DataType::kFloat32, Shape{2, 3}, 1);
  BatchNormalizationOptions o;
  EXPECT_THROW(ApplyBatchNormalization(x.view(), o, true), ValueError);
  auto graph = Graph::Create();
  auto guard = graph->AsDefault();
  ApplyBatchNormalization(x.view(), o, true);
  ApplyBatchNormalization(x.view(), o, true);
  o.name = "bn";
  ApplyBatchNormalization(x.view(), o, true);
  std::vector<std::string> names;
  for (const auto& v : graph->global_variables()) names.push_back(v->name());
  EXPECT_EQ(names[0], "batch_normalization/gamma:0");
  EXPECT_EQ(names[4], "batch_normalization_1/gamma:0");
  EXPECT_EQ(names[8], "bn/gamma:0");
  try {
    ApplyBatchNormalization(x.view(), o, true);
    FAIL() << "expected ValueError";
  } catch (const ValueError& e) {
    EXPECT_EQ(std::string(e.what()),
              "Variable bn/gamma already exists, disallowed. Did you mean to set reuse=True or "
              "reuse=tf.AUTO_REUSE in VarScope?");
  }
  std::shared_ptr<BatchNormalization> layer;
  ApplyBatchNormalization(x.view(), o, true, /*reuse=*/true, &layer);
  EXPECT_EQ(graph->global_variables().size(), 12u);
  EXPECT_EQ(layer->gamma(), graph->global_variables()[8]);
  {
    VariableScope scope("outer");
    o.name.clear();
    ApplyBatchNormalization(x.view(), o, true, std::nullopt, &layer);
    EXPECT_EQ(layer->beta()->name(), "outer/batch_normalization/beta:0");
  }
}

TEST(LayerTest, FailedCallLeavesVariablesUntouched) {
  BatchNormalizationOptions o;
  o.axis = {1};
  o.adjustment = [](const Shape&) -> AdjustmentResult {
    return {Tensor::Filled(DataType::kFloat32, Shape{7}, 1.0),
            Tensor::Filled(DataType::kFloat32, Shape{7}, 0.0)};
  };
  BatchNormalization bn(o);
  Tensor x = Random(DataType::kFloat32, Shape{4, 3, 2}, 3);
  // The adjustment does not broadcast to (4, 3, 2): the call fails after building.
  EXPECT_THROW(bn.Call(x.view(), true), ValueError);
  ASSERT_TRUE(bn.built());
  for (int64_t i = 0; i < 3; ++i) {
    EXPECT_EQ(bn.moving_mean()->value().Get(i), 0.0);
    EXPECT_EQ(bn.moving_variance()->value().Get(i), 1.0);
  }
  // A wrong channel count on a built layer: Keras's input-spec error, nothing written.
  EXPECT_THROW(bn.Call(Random(DataType::kFloat32, Shape{4, 5, 2}, 3).view(), true), ValueError);
  BatchNormalizationOptions g;
  g.virtual_batch_size = 4;
  g.fused = false;
  BatchNormalization ghost(g);
  EXPECT_THROW(ghost.Call(Random(DataType::kFloat32, Shape{6, 3}, 3).view(), true), Error);
  EXPECT_FALSE(ghost.built());
}

// Central differences of sum(y * w) in double against Backward, for the general path's variants.
void ExpectGradientsMatchFiniteDifferences(const BatchNormalizationOptions& o, const Shape& shape,
                                           bool training) {
  auto graph = Graph::Create();  // updates deferred: the layer's state stays fixed
  auto guard = graph->AsDefault();
  BatchNormalization bn(o);
  Tensor x = Random(DataType::kFloat64, shape, 11, 1.5, 0.5);
  Tensor w = Random(DataType::kFloat64, shape, 12);
  bn.Call(x.view(), training);
  const BatchNormalizationGradients g = bn.Backward(w.view());
  auto loss = [&](const Tensor& xv) { return Dot(bn.Call(xv.view(), training), w); };
  const double h = 1e-5;
  for (int64_t i = 0; i < x.num_elements(); i += 3) {
    Tensor xp = x, xm = x;
    xp.Set(i, x.Get(i) + h);
    xm.Set(i, x.Get(i) - h);
    EXPECT_NEAR(g.dx.Get(i), (loss(xp) - loss(xm)) / (2 * h), 1e-6) << "dx " << i;
  }
  for (const auto& [var, grad] :
       {std::make_pair(bn.gamma(), &g.dgamma), std::make_pair(bn.beta(), &g.dbeta)}) {
    if (!var) {
      EXPECT_FALSE(grad->valid());
      continue;
    }
    const Tensor v0 = var->value();
    for (int64_t i = 0; i < v0.num_elements(); ++i) {
      Tensor vp = v0, vm = v0;
      vp.Set(i, v0.Get(i) + h);
      vm.Set(i, v0.Get(i) - h);
      var->Assign(vp);
      const double lp = loss(x);
      var->Assign(vm);
      const double lm = loss(x);
      var->Assign(v0);
      EXPECT_NEAR(grad->Get(i), (lp - lm) / (2 * h), 1e-6) << var->name() << " " << i;
    }
  }
}

TEST(LayerGradientTest, GeneralPathVariants) {
  BatchNormalizationOptions o;
  o.gamma_initializer = Initializer::RandomUniform(0.5, 1.5, 1);
  o.beta_initializer = Initializer::RandomUniform(-1, 1, 2);
  o.moving_variance_initializer = Initializer::Constant(1.7);
  ExpectGradientsMatchFiniteDifferences(o, Shape{6, 3}, true);
  ExpectGradientsMatchFiniteDifferences(o, Shape{6, 3}, false);
  o.axis = {1, 3};
  ExpectGradientsMatchFiniteDifferences(o, Shape{3, 2, 2, 3}, true);
  o.axis = {1};
  o.center = false;
  ExpectGradientsMatchFiniteDifferences(o, Shape{4, 3, 2}, true);
  o.center = true;
  o.scale = false;
  ExpectGradientsMatchFiniteDifferences(o, Shape{4, 3, 2}, true);
  o.scale = true;
  o.virtual_batch_size = 2;
  ExpectGradientsMatchFiniteDifferences(o, Shape{6, 3, 2}, true);
  o.virtual_batch_size.reset();
  o.adjustment = [](const Shape& s) {
    return AdjustmentResult{Random(DataType::kFloat64, s, 5, 0.2, 1.0),
                            Random(DataType::kFloat64, Shape{s.dim(s.rank() - 1)}, 6, 0.2)};
  };
  ExpectGradientsMatchFiniteDifferences(o, Shape{4, 3, 2}, true);
  o.adjustment = nullptr;
  // Renorm with r and d clipped to constants: the stop-gradient then matches the derivative.
  o.renorm = true;
  o.renorm_clipping = RenormClipping{1.2, 1.2, 0.3};
  o.moving_mean_initializer = Initializer::Constant(100.0);
  ExpectGradientsMatchFiniteDifferences(o, Shape{5, 3, 2}, true);
}

TEST(LayerGradientTest, FusedPathMatchesGeneralPath) {
  for (const std::vector<int>& axis : {std::vector<int>{-1}, std::vector<int>{1}}) {
    for (bool training : {true, false}) {
      BatchNormalizationOptions o;
      o.axis = axis;
      o.gamma_initializer = Initializer::RandomUniform(0.5, 1.5, 1);
      o.moving_variance_initializer = Initializer::Constant(1.7);
      BatchNormalization fused(o);
      o.fused = false;
      BatchNormalization general(o);
      Tensor x = Random(DataType::kFloat32, Shape{3, 4, 2, 5}, 21, 1.5, 0.5);
      Tensor dy = Random(DataType::kFloat32, Shape{3, 4, 2, 5}, 22);
      Tensor yf = fused.Call(x.view(), training), yg = general.Call(x.view(), training);
      ASSERT_TRUE(*fused.fused());
      const auto gf = fused.Backward(dy.view()), gg = general.Backward(dy.view());
      for (int64_t i = 0; i < x.num_elements(); ++i) {
        EXPECT_NEAR(yf.Get(i), yg.Get(i), 2e-5);
        EXPECT_NEAR(gf.dx.Get(i), gg.dx.Get(i), 2e-5);
      }
      for (int64_t c = 0; c < gf.dgamma.num_elements(); ++c) {
        EXPECT_NEAR(gf.dgamma.Get(c), gg.dgamma.Get(c), 1e-4);
        EXPECT_NEAR(gf.dbeta.Get(c), gg.dbeta.Get(c), 1e-4);
      }
    }
  }
}

TEST(InitializerTest, SeededInitializersRepeatAndFollowKerasScales) {
  const Shape shape{20000};
  Tensor a = Initializer::GlorotUniform(3)(shape, DataType::kFloat64);
  Tensor b = Initializer::GlorotUniform(3)(shape, DataType::kFloat64);
  Tensor c = Initializer::GlorotUniform(4)(shape, DataType::kFloat64);
  EXPECT_EQ(a.ToDoubles(), b.ToDoubles());
  EXPECT_NE(a.ToDoubles(), c.ToDoubles());
  // Rank 1: fan_in = fan_out = 20000, so the limit is sqrt(6 / 40000).
  const double limit = std::sqrt(6.0 / 40000.0);
  double sq = 0.0;
  for (double v : a.ToDoubles()) {
    EXPECT_LE(std::fabs(v), limit);
    sq += v * v;
  }
  EXPECT_NEAR(sq / 20000.0, limit * limit / 3.0, limit * limit * 0.02);
  Tensor t = Initializer::TruncatedNormal(0.0, 1.0, 5)(shape, DataType::kFloat32);
  for (double v : t.ToDoubles()) EXPECT_LE(std::fabs(v), 2.0);
  EXPECT_THROW(Initializer::Get("no_such_initializer"), ValueError);
}

TEST(RegularizerTest, KerasFormulasAndGradients) {
  Tensor w = Tensor::FromDoubles(DataType::kFloat32, Shape{3}, {-2.0, 0.0, 3.0});
  EXPECT_NEAR(Regularizer::L1(0.5).Loss(w), 2.5, 1e-7);
  EXPECT_NEAR(Regularizer::L2(0.5).Loss(w), 6.5, 1e-7);
  EXPECT_NEAR(Regularizer::L1L2(0.5, 0.5).Loss(w), 9.0, 1e-7);
  Tensor g = Regularizer::L1L2(0.5, 0.25).Gradient(w);
  EXPECT_NEAR(g.Get(0), -0.5 - 1.0, 1e-7);
  EXPECT_NEAR(g.Get(1), 0.0, 1e-7);
  EXPECT_NEAR(g.Get(2), 0.5 + 1.5, 1e-7);
}

TEST(ConstraintTest, KerasFormulas) {
  Tensor w = Tensor::FromDoubles(DataType::kFloat64, Shape{2}, {-3.0, 4.0});
  EXPECT_EQ(Constraint::NonNeg()(w).ToDoubles(), (std::vector<double>{-0.0, 4.0}));
  Tensor m = Constraint::MaxNorm(2.0)(w);  // norm 5 -> 2
  EXPECT_NEAR(m.Get(0), -3.0 * 2.0 / (5.0 + 1e-7), 1e-12);
  Tensor u = Constraint::UnitNorm()(w);
  EXPECT_NEAR(u.Get(1), 4.0 / (5.0 + 1e-7), 1e-12);
  Tensor mm = Constraint::MinMaxNorm(6.0, 8.0, 0.5)(w);  // desired 0.5*6 + 0.5*5 = 5.5
  EXPECT_NEAR(mm.Get(1), 4.0 * 5.5 / (5.0 + 1e-7), 1e-12);
}

TEST(OptimizerTest, SgdWithMomentumThenConstraint) {
  auto var = std::make_shared<Variable>(
      "w:0", Tensor::FromDoubles(DataType::kFloat64, Shape{2}, {1.0, -1.0}), true,
      Constraint::NonNeg());
  SGD sgd(0.1, 0.9);
  Tensor g = Tensor::FromDoubles(DataType::kFloat64, Shape{2}, {1.0, 1.0});
  sgd.ApplyGradients({{g, var}});
  // velocity = -0.1; w = [0.9, -1.1] -> non_neg -> [0.9, 0].
  EXPECT_NEAR(var->value().Get(0), 0.9, 1e-12);
  EXPECT_EQ(var->value().Get(1), 0.0);
  sgd.ApplyGradients({{g, var}});
  // velocity = 0.9 * -0.1 - 0.1 = -0.19.
  EXPECT_NEAR(var->value().Get(0), 0.9 - 0.19, 1e-12);
  EXPECT_THROW(sgd.ApplyGradients({{Tensor(DataType::kFloat64, Shape{3}), var}}), ValueError);
  EXPECT_EQ(sgd.iterations(), 2);
}

}  // namespace
}  // namespace fbn
