// Bindings of the batch-normalization layer, graph and optimizer (fbn/layer.h, fbn/graph.h,
// fbn/optimizer.h). Kept apart from fbn_ext.cc so the op bindings and the layer bindings evolve
// independently. No logic lives here: Python callables are wrapped into the C++ std::function
// types, tensors cross as NumPy arrays (copied), and fbn's exceptions map to Python's.
//
// The GIL is held throughout: layer calls may invoke Python callables (initializers,
// regularizers, constraints, adjustment).
//
// Synchronized layers take an fbn Communicator: fbn.layers turns an mpi4py communicator into one
// through _mpi_communicator (only in a build with FBN_WITH_MPI, which links MPI) or, for a group
// of one, _single_process_communicator (any build).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fbn/distributed.h"
#include "fbn/graph.h"
#include "fbn/initializers.h"
#include "fbn/layer.h"
#include "fbn/optimizer.h"
#include "fbn/tensor.h"

#ifdef FBN_PYTHON_WITH_MPI
#include <mpi.h>

#include "fbn/mpi.h"
#endif

namespace nb = nanobind;

namespace {

using InArray = nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu>;

PyObject* g_invalid_argument = nullptr;
PyObject* g_resource_exhausted = nullptr;
PyObject* g_internal = nullptr;

// --- Tensors <-> NumPy (copies).

nb::object NumpyDtype(fbn::DataType t) {
  nb::module_ np = nb::module_::import_("numpy");
  switch (t) {
    case fbn::DataType::kFloat16:
      return np.attr("float16");
    case fbn::DataType::kBFloat16:
      return nb::module_::import_("ml_dtypes").attr("bfloat16");
    case fbn::DataType::kFloat32:
      return np.attr("float32");
    case fbn::DataType::kFloat64:
      return np.attr("float64");
  }
  return np.attr("float32");
}

nb::object ToNumpy(const fbn::Tensor& t) {
  if (!t.valid()) return nb::none();
  auto* owned = new fbn::Tensor(t);
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<fbn::Tensor*>(p); });
  std::vector<size_t> shape(static_cast<size_t>(t.shape().rank()));
  for (int i = 0; i < t.shape().rank(); ++i)
    shape[static_cast<size_t>(i)] = static_cast<size_t>(t.shape().dim(i));
  nb::dlpack::dtype dt;
  switch (t.dtype()) {
    case fbn::DataType::kFloat32:
      dt = nb::dtype<float>();
      break;
    case fbn::DataType::kFloat64:
      dt = nb::dtype<double>();
      break;
    default:
      dt = nb::dtype<uint16_t>();  // viewed as float16 / bfloat16 below
      break;
  }
  nb::object arr = nb::cast(
      nb::ndarray<nb::numpy>(owned->data(), shape.size(), shape.data(), owner, nullptr, dt));
  if (t.dtype() == fbn::DataType::kFloat16 || t.dtype() == fbn::DataType::kBFloat16) {
    arr = arr.attr("view")(NumpyDtype(t.dtype()));
  }
  return arr;
}

// Any array-like (NumPy, lists, TensorFlow eager tensors, scalars) as a Tensor of `dtype`.
fbn::Tensor ToTensor(nb::handle obj, fbn::DataType dtype) {
  nb::module_ np = nb::module_::import_("numpy");
  nb::object arr = np.attr("ascontiguousarray")(obj, np.attr("float64"));
  auto a = nb::cast<InArray>(arr);
  std::vector<int64_t> dims(a.ndim());
  for (size_t i = 0; i < a.ndim(); ++i) dims[i] = static_cast<int64_t>(a.shape(i));
  fbn::Tensor t(fbn::DataType::kFloat64, fbn::Shape(dims.data(), static_cast<int>(dims.size())));
  if (t.num_bytes()) std::memcpy(t.data(), a.data(), t.num_bytes());
  return t.Cast(dtype);
}

