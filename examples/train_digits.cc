// Trains a small network with fbn's batch-normalization layer in pure C++, then infers with the
// moving statistics: the C++ counterpart of examples/train_digits.py.
//
//   64 pixels -> dense 256 -> batch norm -> ReLU -> dense 128 -> batch norm -> ReLU -> dense 10
//
// The dense layers and softmax cross-entropy are written out below; their weights are
// fbn::Variables, initialized by fbn::Initializer::HeNormal. Batch norm is
// fbn::layers::BatchNormalization (forward, backward, moving statistics), and one fbn::SGD
// optimizer updates every variable, dense and batch norm alike, then applies the layer's
// constraint (gamma >= 0).
//
// The digits come from a CSV file that examples/train_digits.py writes (scripts/demo.sh does):
//   python examples/train_digits.py --export-csv build/digits.csv
//   fbn_example_train_digits build/digits.csv [--epochs 25] [--seed 0] [--renorm]
//                            [--virtual-batch-size 8] [--no-batch-norm]
// Exits with status 1 when the test accuracy is below --min-accuracy (0.97), 2 on bad input.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "fbn/fbn.h"
#include "fbn/initializers.h"
#include "fbn/layer.h"
#include "fbn/optimizer.h"
#include "fbn/tensor.h"

namespace {

constexpr int64_t kSide = 8, kPixels = kSide * kSide, kClasses = 10;
constexpr fbn::DataType kF32 = fbn::DataType::kFloat32;
const double kPi = std::acos(-1.0);

using GradsAndVars = std::vector<std::pair<fbn::Tensor, std::shared_ptr<fbn::Variable>>>;

struct Options {
  std::string csv;
  int epochs = 25;
  int64_t batch_size = 32;
  double lr = 0.1;
  double momentum = 0.9;
  uint64_t seed = 0;
  int max_shift = 1;
  bool batch_norm = true;
  bool renorm = false;
  int64_t virtual_batch_size = 0;
  int threads = 2;
  double min_accuracy = 0.97;
};

// --------------------------------------------------------------------------------------- data

struct Dataset {
  std::vector<float> x;  // images x pixels, raw grey levels 0..16
  std::vector<int> y;
  int64_t size() const { return static_cast<int64_t>(y.size()); }
};

// Reads the CSV of examples/train_digits.py: a header "split,label,pixel0,...,pixel63", then one
// row per image: "train" or "test", the label, 64 pixel values.
bool LoadDigits(const std::string& path, Dataset* train, Dataset* test, std::string* error) {
  std::ifstream in(path);
  if (!in) {
    *error = "cannot open the digits file '" + path + "': " + std::strerror(errno) +
             ".\nExport it first: python examples/train_digits.py --export-csv " + path +
             "\n(scripts/demo.sh does this before running this program)";
    return false;
  }
  std::string line;
  if (!std::getline(in, line) || line.rfind("split,label,pixel0,", 0) != 0) {
    *error = path + ": not a digits CSV (expected the header split,label,pixel0,...)";
    return false;
  }
  int line_no = 1;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.empty()) continue;
    std::stringstream row(line);
    std::string field;
    std::getline(row, field, ',');
    Dataset* set = field == "train" ? train : field == "test" ? test : nullptr;
    std::vector<float> values;
    while (std::getline(row, field, ',')) {
      char* end = nullptr;
      values.push_back(std::strtof(field.c_str(), &end));
      if (end == field.c_str()) values.pop_back();
    }
    if (set == nullptr || values.size() != kPixels + 1 || values[0] < 0 || values[0] >= kClasses) {
      *error = path + ":" + std::to_string(line_no) + ": malformed row";
      return false;
    }
    set->y.push_back(static_cast<int>(values[0]));
    set->x.insert(set->x.end(), values.begin() + 1, values.end());
  }
  if (train->size() == 0 || test->size() == 0) {
    *error = path + ": no training or no test images";
    return false;
  }
  return true;
}

// The image moved by (dy, dx) pixels, background filling in.
void ShiftImage(const float* src, int dy, int dx, float* dst) {
  for (int64_t r = 0; r < kSide; ++r) {
    for (int64_t c = 0; c < kSide; ++c) {
      const int64_t sr = r - dy, sc = c - dx;
      dst[r * kSide + c] =
          sr >= 0 && sr < kSide && sc >= 0 && sc < kSide ? src[sr * kSide + sc] : 0.0f;
    }
  }
}

