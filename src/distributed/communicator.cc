// The communicator interface's out-of-line pieces: the single-process group and the default.
#include <atomic>
#include <cstring>
#include <memory>

#include "fbn/distributed.h"

namespace fbn {
namespace {

class SingleProcess final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  Status Allgather(const void* send, int64_t bytes, void* recv) noexcept override {
    if (bytes < 0) return InvalidArgument("Allgather: negative byte count");
    if (bytes > 0) std::memmove(recv, send, static_cast<size_t>(bytes));
    return Status::Ok();
  }
};

std::atomic<CommunicatorFactory>& Factory() {
  static std::atomic<CommunicatorFactory> factory{nullptr};
  return factory;
}

}  // namespace

Communicator::~Communicator() = default;

std::shared_ptr<Communicator> SingleProcessCommunicator() {
  return std::make_shared<SingleProcess>();
}

void SetDefaultCommunicatorFactory(CommunicatorFactory factory) noexcept { Factory() = factory; }

std::shared_ptr<Communicator> DefaultCommunicator() {
  const CommunicatorFactory factory = Factory();
  if (factory == nullptr) {
    throw Error(InvalidArgument(
        "synchronized batch normalization needs a communicator: set "
        "BatchNormalizationOptions::communicator (e.g. fbn::mpi::MakeCommunicator(comm) from "
        "fbn/mpi.h, target fbn::mpi), or link fbn::mpi and include fbn/mpi.h, which makes "
        "MPI_COMM_WORLD the default"));
  }
  return factory();
}

}  // namespace fbn
