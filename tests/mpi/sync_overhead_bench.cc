// The cost of synchronizing batch normalization over MPI: a training step (forward and backward)
// on each rank's part of the batch, unsynchronized (FusedBatchNorm + FusedBatchNormGrad, and the
// layer) against synchronized (SyncFusedBatchNorm + SyncFusedBatchNormGrad, and the layer with
// synchronized=true), for float32 shapes of a ResNet-like network (N, H, W, C per rank; channels
// last, and two channels first).
//
//   mpirun -np 2 build/mpi/tests/mpi/fbn_mpi_sync_bench [--iters 80] [--threads 1]
//
// Every iteration runs the four steps one after the other, each after a barrier. Per step and
// rank it records the wall time and the time spent inside the communicator's allgather calls,
// which includes waiting for the other ranks to arrive. "work" is the wall time less that: the
// rank's own computation and bookkeeping. Each number is the slowest rank's, and the table shows
// the minimum over the iterations in microseconds (medians with --median). On a machine with a
// free core per rank, a synchronized step costs its work plus one allgather latency per collective
// call (listed at the end by message size); on a shared machine the wall time also absorbs the
// other rank's scheduling delays, which the work column leaves out.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "fbn/distributed.h"
#include "fbn/layer.h"
#include "fbn/mpi.h"
#include "fbn/ops.h"
#include "fbn/threading.h"

namespace {

using Clock = std::chrono::steady_clock;

double MicrosSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

// Forwards to another communicator and adds up the time spent in its collective calls.
class TimingCommunicator final : public fbn::Communicator {
 public:
  explicit TimingCommunicator(std::shared_ptr<fbn::Communicator> inner)
      : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  fbn::Status Allgather(const void* send, int64_t bytes, void* recv) noexcept override {
    const auto t0 = Clock::now();
    fbn::Status s = inner_->Allgather(send, bytes, recv);
    micros_ += MicrosSince(t0);
    ++calls_;
    return s;
  }
  double TakeMicros() {
    const double m = micros_;
    micros_ = 0;
    return m;
  }
  int64_t TakeCalls() {
    const int64_t c = calls_;
    calls_ = 0;
    return c;
  }