// Per-pixel mean and standard deviation over the training images in every shifted position
// (standard deviations below one grey level are raised to one), as train_digits.py computes them.
void PixelStatistics(const Dataset& train, int max_shift, std::vector<double>* mean,
                     std::vector<double>* stddev) {
  std::vector<double> sum(kPixels), sum_sq(kPixels);
  std::vector<float> shifted(kPixels);
  int64_t count = 0;
  for (int dy = -max_shift; dy <= max_shift; ++dy) {
    for (int dx = -max_shift; dx <= max_shift; ++dx) {
      for (int64_t i = 0; i < train.size(); ++i, ++count) {
        ShiftImage(&train.x[i * kPixels], dy, dx, shifted.data());
        for (int64_t p = 0; p < kPixels; ++p) {
          sum[p] += shifted[p];
          sum_sq[p] += double(shifted[p]) * shifted[p];
        }
      }
    }
  }
  mean->resize(kPixels);
  stddev->resize(kPixels);
  for (int64_t p = 0; p < kPixels; ++p) {
    (*mean)[p] = sum[p] / count;
    const double var = std::max(0.0, sum_sq[p] / count - (*mean)[p] * (*mean)[p]);
    (*stddev)[p] = std::max(1.0, std::sqrt(var));
  }
}

// ------------------------------------------------------------------------------------ network

float* F(fbn::Tensor& t) { return t.data_as<float>(); }
const float* F(const fbn::Tensor& t) { return t.data_as<float>(); }

// y = x w (+ b) with w and b fbn::Variables; Backward appends (gradient, variable) pairs.
class Dense {
 public:
  Dense(const std::string& name, int64_t in, int64_t out, bool bias, uint64_t seed)
      : in_(in), out_(out) {
    const fbn::Initializer he = fbn::Initializer::HeNormal(seed);
    kernel_ = std::make_shared<fbn::Variable>(name + "/kernel:0", he(fbn::Shape{in, out}, kF32),
                                              /*trainable=*/true);
    if (bias) {
      bias_ = std::make_shared<fbn::Variable>(name + "/bias:0", fbn::Tensor(kF32, {out}), true);
    }
  }

  fbn::Tensor Forward(const fbn::Tensor& x) {
    x_ = x;
    const int64_t n = x.shape().dim(0);
    fbn::Tensor y(kF32, {n, out_});
    const float* w = F(kernel_->value());
    for (int64_t i = 0; i < n; ++i) {
      float* yi = F(y) + i * out_;
      if (bias_) std::copy_n(F(bias_->value()), out_, yi);
      for (int64_t k = 0; k < in_; ++k) {
        const float xk = F(x_)[i * in_ + k];
        if (xk == 0.0f) continue;  // after a ReLU, many are
        const float* wk = w + k * out_;
        for (int64_t j = 0; j < out_; ++j) yi[j] += xk * wk[j];
      }
    }
    return y;
  }

  fbn::Tensor Backward(const fbn::Tensor& dy, GradsAndVars* grads) {
    const int64_t n = dy.shape().dim(0);
    fbn::Tensor dx(kF32, {n, in_}), dw(kF32, {in_, out_});
    const float* w = F(kernel_->value());
    for (int64_t i = 0; i < n; ++i) {
      const float* dyi = F(dy) + i * out_;
      for (int64_t k = 0; k < in_; ++k) {
        const float* wk = w + k * out_;
        float* dwk = F(dw) + k * out_;
        const float xk = F(x_)[i * in_ + k];
        float s = 0.0f;
        for (int64_t j = 0; j < out_; ++j) {
          s += dyi[j] * wk[j];
          dwk[j] += xk * dyi[j];
        }
        F(dx)[i * in_ + k] = s;
      }
    }
    grads->emplace_back(std::move(dw), kernel_);
    if (bias_) {
      fbn::Tensor db(kF32, {out_});
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t j = 0; j < out_; ++j) F(db)[j] += F(dy)[i * out_ + j];
      }
      grads->emplace_back(std::move(db), bias_);
    }
    return dx;
  }

 private:
  int64_t in_, out_;
  std::shared_ptr<fbn::Variable> kernel_, bias_;
  fbn::Tensor x_;
};

