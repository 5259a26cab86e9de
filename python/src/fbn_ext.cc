// The only binding translation unit: NumPy arrays in, freshly allocated NumPy arrays out, the GIL
// released around every kernel, fbn::Status mapped to Python exceptions. No logic lives here.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "fbn/fbn.h"

namespace nb = nanobind;

// The layer, graph and optimizer bindings live in their own translation unit.
void BindLayers(nb::module_& m);

namespace {

// Python-side exception types; fbn/errors.py re-exports them.
struct InvalidArgumentException : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct ResourceExhaustedException : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct InternalException : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void Raise(const fbn::Status& s) {
  switch (s.code()) {
    case fbn::StatusCode::kOk:
      return;
    case fbn::StatusCode::kInvalidArgument:
      throw InvalidArgumentException(s.message());
    case fbn::StatusCode::kResourceExhausted:
      throw ResourceExhaustedException(s.message());
    case fbn::StatusCode::kInternal:
      throw InternalException(s.message());
  }
}

// Any dtype, C-contiguous, on the CPU; the element type comes separately as an fbn::DataType code
// (bfloat16 arrays arrive viewed as uint16).
using InArray = nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu>;
using OutArray = nb::ndarray<nb::numpy>;

fbn::DataType ToDataType(int code) {
  if (code < 0 || code > 3) {
    throw InvalidArgumentException("unknown fbn dtype code " + std::to_string(code));
  }
  return static_cast<fbn::DataType>(code);
}

fbn::ConstTensorView View(const InArray& a, int dtype_code, const char* name) {
  fbn::ConstTensorView v;
  v.dtype = ToDataType(dtype_code);
  if (a.ndim() > fbn::Shape::kMaxRank) {
    throw InvalidArgumentException(std::string(name) + " has rank " + std::to_string(a.ndim()) +
                                   ", above the supported " + std::to_string(fbn::Shape::kMaxRank));
  }
  std::vector<int64_t> dims(a.ndim());
  for (size_t i = 0; i < a.ndim(); ++i) dims[i] = static_cast<int64_t>(a.shape(i));
  v.shape = fbn::Shape(dims.data(), static_cast<int>(dims.size()));
  if (a.itemsize() != fbn::DataTypeSize(v.dtype)) {
    throw InvalidArgumentException(std::string(name) + ": array item size " +
                                   std::to_string(a.itemsize()) + " does not match dtype " +
                                   fbn::DataTypeName(v.dtype));
  }
  v.data = a.data();
  return v;
}

nb::dlpack::dtype NumpyDtype(fbn::DataType t) {
  switch (t) {
    case fbn::DataType::kFloat16:
      return nb::dtype<uint16_t>();  // reinterpreted as float16 by the Python wrapper
    case fbn::DataType::kBFloat16:
      return nb::dtype<uint16_t>();  // reinterpreted as ml_dtypes.bfloat16
    case fbn::DataType::kFloat32:
      return nb::dtype<float>();
    case fbn::DataType::kFloat64:
      return nb::dtype<double>();
  }
  return nb::dtype<float>();
}

// A fresh 64-byte-aligned array of `spec`, owned by a capsule.
struct Allocated {
  OutArray array;
  fbn::TensorView view;
};

Allocated Allocate(const fbn::TensorSpec& spec) {
  const size_t bytes =
      static_cast<size_t>(spec.shape.num_elements()) * fbn::DataTypeSize(spec.dtype);
  void* data = std::aligned_alloc(64, ((bytes + 63) / 64) * 64 + 64);
  if (!data)
    throw ResourceExhaustedException("could not allocate an output of " + std::to_string(bytes) +
                                     " bytes");
  nb::capsule owner(data, [](void* p) noexcept { std::free(p); });
  std::vector<size_t> shape(static_cast<size_t>(spec.shape.rank()));
  for (int i = 0; i < spec.shape.rank(); ++i)
    shape[static_cast<size_t>(i)] = static_cast<size_t>(spec.shape.dim(i));
  Allocated out{OutArray(data, shape.size(), shape.data(), owner, nullptr, NumpyDtype(spec.dtype)),
                fbn::TensorView{data, spec.dtype, spec.shape}};
  return out;
}

nb::tuple FusedBatchNorm(int version, const InArray& x, int x_type, const InArray& scale,
                         int scale_type, const InArray& offset, int offset_type,
                         const InArray& mean, int mean_type, const InArray& variance,
                         int variance_type, float epsilon, float exponential_avg_factor,
                         const std::string& data_format, bool is_training) {
  const auto v = static_cast<fbn::OpVersion>(version);
  fbn::FusedBatchNormAttrs attrs;
  attrs.epsilon = epsilon;
  attrs.exponential_avg_factor = exponential_avg_factor;
  attrs.is_training = is_training;
  Raise(fbn::ParseDataFormat(data_format, v, &attrs.data_format));
  fbn::FusedBatchNormInputs in{View(x, x_type, "x"), View(scale, scale_type, "scale"),
                               View(offset, offset_type, "offset"), View(mean, mean_type, "mean"),
                               View(variance, variance_type, "variance")};
  fbn::TensorSpec specs[fbn::kMaxOpOutputs];
  int n = 0;
  Raise(fbn::FusedBatchNormOutputSpecs(v, in, attrs, specs, &n));
  std::vector<Allocated> outs;
  for (int i = 0; i < n; ++i) outs.push_back(Allocate(specs[i]));
  fbn::FusedBatchNormOutputs o{outs[0].view, outs[1].view,
                               outs[2].view, outs[3].view,
                               outs[4].view, n > 5 ? outs[5].view : fbn::TensorView{}};
  fbn::Status s;
  {
    nb::gil_scoped_release release;
    s = fbn::FusedBatchNorm(v, in, attrs, o);
  }
  Raise(s);
  nb::list result;
  for (auto& a : outs) result.append(a.array);
  return nb::tuple(result);
}

nb::tuple FusedBatchNormGrad(int version, const InArray& y_backprop, const InArray& x, int x_type,
                             const InArray& scale, int scale_type, const InArray& rs1, int rs1_type,
                             const InArray& rs2, int rs2_type, const InArray& rs3, int rs3_type,
                             float epsilon, const std::string& data_format, bool is_training,
                             int dy_type) {
  const auto v = static_cast<fbn::OpVersion>(version);
  fbn::FusedBatchNormGradAttrs attrs;
  attrs.epsilon = epsilon;
  attrs.is_training = is_training;
  Raise(fbn::ParseDataFormat(data_format, v, &attrs.data_format));
  fbn::FusedBatchNormGradInputs in{
      View(y_backprop, dy_type, "y_backprop"), View(x, x_type, "x"),
      View(scale, scale_type, "scale"),        View(rs1, rs1_type, "reserve_space_1"),
      View(rs2, rs2_type, "reserve_space_2"),  View(rs3, rs3_type, "reserve_space_3")};
  fbn::TensorSpec specs[fbn::kMaxOpOutputs];
  int n = 0;
  Raise(fbn::FusedBatchNormGradOutputSpecs(v, in, attrs, specs, &n));
  std::vector<Allocated> outs;
  for (int i = 0; i < n; ++i) outs.push_back(Allocate(specs[i]));
  fbn::FusedBatchNormGradOutputs o{outs[0].view, outs[1].view, outs[2].view, outs[3].view,
                                   outs[4].view};
  fbn::Status s;
  {
    nb::gil_scoped_release release;
    s = fbn::FusedBatchNormGrad(v, in, attrs, o);
  }
  Raise(s);
  nb::list result;
  for (auto& a : outs) result.append(a.array);
  return nb::tuple(result);
}

nb::tuple Moments(const InArray& x, int x_type, const std::vector<int>& axes, bool keepdims) {
  const fbn::ConstTensorView xv = View(x, x_type, "x");
  fbn::TensorSpec spec;
  Raise(fbn::MomentsOutputSpec(xv, axes.data(), static_cast<int>(axes.size()), keepdims, &spec));
  Allocated mean = Allocate(spec), var = Allocate(spec);
  fbn::Status s;
  {
    nb::gil_scoped_release release;
    s = fbn::Moments(xv, axes.data(), static_cast<int>(axes.size()), keepdims, mean.view, var.view);
  }
  Raise(s);
  return nb::make_tuple(mean.array, var.array);
}

OutArray BatchNormalization(const InArray& x, int x_type, const InArray& mean, int mean_type,
                            const InArray& variance, int variance_type, nb::object offset,
                            int offset_type, nb::object scale, int scale_type,
                            float variance_epsilon) {
  const fbn::ConstTensorView xv = View(x, x_type, "x");
  fbn::ConstTensorView ov, sv;
  if (!offset.is_none()) ov = View(nb::cast<InArray>(offset), offset_type, "offset");
  if (!scale.is_none()) sv = View(nb::cast<InArray>(scale), scale_type, "scale");
  const fbn::ConstTensorView mv = View(mean, mean_type, "mean");
  const fbn::ConstTensorView vv = View(variance, variance_type, "variance");
  Allocated y = Allocate(fbn::TensorSpec{xv.dtype, xv.shape});
  fbn::Status s;
  {
    nb::gil_scoped_release release;
    s = fbn::BatchNormalization(xv, mv, vv, ov, sv, variance_epsilon, y.view);
  }
  Raise(s);
  return y.array;
}

}  // namespace

