// Synchronized batch normalization over MPI: run under mpirun with 2 or 3 processes (ctest does:
// fbn_mpi_sync_np2, fbn_mpi_sync_np3). Each process is a rank holding its part of one global
// batch; the checks (tests/cc/layer/sync_checks.h) compare with the unsynchronized layer and ops
// on the whole batch. Rank 0 prints the usual GoogleTest report; the other ranks print their
// failures only, prefixed with their rank; every rank exits with the same status.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "fbn/mpi.h"
#include "sync_checks.h"

namespace fbn::sync_test {
namespace {

std::shared_ptr<Communicator> World() { return mpi::MakeCommunicator(MPI_COMM_WORLD); }

TEST(MpiSyncTest, LayerMatchesTheWholeBatch) {
  auto comm = World();
  for (Split split : {Split::kEqual, Split::kUnequal, Split::kEmptyPart, Split::kOnePerRank}) {
    for (const LayerCase& c : LayerCases()) CheckLayerCase(*comm, c, split);
  }
}

TEST(MpiSyncTest, OpsMatchTheWholeBatch) {
  auto comm = World();
  for (Split split : {Split::kEqual, Split::kUnequal, Split::kEmptyPart}) {
    CheckOpCases(*comm, split);
  }
}

TEST(MpiSyncTest, MismatchesAndFailuresAreErrorsOnEveryRank) {
  auto comm = World();
  CheckChannelMismatch(*comm);
  CheckDtypeMismatch(*comm);
  CheckCallOrderMismatch(*comm);
  CheckLocalFailurePropagates(*comm);
  CheckOpFailurePropagates(*comm);
}

TEST(MpiSyncTest, SingleProcessCommunicatorIsThePlainLayer) {
  CheckSingleMember(*mpi::MakeCommunicator(MPI_COMM_SELF));
}

// Process groups: ranks split into even and odd groups synchronize within their group only.
TEST(MpiSyncTest, SubCommunicators) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm group;
  ASSERT_EQ(MPI_Comm_split(MPI_COMM_WORLD, rank % 2, rank, &group), MPI_SUCCESS);
  {
    auto comm = mpi::MakeCommunicator(group);
    for (const LayerCase& c : LayerCases()) {
      if (c.name == "fused_nhwc_f32" || c.name == "general_rank2_f32") {
        CheckLayerCase(*comm, c, Split::kUnequal);
      }
    }
  }
  MPI_Comm_free(&group);
}

// The default communicator (fbn/mpi.h installs MPI_COMM_WORLD) and fbn::mpi::Synchronized give
// the results of an explicit world communicator, bit for bit; the MPI_Comm overloads of the ops
// those of the Communicator ones.
TEST(MpiSyncTest, DefaultCommunicatorIsTheWorld) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  BatchNormalizationOptions o;
  o.axis = {1};
  const Tensor x = Tensor::FromDoubles(DataType::kFloat32, Shape{2, 3, 2, 2},
                                       std::vector<double>(24, 1.0 + rank));
  BatchNormalizationOptions by_default = o;
  by_default.synchronized = true;
  layers::BatchNormalization a(by_default), b(mpi::Synchronized(o)),
      c(mpi::Synchronized(o, MPI_COMM_SELF));
  const Tensor ya = a.Call(x.view(), true), yb = b.Call(x.view(), true);
  const Tensor yc = c.Call(x.view(), true);
  ASSERT_EQ(ya.num_bytes(), yb.num_bytes());
  EXPECT_EQ(0, std::memcmp(ya.data(), yb.data(), ya.num_bytes()));
  EXPECT_EQ(0, std::memcmp(a.moving_mean()->value().data(), b.moving_mean()->value().data(),
                           a.moving_mean()->value().num_bytes()));
  // Over MPI_COMM_SELF each rank sees its own constant batch: mean 1 + rank after one step from 0.
  EXPECT_FLOAT_EQ(static_cast<float>(c.moving_mean()->value().Get(0)), 0.01f * (1.0f + rank));

  const Tensor scale = Tensor::Filled(DataType::kFloat32, Shape{3}, 1.5);
  const Tensor empty(DataType::kFloat32, Shape{0});
  FusedBatchNormAttrs attrs;
  attrs.data_format = TensorFormat::kNCHW;
  const FusedBatchNormInputs in{x.view(), scale.view(), scale.view(), empty.view(), empty.view()};
  std::vector<Tensor> o1, o2;
  for (auto* outs : {&o1, &o2}) {
    outs->emplace_back(DataType::kFloat32, x.shape());
    for (int i = 0; i < 4; ++i) outs->emplace_back(DataType::kFloat32, Shape{3});
    outs->emplace_back(DataType::kFloat32, Shape{});
  }
  auto views = [](std::vector<Tensor>& t) {
    return FusedBatchNormOutputs{t[0].view(), t[1].view(), t[2].view(),
                                 t[3].view(), t[4].view(), t[5].view()};
  };
  ASSERT_TRUE(mpi::SyncFusedBatchNorm(MPI_COMM_WORLD, OpVersion::kV3, in, attrs, views(o1)).ok());
  ASSERT_TRUE(SyncFusedBatchNorm(*World(), OpVersion::kV3, in, attrs, views(o2)).ok());
  for (size_t i = 0; i < o1.size(); ++i) {
    EXPECT_EQ(0, std::memcmp(o1[i].data(), o2[i].data(), o1[i].num_bytes()));
  }
}

// Failures on ranks other than 0, with the rank in front.
class RankFailurePrinter : public testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const testing::TestPartResult& r) override {
    if (r.failed()) {
      std::fprintf(stderr, "[rank %d] %s:%d: %s\n", rank_, r.file_name() ? r.file_name() : "?",
                   r.line_number(), r.summary());
    }
  }

 private:
  int rank_;
};

}  // namespace
}  // namespace fbn::sync_test

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {
    testing::TestEventListeners& listeners = testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new fbn::sync_test::RankFailurePrinter(rank));
  }
  int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  int any_failed = 0;
  MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any_failed;
}
