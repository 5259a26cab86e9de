#include "kernels/call_tuning.h"

#include <array>
#include <cstdlib>

namespace fbn::kernels {
namespace {

constexpr int kDefault = 0;      // all threads; streaming stores
constexpr int kAlternative = 1;  // one thread; regular stores
// After a switch, the first calls move the data between the cores' caches and wake or idle the
// workers: only the calls after this many in a row of one choice are timed.
constexpr int kUntimedCalls = 2;
// The slower choice runs again for kRetryCalls calls (the last one timed) every 16 calls of the
// shape while the two are within 10% of each other, and up to every 256 calls as they differ more:
// a retry costs about (kRetryCalls / period) * (slower / faster - 1) of the time.
constexpr int kRetryCalls = kUntimedCalls + 1;
int RetryPeriod(double slower, double faster) {
  const double r = slower / faster;
  return r < 1.1 ? 16 : r < 1.3 ? 32 : r < 1.6 ? 128 : 256;
}
// Until a choice has this many timed calls, its average is their minimum, and it is retried
// every kFirstRetryPeriod calls.
constexpr int kFirstSamples = 4;
constexpr int kFirstRetryPeriod = 8;
constexpr int kShapes = 64;  // shapes remembered per calling thread (direct-mapped)

bool EnvOn(const char* name) {
  const char* env = std::getenv(name);
  return env == nullptr || std::atoi(env) != 0;
}
bool TuningOn(CallTuning::Question question) {
  static const bool threads = EnvOn("FBN_TUNE_THREADS"), stores = EnvOn("FBN_TUNE_STORES");
  return question == CallTuning::Question::kThreads ? threads : stores;
}

}  // namespace

struct CallTuning::Shape {
  uint64_t key = 0;
  Question question = Question::kThreads;
  double time[2] = {0, 0};  // moving averages, seconds
  int samples[2] = {0, 0};
  int since_retry = 0;  // calls since the last retry
  int retry_left = 0;
  int last = -1;    // the choice of the previous call
  int in_row = 0;   // calls in a row with that choice
  int current = 0;  // the choice of the call in progress

  int Best() const {
    if (samples[kDefault] == 0) return kDefault;
    if (samples[kAlternative] == 0) return kAlternative;
    return time[kAlternative] < time[kDefault] ? kAlternative : kDefault;
  }
  void Record(double seconds) {
    const int k = current;
    if (samples[k] < kFirstSamples) {
      // A shape's first calls can be slow for reasons of their own (fresh buffers, a waking
      // worker): a 1x14x14x1024 float training forward's first timed call on two threads took
      // 137-642 us against 26-29 later, and kept it on one thread (56 us) for 30-40% of a
      // benchmark's calls. The fastest of the first samples starts the average.
      time[k] = samples[k] == 0 || seconds < time[k] ? seconds : time[k];
    } else {
      // Damped, and a call counts as at most 1.5 times the average: a few slow calls in a row
      // (preemption) move it little, a lasting change 1.9x within six calls.
      const double t = seconds < 1.5 * time[k] ? seconds : 1.5 * time[k];
      time[k] += 0.25 * (t - time[k]);
    }
    ++samples[k];
  }
};

namespace {

struct State {
  std::array<CallTuning::Shape, kShapes> shapes;
  CallTuning* open = nullptr;  // the outermost tuned call in progress
};
thread_local State t_state;

uint64_t Mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
  return h;
}

}  // namespace

CallTuning::CallTuning(Entry entry, DataType dtype, const Geometry& g) {
  State& st = t_state;
  if (st.open != nullptr || (!TuningOn(Question::kThreads) && !TuningOn(Question::kStores))) {
    return;
  }
  uint64_t key = 1;
  for (const int64_t v : {static_cast<int64_t>(entry), static_cast<int64_t>(dtype),
                          static_cast<int64_t>(g.channels_last), g.n, g.c, g.s}) {
    key = Mix(key, static_cast<uint64_t>(v));
  }
  key_ = key | 1;  // never 0, the empty slot's key
  st.open = this;
}

// The call's first question: the shape's choice for this call, and the clock starts (calls that
// ask nothing, one-thread ones and large ones away from the L3's size, are not timed).
CallTuning::Shape& CallTuning::Begin(Question question) {
  Shape& sh = t_state.shapes[key_ % kShapes];
  if (sh.key != key_ || sh.question != question) sh = Shape{key_, question};
  if (sh.retry_left > 0) {
    --sh.retry_left;  // `current` stays the other choice
  } else {
    sh.current = sh.Best();
    const int other = 1 - sh.current;
    if (sh.samples[kAlternative] > 0 && sh.samples[kDefault] > 0 &&
        ++sh.since_retry >= (sh.samples[other] < kFirstSamples
                                 ? kFirstRetryPeriod
                                 : RetryPeriod(sh.time[other], sh.time[sh.current]))) {
      sh.since_retry = 0;
      sh.current = other;
      sh.retry_left = kRetryCalls - 1;
    }
  }
  shape_ = &sh;
  start_ = std::chrono::steady_clock::now();
  return sh;
}

CallTuning::~CallTuning() {
  State& st = t_state;
  if (st.open != this) return;
  st.open = nullptr;
  if (shape_ == nullptr) return;
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  Shape& sh = *shape_;
  sh.in_row = sh.current == sh.last ? sh.in_row + 1 : 1;
  sh.last = sh.current;
  if (sh.in_row > kUntimedCalls) sh.Record(seconds);
}

bool CallTuning::Alternative(Question question) {
  CallTuning* call = t_state.open;
  if (call == nullptr || !TuningOn(question)) return false;  // an open call has its key
  // A call answers one question: the parts of a call that asked the other keep their default.
  if (call->shape_ != nullptr && call->shape_->question != question) return false;
  const Shape& sh = call->shape_ != nullptr ? *call->shape_ : call->Begin(question);
  return sh.current == kAlternative;
}

int CallTuning::Threads(int threads, int64_t traffic) {
  if (threads <= 1 || traffic > kMaxTraffic) return threads;
  return Alternative(Question::kThreads) ? 1 : threads;
}

bool CallTuning::KeepOutput() { return Alternative(Question::kStores); }

}  // namespace fbn::kernels