NB_MODULE(_fbn, m) {
  m.doc() = "fbn: TensorFlow's batch normalization as a standalone C++ library (native module)";
  nb::exception<InvalidArgumentException>(m, "InvalidArgumentError", PyExc_ValueError);
  nb::exception<ResourceExhaustedException>(m, "ResourceExhaustedError", PyExc_MemoryError);
  nb::exception<InternalException>(m, "InternalError", PyExc_RuntimeError);

  m.def("set_num_threads", &fbn::SetNumThreads, nb::arg("n"));
  m.def("get_num_threads", &fbn::GetNumThreads);
  m.attr("__version__") = FBN_VERSION_STRING;
  m.attr("DT_HALF") = static_cast<int>(fbn::DataType::kFloat16);
  m.attr("DT_BFLOAT16") = static_cast<int>(fbn::DataType::kBFloat16);
  m.attr("DT_FLOAT") = static_cast<int>(fbn::DataType::kFloat32);
  m.attr("DT_DOUBLE") = static_cast<int>(fbn::DataType::kFloat64);

  m.def("fused_batch_norm", &FusedBatchNorm, nb::arg("version"), nb::arg("x"), nb::arg("x_type"),
        nb::arg("scale"), nb::arg("scale_type"), nb::arg("offset"), nb::arg("offset_type"),
        nb::arg("mean"), nb::arg("mean_type"), nb::arg("variance"), nb::arg("variance_type"),
        nb::arg("epsilon"), nb::arg("exponential_avg_factor"), nb::arg("data_format"),
        nb::arg("is_training"));
  m.def("fused_batch_norm_grad", &FusedBatchNormGrad, nb::arg("version"), nb::arg("y_backprop"),
        nb::arg("x"), nb::arg("x_type"), nb::arg("scale"), nb::arg("scale_type"),
        nb::arg("reserve_space_1"), nb::arg("rs1_type"), nb::arg("reserve_space_2"),
        nb::arg("rs2_type"), nb::arg("reserve_space_3"), nb::arg("rs3_type"), nb::arg("epsilon"),
        nb::arg("data_format"), nb::arg("is_training"), nb::arg("dy_type"));
  m.def("moments", &Moments, nb::arg("x"), nb::arg("x_type"), nb::arg("axes"), nb::arg("keepdims"));
  m.def("batch_normalization", &BatchNormalization, nb::arg("x"), nb::arg("x_type"),
        nb::arg("mean"), nb::arg("mean_type"), nb::arg("variance"), nb::arg("variance_type"),
        nb::arg("offset").none(), nb::arg("offset_type"), nb::arg("scale").none(),
        nb::arg("scale_type"), nb::arg("variance_epsilon"));

  BindLayers(m);
}
