// Synchronized batch normalization with ranks as threads of this process (no MPI needed): the
// layer and the ops on parts of a batch against the unsynchronized ones on the whole batch, for
// 1 to 4 ranks and equal, unequal and empty parts; mismatches and failures between ranks. The same
// checks run over MPI in tests/mpi.
#include <gtest/gtest.h>

#include <string>

#include "fbn/distributed.h"
#include "sync_checks.h"

namespace fbn::sync_test {
namespace {

class SyncLayerTest : public testing::TestWithParam<int> {};

TEST_P(SyncLayerTest, LayerMatchesTheWholeBatch) {
  const int ranks = GetParam();
  for (Split split : {Split::kEqual, Split::kUnequal, Split::kEmptyPart, Split::kOnePerRank}) {
    for (const LayerCase& c : LayerCases()) {
      RunOnThreads(ranks, [&](Communicator& comm) { CheckLayerCase(comm, c, split); });
    }
  }
}

TEST_P(SyncLayerTest, OpsMatchTheWholeBatch) {
  const int ranks = GetParam();
  for (Split split : {Split::kEqual, Split::kUnequal, Split::kEmptyPart}) {
    RunOnThreads(ranks, [&](Communicator& comm) { CheckOpCases(comm, split); });
  }
}

TEST_P(SyncLayerTest, MismatchesAndFailuresAreErrorsOnEveryRank) {
  RunOnThreads(GetParam(), [](Communicator& comm) {
    CheckChannelMismatch(comm);
    CheckDtypeMismatch(comm);
    CheckCallOrderMismatch(comm);
    CheckLocalFailurePropagates(comm);
    CheckOpFailurePropagates(comm);
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, SyncLayerTest, testing::Values(2, 3, 4),
                         [](const testing::TestParamInfo<int>& p) {
                           return std::to_string(p.param);
                         });

TEST(SyncSingleMemberTest, IsThePlainLayerBitForBit) {
  RunOnThreads(1, [](Communicator& comm) { CheckSingleMember(comm); });
  CheckSingleMember(*SingleProcessCommunicator());
}

TEST(SyncSingleMemberTest, LayerMatchesTheWholeBatchWithOneRank) {
  for (const LayerCase& c : LayerCases()) {
    RunOnThreads(1, [&](Communicator& comm) { CheckLayerCase(comm, c, Split::kEqual); });
  }
}

TEST(SyncLayerOptionsTest, KerasV2RulesForSynchronized) {
  BatchNormalizationOptions o;
  o.synchronized = true;
  o.behavior = LayerBehavior::kKerasV2;
  o.fused = true;
  try {
    layers::BatchNormalization bn(o);
    ADD_FAILURE() << "no error";
  } catch (const ValueError& e) {
    EXPECT_STREQ(e.what(), "`fused=True` is not supported when `synchronized=True`.");
  }
  o.fused = std::nullopt;
  layers::BatchNormalization bn(o);
  EXPECT_EQ(bn.fused(), std::optional<bool>(false));
  // The V1 layer keeps its fused resolution.
  BatchNormalizationOptions v1;
  v1.synchronized = true;
  layers::BatchNormalization bn1(v1);
  EXPECT_EQ(bn1.fused(), std::optional<bool>(true));
}

TEST(SyncLayerOptionsTest, NoDefaultCommunicatorWithoutFbnMpi) {
  // This test program does not include fbn/mpi.h: there is no default communicator, and a
  // synchronized training call says how to get one. Inference calls need none.
  BatchNormalizationOptions o;
  o.synchronized = true;
  layers::BatchNormalization bn(o);
  const Tensor x = Tensor::Filled(DataType::kFloat32, Shape{2, 3}, 1.0);
  EXPECT_NO_THROW(bn.Call(x.view(), false));
  try {
    bn.Call(x.view(), true);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fbn::mpi::MakeCommunicator"), std::string::npos);
  }
}

}  // namespace
}  // namespace fbn::sync_test