fbn::ConstTensorView View(const InArray& a, int dtype_code) {
  if (dtype_code < 0 || dtype_code > 3) throw fbn::TypeError("unknown fbn dtype code");
  std::vector<int64_t> dims(a.ndim());
  for (size_t i = 0; i < a.ndim(); ++i) dims[i] = static_cast<int64_t>(a.shape(i));
  fbn::ConstTensorView v;
  v.dtype = static_cast<fbn::DataType>(dtype_code);
  if (a.ndim() > static_cast<size_t>(fbn::Shape::kMaxRank)) {
    throw fbn::ValueError("inputs of rank " + std::to_string(a.ndim()) + " are not supported");
  }
  v.shape = fbn::Shape(dims.data(), static_cast<int>(dims.size()));
  if (a.itemsize() != fbn::DataTypeSize(v.dtype)) throw fbn::TypeError("array item size mismatch");
  v.data = a.data();
  return v;
}

nb::tuple ShapeTuple(const fbn::Shape& s) {
  nb::list l;
  for (int i = 0; i < s.rank(); ++i) l.append(s.dim(i));
  return nb::tuple(l);
}

std::string DtypeName(fbn::DataType t) {
  switch (t) {
    case fbn::DataType::kFloat16:
      return "float16";
    case fbn::DataType::kBFloat16:
      return "bfloat16";
    case fbn::DataType::kFloat32:
      return "float32";
    case fbn::DataType::kFloat64:
      return "float64";
  }
  return "float32";
}

fbn::Shape ToShape(const std::vector<int64_t>& dims) {
  return fbn::Shape(dims.data(), static_cast<int>(dims.size()));
}

// --- Python callables as the C++ function types. Each call takes the GIL (held already when the
// layer is called from Python, but a C++ caller may run them from elsewhere).

fbn::Initializer InitializerFromCallable(nb::object fn, std::string name) {
  auto holder = std::make_shared<nb::object>(std::move(fn));
  return fbn::Initializer(
      [holder](const fbn::Shape& shape, fbn::DataType dtype) {
        nb::gil_scoped_acquire gil;
        nb::object value = (*holder)(ShapeTuple(shape), NumpyDtype(dtype));
        return ToTensor(value, dtype);
      },
      std::move(name));
}

fbn::Regularizer RegularizerFromCallable(nb::object fn, nb::object gradient, std::string name) {
  auto holder = std::make_shared<nb::object>(std::move(fn));
  fbn::Regularizer::GradientFn grad_fn;
  if (!gradient.is_none()) {
    auto gholder = std::make_shared<nb::object>(std::move(gradient));
    grad_fn = [gholder](const fbn::Tensor& w) {
      nb::gil_scoped_acquire gil;
      return ToTensor((*gholder)(ToNumpy(w)), w.dtype());
    };
  }
  return fbn::Regularizer(
      [holder](const fbn::Tensor& w) {
        nb::gil_scoped_acquire gil;
        nb::object loss = (*holder)(ToNumpy(w));
        fbn::Tensor t = ToTensor(loss, fbn::DataType::kFloat64);
        if (t.num_elements() != 1) {
          throw fbn::ValueError("a regularizer must return a scalar, got shape " +
                                fbn::PyTupleString(t.shape()));
        }
        return t.Get(0);
      },
      std::move(grad_fn), std::move(name));
}

fbn::Constraint ConstraintFromCallable(nb::object fn, std::string name) {
  auto holder = std::make_shared<nb::object>(std::move(fn));
  return fbn::Constraint(
      [holder](const fbn::Tensor& w) {
        nb::gil_scoped_acquire gil;
        return ToTensor((*holder)(ToNumpy(w)), w.dtype());
      },
      std::move(name));
}

fbn::Adjustment AdjustmentFromCallable(nb::object fn) {
  auto holder = std::make_shared<nb::object>(std::move(fn));
  return [holder](const fbn::Shape& shape) {
    nb::gil_scoped_acquire gil;
    // TensorFlow passes tf.shape(inputs), an int32 vector.
    nb::module_ np = nb::module_::import_("numpy");
    nb::object shape_arr = np.attr("array")(ShapeTuple(shape), np.attr("int32"));
    nb::object result = (*holder)(shape_arr);
    nb::sequence seq = nb::cast<nb::sequence>(result);
    if (nb::len(seq) != 2) throw fbn::ValueError("`adjustment` must return a pair (scale, bias)");
    fbn::AdjustmentResult r;
    r.scale = ToTensor(seq[0], fbn::DataType::kFloat64);
    r.bias = ToTensor(seq[1], fbn::DataType::kFloat64);
    return r;
  };
}