// Dense -> batch norm -> ReLU blocks, then a dense softmax classifier.
class Network {
 public:
  Network(const Options& opt, const std::vector<int64_t>& hidden) {
    int64_t in = kPixels;
    for (size_t i = 0; i < hidden.size(); ++i) {
      // The dense bias before a batch norm would be cancelled by its mean: beta replaces it.
      dense_.emplace_back("dense_" + std::to_string(i), in, hidden[i], !opt.batch_norm,
                          opt.seed * 16 + i);
      if (opt.batch_norm) {
        fbn::BatchNormalizationOptions bn;  // TensorFlow's defaults: momentum 0.99, eps 1e-3
        bn.gamma_constraint = fbn::Constraint::NonNeg();  // applied by fbn::SGD
        bn.renorm = opt.renorm;
        bn.renorm_clipping = {3.0, 1.0 / 3.0, 5.0};  // rmax, rmin, dmax
        if (opt.virtual_batch_size > 0) bn.virtual_batch_size = opt.virtual_batch_size;
        bn_.push_back(std::make_unique<fbn::layers::BatchNormalization>(bn));
      }
      in = hidden[i];
    }
    relu_.resize(hidden.size());
    out_ = std::make_unique<Dense>("logits", in, kClasses, true, opt.seed * 16 + hidden.size());
  }

  // training=true: batch norm normalizes with the batch's statistics and updates its moving mean
  // and variance; training=false: it normalizes with the moving statistics.
  fbn::Tensor Forward(const fbn::Tensor& x, bool training) {
    fbn::Tensor h = x;
    for (size_t i = 0; i < dense_.size(); ++i) {
      h = dense_[i].Forward(h);
      if (!bn_.empty()) h = bn_[i]->Call(h.view(), training);
      for (int64_t j = 0; j < h.num_elements(); ++j) F(h)[j] = std::max(F(h)[j], 0.0f);
      relu_[i] = h;
    }
    return out_->Forward(h);
  }

  // Gradients of every variable for the logits' gradient, paired with their variables.
  GradsAndVars Backward(const fbn::Tensor& dlogits) {
    GradsAndVars grads;
    fbn::Tensor d = out_->Backward(dlogits, &grads);
    for (size_t i = dense_.size(); i-- > 0;) {
      for (int64_t j = 0; j < d.num_elements(); ++j) {
        if (F(relu_[i])[j] <= 0.0f) F(d)[j] = 0.0f;
      }
      if (!bn_.empty()) {
        fbn::BatchNormalizationGradients g = bn_[i]->Backward(d.view());
        grads.emplace_back(std::move(g.dgamma), bn_[i]->gamma());
        grads.emplace_back(std::move(g.dbeta), bn_[i]->beta());
        d = std::move(g.dx);
      }
      d = dense_[i].Backward(d, &grads);
    }
    return grads;
  }

  double MinGamma() const {
    double m = INFINITY;
    for (const auto& bn : bn_) {
      if (const std::shared_ptr<fbn::Variable> gamma = bn->gamma()) {
        for (double v : gamma->value().ToDoubles()) m = std::min(m, v);
      }
    }
    return m;
  }

 private:
  std::vector<Dense> dense_;
  std::vector<std::unique_ptr<fbn::layers::BatchNormalization>> bn_;
  std::vector<fbn::Tensor> relu_;
  std::unique_ptr<Dense> out_;
};

// Mean softmax cross-entropy; `dlogits` receives its gradient, `correct` the argmax hits.
double SoftmaxCrossEntropy(const fbn::Tensor& logits, const int* labels, fbn::Tensor* dlogits,
                           int64_t* correct) {
  const int64_t n = logits.shape().dim(0);
  *dlogits = fbn::Tensor(kF32, {n, kClasses});
  double loss = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const float* z = F(logits) + i * kClasses;
    float* p = F(*dlogits) + i * kClasses;
    const int64_t best = std::max_element(z, z + kClasses) - z;
    *correct += best == labels[i];
    double sum = 0.0;
    for (int64_t j = 0; j < kClasses; ++j) sum += std::exp(double(z[j]) - z[best]);
    for (int64_t j = 0; j < kClasses; ++j) {
      const double pj = std::exp(double(z[j]) - z[best]) / sum;
      p[j] = static_cast<float>((pj - (j == labels[i])) / n);
    }
    loss -= double(z[labels[i]]) - z[best] - std::log(sum);
  }
  return loss / n;
}

// --------------------------------------------------------------------------------- progress

// A one-line bar, redrawn in place on a terminal; elsewhere (CI logs) only finished lines.
class Progress {
 public:
  Progress(int64_t total, std::string prefix)
      : total_(total), prefix_(std::move(prefix)), tty_(isatty(STDOUT_FILENO) != 0) {}
  void Update(int64_t done, const std::string& suffix) const {
    if (!tty_) return;
    std::printf("\r\033[K%s", Line(done, suffix).c_str());
    std::fflush(stdout);
  }
  void Finish(const std::string& suffix) const {
    std::printf("%s%s\n", tty_ ? "\r\033[K" : "", Line(total_, suffix).c_str());
    std::fflush(stdout);
  }

