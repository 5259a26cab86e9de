// fbn over MPI (target fbn::mpi, built with -DFBN_WITH_MPI=ON): a Communicator for an MPI_Comm,
// the synchronized ops on an MPI_Comm, and MPI_COMM_WORLD as the default communicator of
// synchronized layers.
//
//   MPI_Init(&argc, &argv);
//   fbn::BatchNormalizationOptions o;
//   o.synchronized = true;                                  // over MPI_COMM_WORLD by default
//   o.communicator = fbn::mpi::MakeCommunicator(my_comm);   // or over any communicator
//   fbn::layers::BatchNormalization bn(o);
//
// Each rank calls the layer (or the ops) on its own part of the batch; see fbn/distributed.h for
// the protocol and its guarantees. fbn does not duplicate the communicator: its collective calls
// are ordinary MPI_Allgather calls on it, ordered with the caller's own collectives, and the
// communicator must stay valid while a layer or Communicator uses it.
#ifndef FBN_MPI_H_
#define FBN_MPI_H_

#include <mpi.h>

#include <cstdint>
#include <memory>

#include "fbn/distributed.h"
#include "fbn/layer.h"
#include "fbn/mpi_export.h"
#include "fbn/ops.h"

namespace fbn::mpi {

// A Communicator over `comm`. Throws fbn::Error (InvalidArgument) when MPI is not initialized (or
// already finalized) or `comm` is MPI_COMM_NULL.
FBN_MPI_API std::shared_ptr<Communicator> MakeCommunicator(MPI_Comm comm = MPI_COMM_WORLD);

// fbn::SyncFusedBatchNorm / SyncFusedBatchNormGrad (fbn/distributed.h) over `comm`.
FBN_MPI_API Status SyncFusedBatchNorm(MPI_Comm comm, OpVersion version,
                                      const FusedBatchNormInputs& inputs,
                                      const FusedBatchNormAttrs& attrs,
                                      const FusedBatchNormOutputs& outputs,
                                      uint64_t tag = 0) noexcept;
FBN_MPI_API Status SyncFusedBatchNormGrad(MPI_Comm comm, OpVersion version,
                                          const FusedBatchNormGradInputs& inputs,
                                          const FusedBatchNormGradAttrs& attrs,
                                          const FusedBatchNormGradOutputs& outputs,
                                          uint64_t tag = 0) noexcept;

// `options` with synchronized = true over `comm`.
inline BatchNormalizationOptions Synchronized(BatchNormalizationOptions options,
                                              MPI_Comm comm = MPI_COMM_WORLD) {
  options.synchronized = true;
  options.communicator = MakeCommunicator(comm);
  return options;
}

// Makes MPI_COMM_WORLD the default communicator (fbn::DefaultCommunicator()); the world
// Communicator is created at the first synchronized call, after MPI_Init. Every program that
// includes this header does it before main() runs.
FBN_MPI_API bool InstallWorldAsDefault() noexcept;
namespace internal {
inline const bool kWorldInstalled = InstallWorldAsDefault();
}  // namespace internal

}  // namespace fbn::mpi

#endif  // FBN_MPI_H_