fbn::Training ToTraining(nb::handle obj) {
  if (nb::isinstance<fbn::TrainingFlag>(obj)) {
    return fbn::Training(nb::cast<std::shared_ptr<fbn::TrainingFlag>>(obj));
  }
  return fbn::Training(nb::cast<bool>(nb::bool_(obj)));
}

nb::object Downcast(const std::shared_ptr<fbn::GraphObject>& o) {
  if (auto v = std::dynamic_pointer_cast<fbn::Variable>(o)) return nb::cast(v);
  if (auto u = std::dynamic_pointer_cast<fbn::UpdateOp>(o)) return nb::cast(u);
  if (auto l = std::dynamic_pointer_cast<fbn::RegularizationLoss>(o)) return nb::cast(l);
  return nb::cast(o);
}

fbn::Reuse ToReuse(int code) {
  switch (code) {
    case 1:
      return fbn::Reuse::kReuse;
    case 2:
      return fbn::Reuse::kAutoReuse;
    default:
      return fbn::Reuse::kInherit;
  }
}

struct LayerArgs {
  std::vector<int> axis = {-1};
  double momentum = 0.99, epsilon = 1e-3;
  bool center = true, scale = true;
  fbn::Initializer beta_initializer, gamma_initializer, moving_mean_initializer,
      moving_variance_initializer;
  std::optional<fbn::Regularizer> beta_regularizer, gamma_regularizer;
  std::optional<fbn::Constraint> beta_constraint, gamma_constraint;
  bool renorm = false;
  std::optional<double> rmax, rmin, dmax;
  double renorm_momentum = 0.99;
  std::optional<bool> fused;
  bool trainable = true;
  std::optional<int64_t> virtual_batch_size;
  nb::object adjustment = nb::none();
  std::string name;
  bool keras_v2 = false;
  bool synchronized = false;
  std::shared_ptr<fbn::Communicator> communicator;
};

fbn::BatchNormalizationOptions ToOptions(const LayerArgs& a) {
  fbn::BatchNormalizationOptions o;
  o.axis = a.axis;
  o.momentum = a.momentum;
  o.epsilon = a.epsilon;
  o.center = a.center;
  o.scale = a.scale;
  o.beta_initializer = a.beta_initializer;
  o.gamma_initializer = a.gamma_initializer;
  o.moving_mean_initializer = a.moving_mean_initializer;
  o.moving_variance_initializer = a.moving_variance_initializer;
  if (a.beta_regularizer) o.beta_regularizer = *a.beta_regularizer;
  if (a.gamma_regularizer) o.gamma_regularizer = *a.gamma_regularizer;
  if (a.beta_constraint) o.beta_constraint = *a.beta_constraint;
  if (a.gamma_constraint) o.gamma_constraint = *a.gamma_constraint;
  o.renorm = a.renorm;
  o.renorm_clipping = fbn::RenormClipping{a.rmax, a.rmin, a.dmax};
  o.renorm_momentum = a.renorm_momentum;
  o.fused = a.fused;
  o.trainable = a.trainable;
  o.virtual_batch_size = a.virtual_batch_size;
  if (!a.adjustment.is_none()) o.adjustment = AdjustmentFromCallable(a.adjustment);
  o.name = a.name;
  o.behavior = a.keras_v2 ? fbn::LayerBehavior::kKerasV2 : fbn::LayerBehavior::kV1;
  o.synchronized = a.synchronized;
  o.communicator = a.communicator;
  return o;
}

void TranslateErrors(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const fbn::ValueError& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const fbn::TypeError& e) {
    PyErr_SetString(PyExc_TypeError, e.what());
  } catch (const fbn::Error& e) {
    PyObject* type = g_internal;
    if (e.code() == fbn::StatusCode::kInvalidArgument) type = g_invalid_argument;
    if (e.code() == fbn::StatusCode::kResourceExhausted) type = g_resource_exhausted;
    PyErr_SetString(type ? type : PyExc_RuntimeError, e.what());
  }
}

}  // namespace

