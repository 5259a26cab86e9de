// fbn::mpi: the Communicator over an MPI_Comm (one MPI_Allgather of bytes per call).
#include <climits>
#include <memory>
#include <mutex>
#include <string>

#include "fbn/mpi.h"

namespace fbn::mpi {
namespace {

std::string MpiErrorText(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<size_t>(len));
}

Status CheckMpiUsable() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized) {
    return InvalidArgument(
        "fbn::mpi: MPI is not initialized; call MPI_Init (Python: import mpi4py.MPI) before a "
        "synchronized batch normalization");
  }
  if (finalized) return InvalidArgument("fbn::mpi: MPI is already finalized");
  return Status::Ok();
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, int rank, int size) : comm_(comm), rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  Status Allgather(const void* send, int64_t bytes, void* recv) noexcept override {
    if (bytes < 0 || bytes > INT_MAX) {
      return InvalidArgument("fbn::mpi: an allgather of " + std::to_string(bytes) +
                             " bytes per rank is beyond MPI's int counts");
    }
    const int count = static_cast<int>(bytes);
    // MPI_Allgather's send buffer is non-const in MPI-2 headers.
    const int rc =
        MPI_Allgather(const_cast<void*>(send), count, MPI_BYTE, recv, count, MPI_BYTE, comm_);
    if (rc != MPI_SUCCESS) {
      return Status(StatusCode::kInternal, "fbn::mpi: MPI_Allgather failed: " + MpiErrorText(rc));
    }
    return Status::Ok();
  }

 private:
  MPI_Comm comm_;
  int rank_, size_;
};

Status Make(MPI_Comm comm, std::shared_ptr<Communicator>* out) {
  Status s = CheckMpiUsable();
  if (!s.ok()) return s;
  if (comm == MPI_COMM_NULL) return InvalidArgument("fbn::mpi: the communicator is MPI_COMM_NULL");
  int rank = 0, size = 0;
  int rc = MPI_Comm_rank(comm, &rank);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_size(comm, &size);
  if (rc != MPI_SUCCESS) {
    return InvalidArgument("fbn::mpi: not a usable communicator: " + MpiErrorText(rc));
  }
  *out = std::make_shared<MpiCommunicator>(comm, rank, size);
  return Status::Ok();
}

std::shared_ptr<Communicator> World() {
  // One world Communicator per process, created at the first use (after MPI_Init).
  static std::mutex mu;
  static std::shared_ptr<Communicator> world;
  std::lock_guard<std::mutex> lock(mu);
  if (!world) world = MakeCommunicator(MPI_COMM_WORLD);
  return world;
}

}  // namespace

std::shared_ptr<Communicator> MakeCommunicator(MPI_Comm comm) {
  std::shared_ptr<Communicator> out;
  ThrowIfError(Make(comm, &out));
  return out;
}

Status SyncFusedBatchNorm(MPI_Comm comm, OpVersion version, const FusedBatchNormInputs& inputs,
                          const FusedBatchNormAttrs& attrs, const FusedBatchNormOutputs& outputs,
                          uint64_t tag) noexcept {
  std::shared_ptr<Communicator> c;
  Status s = Make(comm, &c);
  if (!s.ok()) return s;
  return fbn::SyncFusedBatchNorm(*c, version, inputs, attrs, outputs, tag);
}

Status SyncFusedBatchNormGrad(MPI_Comm comm, OpVersion version,
                              const FusedBatchNormGradInputs& inputs,
                              const FusedBatchNormGradAttrs& attrs,
                              const FusedBatchNormGradOutputs& outputs, uint64_t tag) noexcept {
  std::shared_ptr<Communicator> c;
  Status s = Make(comm, &c);
  if (!s.ok()) return s;
  return fbn::SyncFusedBatchNormGrad(*c, version, inputs, attrs, outputs, tag);
}

bool InstallWorldAsDefault() noexcept {
  SetDefaultCommunicatorFactory(&World);
  return true;
}

}  // namespace fbn::mpi