 private:
  std::shared_ptr<fbn::Communicator> inner_;
  double micros_ = 0;
  int64_t calls_ = 0;
};

struct Samples {
  std::vector<double> wall, work;
};

// One step after a barrier: the slowest rank's wall time, and its time outside the allgathers.
void Measure(TimingCommunicator* comm, const std::function<void()>& step, Samples* s) {
  MPI_Barrier(MPI_COMM_WORLD);
  comm->TakeMicros();
  const auto t0 = Clock::now();
  step();
  const double wall = MicrosSince(t0);
  const double local[2] = {wall, wall - comm->TakeMicros()};
  double slowest[2];
  MPI_Allreduce(local, slowest, 2, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  s->wall.push_back(slowest[0]);
  s->work.push_back(slowest[1]);
}

double Stat(std::vector<double> v, bool median) {
  std::sort(v.begin(), v.end());
  return median ? v[v.size() / 2] : v.front();
}

fbn::Tensor Random(const fbn::Shape& shape, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> dist(1.0, 2.0);
  std::vector<double> v(static_cast<size_t>(shape.num_elements()));
  for (double& e : v) e = dist(gen);
  return fbn::Tensor::FromDoubles(fbn::DataType::kFloat32, shape, v);
}

void Check(const fbn::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int iters = 80, threads = 1;
  bool median = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) iters = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--threads") && i + 1 < argc) threads = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--median")) median = true;
  }
  fbn::SetNumThreads(threads);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  auto comm = std::make_shared<TimingCommunicator>(fbn::mpi::MakeCommunicator(MPI_COMM_WORLD));

  struct Case {
    int64_t n, h, w, c;
    bool nchw = false;
  };
  const Case cases[] = {{8, 56, 56, 64},      {8, 28, 28, 128}, {8, 14, 14, 256},
                        {8, 7, 7, 512},       {8, 7, 7, 2048},  {8, 28, 28, 128, true},
                        {8, 7, 7, 512, true}, {32, 1, 1, 64},   {32, 1, 1, 1024},
                        {4, 1, 1, 16}};
  if (rank == 0) {
    std::printf("%d ranks, %d thread(s) per rank, %s of %d steps (slowest rank), microseconds\n",
                size, threads, median ? "median" : "minimum", iters);
    std::printf("%-21s %9s %9s %9s %5s %9s %10s %10s\n", "local shape", "op", "op sync",
                "sync work", "calls", "layer", "layer sync", "sync work");
  }
  for (const Case& k : cases) {
    const fbn::Shape shape =
        k.nchw ? fbn::Shape{k.n, k.c, k.h, k.w} : fbn::Shape{k.n, k.h, k.w, k.c};
    const fbn::Tensor x = Random(shape, 1 + rank), dy = Random(shape, 100 + rank);
    const fbn::Tensor scale = fbn::Tensor::Filled(fbn::DataType::kFloat32, fbn::Shape{k.c}, 1.0);
    const fbn::Tensor empty(fbn::DataType::kFloat32, fbn::Shape{0});
    std::vector<fbn::Tensor> out;
    out.emplace_back(fbn::DataType::kFloat32, shape);
    for (int i = 0; i < 4; ++i) out.emplace_back(fbn::DataType::kFloat32, fbn::Shape{k.c});
    out.emplace_back(fbn::DataType::kFloat32, fbn::Shape{});
    std::vector<fbn::Tensor> gout;
    gout.emplace_back(fbn::DataType::kFloat32, shape);
    for (int i = 0; i < 2; ++i) gout.emplace_back(fbn::DataType::kFloat32, fbn::Shape{k.c});
    for (int i = 0; i < 2; ++i) gout.emplace_back(fbn::DataType::kFloat32, fbn::Shape{0});
    const fbn::FusedBatchNormInputs in{x.view(), scale.view(), scale.view(), empty.view(),
                                       empty.view()};
    const fbn::FusedBatchNormOutputs o{out[0].view(), out[1].view(), out[2].view(),
                                       out[3].view(), out[4].view(), out[5].view()};
    const fbn::FusedBatchNormGradInputs gin{dy.view(),     x.view(),      scale.view(),
                                            out[3].view(), out[4].view(), out[5].view()};
    const fbn::FusedBatchNormGradOutputs go{gout[0].view(), gout[1].view(), gout[2].view(),
                                            gout[3].view(), gout[4].view()};
    fbn::FusedBatchNormAttrs attrs;
    fbn::FusedBatchNormGradAttrs gattrs;
    attrs.data_format = gattrs.data_format =
        k.nchw ? fbn::TensorFormat::kNCHW : fbn::TensorFormat::kNHWC;
    fbn::BatchNormalizationOptions lo;
    lo.axis = {k.nchw ? 1 : -1};
    fbn::layers::BatchNormalization plain(lo);
    lo.synchronized = true;
    lo.communicator = comm;
    fbn::layers::BatchNormalization sync(lo);

    auto op_plain = [&] {
      Check(fbn::FusedBatchNorm(fbn::OpVersion::kV3, in, attrs, o));
      Check(fbn::FusedBatchNormGrad(fbn::OpVersion::kV3, gin, gattrs, go));
    };
    auto op_sync = [&] {
      Check(fbn::SyncFusedBatchNorm(*comm, fbn::OpVersion::kV3, in, attrs, o));
      Check(fbn::SyncFusedBatchNormGrad(*comm, fbn::OpVersion::kV3, gin, gattrs, go));
    };
    auto layer_plain = [&] {
      plain.Call(x.view(), true);
      plain.Backward(dy.view());
    };
    auto layer_sync = [&] {
      sync.Call(x.view(), true);
      sync.Backward(dy.view());
    };
    op_plain();
    layer_plain();
    layer_sync();
    comm->TakeCalls();
    op_sync();
    const int64_t calls = comm->TakeCalls();  // collective calls per synchronized step
    Samples s[4];
    for (int i = 0; i < iters; ++i) {
      Measure(comm.get(), op_plain, &s[0]);
      Measure(comm.get(), op_sync, &s[1]);
      Measure(comm.get(), layer_plain, &s[2]);
      Measure(comm.get(), layer_sync, &s[3]);
    }
    if (rank == 0) {
      const std::string name = (k.nchw ? "NCHW " : "NHWC ") + std::to_string(k.n) + "x" +
                               std::to_string(k.h) + "x" + std::to_string(k.w) + "x" +
                               std::to_string(k.c);
      std::printf("%-21s %9.1f %9.1f %9.1f %5lld %9.1f %10.1f %10.1f\n", name.c_str(),
                  Stat(s[0].wall, median), Stat(s[1].wall, median), Stat(s[1].work, median),
                  static_cast<long long>(calls), Stat(s[2].wall, median), Stat(s[3].wall, median),
                  Stat(s[3].work, median));
    }
  }

  // The latency of one allgather by size: the record's size (kSyncRecordBytes, just below Open
  // MPI's 4 KiB shared-memory eager limit) against smaller and larger ones.
  if (rank == 0) std::printf("\nallgather of B bytes per rank, microseconds (median, minimum)\n");
  for (int64_t bytes : {int64_t{256}, int64_t{1024}, fbn::kSyncRecordBytes, int64_t{4096},
                        int64_t{16384}, int64_t{65536}}) {
    std::vector<char> send(static_cast<size_t>(bytes)), recv(send.size() * size);
    Samples s;
    for (int i = 0; i < 10 * iters; ++i) {
      Measure(
          comm.get(), [&] { Check(comm->Allgather(send.data(), bytes, recv.data())); }, &s);
    }
    if (rank == 0) {
      std::printf("%8lld %9.1f %9.1f\n", static_cast<long long>(bytes), Stat(s.wall, true),
                  Stat(s.wall, false));
    }
  }
  MPI_Finalize();
  return 0;
}
