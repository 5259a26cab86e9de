// Error model: the op entry points return Status and never throw; the convenience edge (layer,
// Python) throws fbn::Error through ThrowIfError. Messages are TensorFlow's texts where TF has one.
#ifndef FBN_STATUS_H_
#define FBN_STATUS_H_

#include <stdexcept>
#include <string>
#include <utility>

#include "fbn/export.h"

namespace fbn {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,    // bad shapes, dtypes, attributes: TensorFlow's InvalidArgument
  kResourceExhausted,  // an allocation that cannot succeed
  kInternal,           // a broken invariant inside fbn
};

FBN_API const char* StatusCodeName(StatusCode code);

class [[nodiscard]] FBN_API Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "InvalidArgument: <message>", or "OK".
  std::string ToString() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status InvalidArgument(std::string message) {
  return Status(StatusCode::kInvalidArgument, std::move(message));
}

class FBN_API Error : public std::runtime_error {
 public:
  explicit Error(const Status& status)
      : std::runtime_error(status.message()), code_(status.code()) {}
  StatusCode code() const { return code_; }

 private:
  StatusCode code_;
};

inline void ThrowIfError(const Status& status) {
  if (!status.ok()) throw Error(status);
}

}  // namespace fbn

#endif  // FBN_STATUS_H_