 private:
  std::string Line(int64_t done, const std::string& suffix) const {
    const int64_t width = 24, filled = width * done / std::max<int64_t>(total_, 1);
    return prefix_ + " [" + std::string(filled, '#') + std::string(width - filled, '-') + "] " +
           suffix;
  }
  int64_t total_;
  std::string prefix_;
  bool tty_;
};

__attribute__((format(printf, 1, 2))) std::string Format(const char* fmt, ...) {
  char buf[256];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, args);
  va_end(args);
  return buf;
}

// ----------------------------------------------------------------------------------- main

int Usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s DIGITS.csv [--epochs N] [--seed N] [--batch-size N] [--lr X]\n"
               "       [--renorm] [--virtual-batch-size N] [--no-batch-norm] [--max-shift N]\n"
               "       [--threads N] [--min-accuracy X]\n"
               "DIGITS.csv: python examples/train_digits.py --export-csv DIGITS.csv\n",
               argv0);
  return 2;
}

int Run(const Options& opt) {
  Dataset train, test;
  std::string error;
  if (!LoadDigits(opt.csv, &train, &test, &error)) {
    std::fprintf(stderr, "train_digits: %s\n", error.c_str());
    return 2;
  }
  fbn::SetNumThreads(opt.threads);
  std::vector<double> mean, stddev;
  PixelStatistics(train, opt.max_shift, &mean, &stddev);
  auto standardize = [&](const float* image, float* out) {
    for (int64_t p = 0; p < kPixels; ++p) out[p] = float((image[p] - mean[p]) / stddev[p]);
  };
  fbn::Tensor x_test(kF32, {test.size(), kPixels});
  for (int64_t i = 0; i < test.size(); ++i) {
    standardize(&test.x[i * kPixels], F(x_test) + i * kPixels);
  }

  const char* variant = opt.renorm                   ? "batch renorm"
                        : opt.virtual_batch_size > 0 ? "batch norm in ghost batches"
                                                     : "batch norm";
  std::printf("fbn %s C++ (%d threads): digits from %s, %lld training and %lld test images\n",
              FBN_VERSION_STRING, fbn::GetNumThreads(), opt.csv.c_str(),
              static_cast<long long>(train.size()), static_cast<long long>(test.size()));
  std::printf(
      "network 64-256-128-10 dense, He init; fbn::SGD lr %g (cosine decay) momentum %g, batch "
      "%lld, %d epochs, images shifted by up to %d pixel, seed %llu\n\n",
      opt.lr, opt.momentum, static_cast<long long>(opt.batch_size), opt.epochs, opt.max_shift,
      static_cast<unsigned long long>(opt.seed));
  if (opt.batch_norm) {
    std::printf(
        "Training with %s (dense -> fbn::layers::BatchNormalization -> ReLU), every "
        "variable updated by fbn::SGD:\n",
        variant);
  } else {
    std::printf(
        "Training without batch norm (dense -> ReLU), every variable updated by "
        "fbn::SGD:\n");
  }

  Network net(opt, {256, 128});
  // One optimizer for every variable: dense kernels and biases, batch norm's gamma and beta.
  // Its learning rate is fixed at construction, so the cosine schedule scales the gradients by
  // lr(t) / lr: velocity = momentum * velocity - lr(t) * gradient, as Keras's SGD with a schedule.
  fbn::SGD sgd(opt.lr, opt.momentum);
  std::mt19937_64 rng(opt.seed + 1);
  std::uniform_int_distribution<int> shift(-opt.max_shift, opt.max_shift);
  std::vector<int64_t> order(static_cast<size_t>(train.size()));
  std::iota(order.begin(), order.end(), 0);
  const int64_t steps = train.size() / opt.batch_size;  // the last partial batch is dropped
  fbn::Tensor x(kF32, {opt.batch_size, kPixels});
  std::vector<int> labels(static_cast<size_t>(opt.batch_size));
  std::vector<float> shifted(kPixels);
  double seconds = 0.0, test_acc = 0.0;

  for (int epoch = 1; epoch <= opt.epochs; ++epoch) {
    const auto start = std::chrono::steady_clock::now();
    Progress bar(steps, Format("  epoch %2d/%d", epoch, opt.epochs));
    std::shuffle(order.begin(), order.end(), rng);
    double loss_sum = 0.0;
    int64_t correct = 0;
    for (int64_t step = 0; step < steps; ++step) {
      for (int64_t b = 0; b < opt.batch_size; ++b) {
        const int64_t i = order[step * opt.batch_size + b];
        const int dy = shift(rng), dx = shift(rng);
        ShiftImage(&train.x[i * kPixels], dy, dx, shifted.data());
        standardize(shifted.data(), F(x) + b * kPixels);
        labels[b] = train.y[i];
      }
      fbn::Tensor dlogits;
      loss_sum +=
          SoftmaxCrossEntropy(net.Forward(x, /*training=*/true), labels.data(), &dlogits, &correct);
      GradsAndVars grads = net.Backward(dlogits);
      const double t = double((epoch - 1) * steps + step) / double(opt.epochs * steps);
      const float scale = static_cast<float>(0.5 * (1.0 + std::cos(kPi * t)));
      for (auto& gv : grads) {
        for (int64_t j = 0; j < gv.first.num_elements(); ++j) F(gv.first)[j] *= scale;
      }
      sgd.ApplyGradients(grads);
      if (step % 4 == 3 || step == steps - 1) {
        bar.Update(step + 1, Format("loss %.4f  acc %5.2f%%", loss_sum / double(step + 1),
                                    100.0 * correct / double((step + 1) * opt.batch_size)));
      }
    }
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

    // Inference mode: the moving statistics; the test set is one batch.
    fbn::Tensor logits = net.Forward(x_test, /*training=*/false);
    int64_t hits = 0;
    for (int64_t i = 0; i < test.size(); ++i) {
      const float* z = F(logits) + i * kClasses;
      hits += std::max_element(z, z + kClasses) - z == test.y[i];
    }
    test_acc = double(hits) / double(test.size());
    bar.Finish(Format("loss %.4f  acc %5.2f%%  ", loss_sum / double(steps),
                      100.0 * correct / double(steps * opt.batch_size)) +
               Format("test acc (inference) %5.2f%%", 100.0 * test_acc));
  }
  if (opt.batch_norm && !(net.MinGamma() >= 0.0)) {
    std::fprintf(stderr, "train_digits: gamma's non_neg constraint was not applied\n");
    return 1;
  }
  std::printf(
      "Test accuracy in inference mode%s: %.2f%% (%lld errors of %lld), trained in %.1f s\n",
      opt.batch_norm ? " (moving statistics)" : "", 100.0 * test_acc,
      std::llround((1.0 - test_acc) * double(test.size())), static_cast<long long>(test.size()),
      seconds);
  if (test_acc < opt.min_accuracy) {
    std::printf("FAILED: test accuracy %.2f%% < %.0f%%\n", 100.0 * test_acc,
                100.0 * opt.min_accuracy);
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--renorm") {
      opt.renorm = true;
    } else if (arg == "--no-batch-norm") {
      opt.batch_norm = false;
    } else if (arg == "--epochs" && has_value) {
      opt.epochs = std::atoi(argv[++i]);
    } else if (arg == "--seed" && has_value) {
      opt.seed = std::strtoull(argv[++i], nullptr, 10);
    } else if (arg == "--batch-size" && has_value) {
      opt.batch_size = std::atoll(argv[++i]);
    } else if (arg == "--lr" && has_value) {
      opt.lr = std::atof(argv[++i]);
    } else if (arg == "--virtual-batch-size" && has_value) {
      opt.virtual_batch_size = std::atoll(argv[++i]);
    } else if (arg == "--max-shift" && has_value) {
      opt.max_shift = std::atoi(argv[++i]);
    } else if (arg == "--threads" && has_value) {
      opt.threads = std::atoi(argv[++i]);
    } else if (arg == "--min-accuracy" && has_value) {
      opt.min_accuracy = std::atof(argv[++i]);
    } else if (!arg.empty() && arg[0] != '-' && opt.csv.empty()) {
      opt.csv = arg;
    } else {
      return Usage(argv[0]);
    }
  }
  if (opt.csv.empty() || opt.epochs < 1 || opt.batch_size < 1 || opt.max_shift < 0 ||
      (opt.virtual_batch_size > 0 && opt.batch_size % opt.virtual_batch_size != 0)) {
    return Usage(argv[0]);
  }
  try {
    return Run(opt);
  } catch (const fbn::Error& e) {  // fbn::ValueError and fbn::TypeError included
    std::fprintf(stderr, "train_digits: fbn error: %s\n", e.what());
    return 1;
  }
}