void BindLayers(nb::module_& m) {
  g_invalid_argument = m.attr("InvalidArgumentError").ptr();
  g_resource_exhausted = m.attr("ResourceExhaustedError").ptr();
  g_internal = m.attr("InternalError").ptr();
  Py_XINCREF(g_invalid_argument);
  Py_XINCREF(g_resource_exhausted);
  Py_XINCREF(g_internal);
  nb::register_exception_translator(&TranslateErrors);

  // --- Initializers, regularizers, constraints.
  nb::class_<fbn::Initializer>(m, "Initializer")
      .def_prop_ro("name", &fbn::Initializer::name)
      .def("__call__",
           [](const fbn::Initializer& init, const std::vector<int64_t>& shape, int dtype) {
             return ToNumpy(init(ToShape(shape), static_cast<fbn::DataType>(dtype)));
           })
      .def_static("get", &fbn::Initializer::Get)
      .def_static("constant", &fbn::Initializer::Constant)
      .def_static("random_normal", &fbn::Initializer::RandomNormal)
      .def_static("random_uniform", &fbn::Initializer::RandomUniform)
      .def_static("truncated_normal", &fbn::Initializer::TruncatedNormal)
      .def_static("variance_scaling", &fbn::Initializer::VarianceScaling)
      .def_static("from_callable", &InitializerFromCallable);
  nb::class_<fbn::Regularizer>(m, "Regularizer")
      .def_prop_ro("name", &fbn::Regularizer::name)
      .def("__call__", [](const fbn::Regularizer& r,
                          nb::handle w) { return r.Loss(ToTensor(w, fbn::DataType::kFloat64)); })
      .def_static("get", &fbn::Regularizer::Get)
      .def_static("l1_l2", &fbn::Regularizer::L1L2)
      .def_static("from_callable", &RegularizerFromCallable, nb::arg("fn"),
                  nb::arg("gradient").none(), nb::arg("name"));
  nb::class_<fbn::Constraint>(m, "Constraint")
      .def_prop_ro("name", &fbn::Constraint::name)
      .def("__call__",
           [](const fbn::Constraint& c, nb::handle w, int dtype) {
             return ToNumpy(c(ToTensor(w, static_cast<fbn::DataType>(dtype))));
           })
      .def_static("get", &fbn::Constraint::Get)
      .def_static("max_norm", &fbn::Constraint::MaxNorm)
      .def_static("min_max_norm", &fbn::Constraint::MinMaxNorm)
      .def_static("unit_norm", &fbn::Constraint::UnitNorm)
      .def_static("from_callable", &ConstraintFromCallable);

  // --- Graph objects.
  nb::class_<fbn::GraphObject>(m, "GraphObject").def_prop_ro("name", &fbn::GraphObject::name);
  nb::class_<fbn::Variable, fbn::GraphObject>(m, "Variable")
      .def_prop_ro("shape", [](const fbn::Variable& v) { return ShapeTuple(v.shape()); })
      .def_prop_ro("dtype", [](const fbn::Variable& v) { return DtypeName(v.dtype()); })
      .def_prop_ro("trainable", &fbn::Variable::trainable)
      .def_prop_ro("op_name", &fbn::Variable::op_name)
      .def("numpy", [](const fbn::Variable& v) { return ToNumpy(v.value()); })
      .def("assign",
           [](fbn::Variable& v, nb::handle value) { v.Assign(ToTensor(value, v.dtype())); });
  nb::class_<fbn::UpdateOp, fbn::GraphObject>(m, "UpdateOp")
      .def_prop_ro("variable", &fbn::UpdateOp::variable)
      .def("run", &fbn::UpdateOp::Run);
  m.def("run_update_ops", &fbn::RunUpdateOps, nb::arg("ops"));
  nb::class_<fbn::RegularizationLoss, fbn::GraphObject>(m, "RegularizationLoss")
      .def_prop_ro("variable", &fbn::RegularizationLoss::variable)
      .def("numpy", [](const fbn::RegularizationLoss& l) { return ToNumpy(l.Value()); })
      .def("gradient", [](const fbn::RegularizationLoss& l) { return ToNumpy(l.Gradient()); });

  nb::class_<fbn::Graph>(m, "Graph")
      .def_static("create", &fbn::Graph::Create)
      .def_static("get_default", &fbn::Graph::GetDefault)
      .def("push_default", &fbn::Graph::PushDefault)
      .def("pop_default", &fbn::Graph::PopDefault)
      .def("enter_scope",
           [](fbn::Graph& g, const std::string& name, int reuse, const std::string& default_name) {
             return g.EnterScope(name, ToReuse(reuse), default_name);
           })
      .def(
          "enter_captured_scope",
          [](fbn::Graph& g, const std::string& name, bool scope_reuse, bool scope_auto, int reuse) {
            g.EnterCapturedScope(fbn::Graph::ScopeState{name, scope_reuse, scope_auto},
                                 ToReuse(reuse));
          })
      .def("exit_scope", &fbn::Graph::ExitScope)
      .def("current_scope",
           [](const fbn::Graph& g) {
             const auto& s = g.current_scope();
             return nb::make_tuple(s.name, s.reuse, s.auto_reuse);
           })
      .def("get_variable",
           [](fbn::Graph& g, const std::string& name, const std::vector<int64_t>& shape, int dtype,
              const fbn::Initializer& init, bool trainable) {
             return g.GetVariable(name, ToShape(shape), static_cast<fbn::DataType>(dtype), init,
                                  trainable);
           })
      .def("get_collection",
           [](const fbn::Graph& g, const std::string& key) {
             nb::list out;
             for (const auto& o : g.GetCollection(key)) out.append(Downcast(o));
             return out;
           })
      .def("add_to_collection",
           [](fbn::Graph& g, const std::string& key, std::shared_ptr<fbn::GraphObject> o) {
             g.AddToCollection(key, std::move(o));
           });

  // --- Communicators of synchronized layers.
  nb::class_<fbn::Communicator>(m, "Communicator")
      .def_prop_ro("rank", &fbn::Communicator::rank)
      .def_prop_ro("size", &fbn::Communicator::size);
  m.def("_single_process_communicator", &fbn::SingleProcessCommunicator);
#ifdef FBN_PYTHON_WITH_MPI
  m.attr("_with_mpi") = true;
  // The MPI library fbn was built with, to compare with mpi4py's (handles are not portable).
  m.def("_mpi_library_version", [] {
    char text[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    MPI_Get_library_version(text, &len);
    return std::string(text, static_cast<size_t>(len));
  });
  // `address`: mpi4py's MPI._addressof(comm), the address of the communicator's MPI_Comm handle.
  m.def("_mpi_communicator", [](uintptr_t address) {
    if (address == 0) throw fbn::ValueError("null MPI_Comm address");
    return fbn::mpi::MakeCommunicator(*reinterpret_cast<const MPI_Comm*>(address));
  });
#else
  m.attr("_with_mpi") = false;
#endif

  // --- Training flag and the layer.
  nb::class_<fbn::TrainingFlag>(m, "TrainingFlag")
      .def(nb::init<bool>(), nb::arg("value") = false)
      .def_prop_rw("value", &fbn::TrainingFlag::value, &fbn::TrainingFlag::set_value)
      .def("__bool__", &fbn::TrainingFlag::value)
      .def("__repr__", [](const fbn::TrainingFlag& f) {
        return std::string("TrainingFlag(") + (f.value() ? "True" : "False") + ")";
      });

  nb::class_<LayerArgs>(m, "_LayerArgs")
      .def(nb::init<>())
      .def_rw("axis", &LayerArgs::axis)
      .def_rw("momentum", &LayerArgs::momentum)
      .def_rw("epsilon", &LayerArgs::epsilon)
      .def_rw("center", &LayerArgs::center)
      .def_rw("scale", &LayerArgs::scale)
      .def_rw("beta_initializer", &LayerArgs::beta_initializer)
      .def_rw("gamma_initializer", &LayerArgs::gamma_initializer)
      .def_rw("moving_mean_initializer", &LayerArgs::moving_mean_initializer)
      .def_rw("moving_variance_initializer", &LayerArgs::moving_variance_initializer)
      .def_rw("beta_regularizer", &LayerArgs::beta_regularizer)
      .def_rw("gamma_regularizer", &LayerArgs::gamma_regularizer)
      .def_rw("beta_constraint", &LayerArgs::beta_constraint)
      .def_rw("gamma_constraint", &LayerArgs::gamma_constraint)
      .def_rw("renorm", &LayerArgs::renorm)
      .def_rw("rmax", &LayerArgs::rmax)
      .def_rw("rmin", &LayerArgs::rmin)
      .def_rw("dmax", &LayerArgs::dmax)
      .def_rw("renorm_momentum", &LayerArgs::renorm_momentum)
      .def_rw("fused", &LayerArgs::fused)
      .def_rw("trainable", &LayerArgs::trainable)
      .def_rw("virtual_batch_size", &LayerArgs::virtual_batch_size)
      .def_rw("adjustment", &LayerArgs::adjustment)
      .def_rw("name", &LayerArgs::name)
      .def_rw("keras_v2", &LayerArgs::keras_v2)
      .def_rw("synchronized", &LayerArgs::synchronized)
      .def_rw("communicator", &LayerArgs::communicator);

  using Layer = fbn::layers::BatchNormalization;
  nb::class_<Layer>(m, "BatchNormalizationLayer")
      .def("__init__", [](Layer* self, const LayerArgs& a) { new (self) Layer(ToOptions(a)); })
      .def("call",
           [](Layer& l, const InArray& x, int code, nb::handle training) {
             return ToNumpy(l.Call(View(x, code), ToTraining(training)));
           })
      .def("backward",
           [](const Layer& l, const InArray& dy, int code) {
             fbn::BatchNormalizationGradients g = l.Backward(View(dy, code));
             return nb::make_tuple(ToNumpy(g.dx), ToNumpy(g.dgamma), ToNumpy(g.dbeta));
           })
      .def_prop_ro("name", &Layer::name)
      .def_prop_ro("built", &Layer::built)
      .def_prop_ro("fused", &Layer::fused)
      .def_prop_rw("trainable", &Layer::trainable, &Layer::set_trainable)
      .def_prop_ro("axis", &Layer::axis)
      .def_prop_ro("dtype", [](const Layer& l) { return DtypeName(l.dtype()); })
      .def_prop_ro("gamma", &Layer::gamma)
      .def_prop_ro("beta", &Layer::beta)
      .def_prop_ro("moving_mean", &Layer::moving_mean)
      .def_prop_ro("moving_variance", &Layer::moving_variance)
      .def_prop_ro("moving_stddev", &Layer::moving_stddev)
      .def_prop_ro("renorm_mean", &Layer::renorm_mean)
      .def_prop_ro("renorm_stddev", &Layer::renorm_stddev)
      .def_prop_ro("variables", &Layer::variables)
      .def_prop_ro("trainable_variables", &Layer::trainable_variables)
      .def_prop_ro("non_trainable_variables", &Layer::non_trainable_variables)
      .def_prop_ro("losses", &Layer::losses)
      .def_prop_ro("updates", &Layer::updates);

  m.def("apply_batch_normalization", [](const InArray& x, int code, const LayerArgs& a,
                                        nb::handle training, std::optional<bool> reuse) {
    std::shared_ptr<Layer> layer;
    fbn::Tensor y = fbn::layers::ApplyBatchNormalization(View(x, code), ToOptions(a),
                                                         ToTraining(training), reuse, &layer);
    return nb::make_tuple(ToNumpy(y), layer);
  });

  // --- Optimizer.
  nb::class_<fbn::SGD>(m, "SGD")
      .def(nb::init<double, double, bool>(), nb::arg("learning_rate") = 0.01,
           nb::arg("momentum") = 0.0, nb::arg("nesterov") = false)
      .def_prop_ro("learning_rate", &fbn::SGD::learning_rate)
      .def_prop_ro("momentum", &fbn::SGD::momentum)
      .def_prop_ro("nesterov", &fbn::SGD::nesterov)
      .def_prop_ro("iterations", &fbn::SGD::iterations)
      .def("apply_gradients", [](fbn::SGD& opt, nb::list grads_and_vars) {
        std::vector<std::pair<fbn::Tensor, std::shared_ptr<fbn::Variable>>> gv;
        for (nb::handle item : grads_and_vars) {
          nb::sequence pair = nb::cast<nb::sequence>(item);
          auto var = nb::cast<std::shared_ptr<fbn::Variable>>(pair[1]);
          nb::object g = pair[0];
          gv.emplace_back(g.is_none() ? fbn::Tensor() : ToTensor(g, var->dtype()), var);
        }
        opt.ApplyGradients(gv);
      });
}
