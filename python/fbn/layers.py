"""``tf.compat.v1.layers``-compatible batch normalization: ``BatchNormalization`` and
``batch_normalization``, with TensorFlow's keyword arguments and defaults (V1 behaviour), plus
``BatchNormalizationV2`` with the Keras V2 differences.

The layer itself is C++ (``fbn/layer.h``); this module only converts arguments::

    bn = fbn.layers.BatchNormalization(axis=1)
    y = bn(x, training=True)          # eager: moving statistics updated in the call
    dx, grads = bn.backward(dy)       # grads aligned with bn.trainable_variables

    with fbn.Graph().as_default() as g:
        y = fbn.layers.batch_normalization(x, training=True, name="bn")
        g.run(g.get_collection(fbn.GraphKeys.UPDATE_OPS))

``training`` is a bool or an ``fbn.TrainingFlag`` (a boolean read at call time, as a placeholder
fed at run time). Initializers, regularizers, constraints and ``adjustment`` accept the built-in
names (``"glorot_uniform"``, ``"l2"``, ``"max_norm"``, ...), the objects of
``fbn.layers.initializers``/``regularizers``/``constraints``, or Python callables: an initializer
is called as ``init(shape, dtype)``, a regularizer as ``reg(value)`` (a scalar back), a constraint
as ``constraint(value)``, ``adjustment(shape)`` with the input's shape as an int32 array.

Synchronized batch normalization (data-parallel training over MPI, with mpi4py)::

    from mpi4py import MPI
    bn = fbn.layers.BatchNormalization(synchronized=True, communicator=MPI.COMM_WORLD)
    y = bn(local_x, training=True)    # statistics of the global batch (every rank's local_x)
    dx, grads = bn.backward(local_dy) # dx from the global sums; grads: this rank's contributions

Every rank calls the layer on its part of the batch; training calls and their backward passes are
collective (the same calls, in the same order, on every rank). ``communicator=None`` means mpi4py's
``MPI.COMM_WORLD``. A communicator of more than one process needs fbn built with
``-DFBN_WITH_MPI=ON``; with one process the layer is the unsynchronized layer, bit for bit.
"""
import sys
import types

import numpy as np

from . import _fbn
from ._arrays import as_input, from_output
from .graph import get_default_graph

__all__ = ["BatchNormalization", "BatchNormalizationV2", "batch_normalization", "BatchNorm",
           "batch_norm", "TrainingFlag", "Communicator", "initializers", "regularizers",
           "constraints", "zeros_initializer", "ones_initializer"]

TrainingFlag = _fbn.TrainingFlag
Communicator = _fbn.Communicator


# ----------------------------------------------------------------------------- built-ins

def zeros_initializer():
    """``tf.compat.v1.zeros_initializer()``."""
    return _fbn.Initializer.get("zeros")


def ones_initializer():
    """``tf.compat.v1.ones_initializer()``."""
    return _fbn.Initializer.get("ones")


def _seed(seed):
    return None if seed is None else int(seed)


initializers = types.SimpleNamespace(
    zeros=zeros_initializer,
    ones=ones_initializer,
    constant=lambda value=0: _fbn.Initializer.constant(float(value)),
    random_normal=lambda mean=0.0, stddev=0.05, seed=None: _fbn.Initializer.random_normal(
        float(mean), float(stddev), _seed(seed)),
    random_uniform=lambda minval=-0.05, maxval=0.05, seed=None: _fbn.Initializer.random_uniform(
        float(minval), float(maxval), _seed(seed)),
    truncated_normal=lambda mean=0.0, stddev=0.05, seed=None:
        _fbn.Initializer.truncated_normal(float(mean), float(stddev), _seed(seed)),
    variance_scaling=lambda scale=1.0, mode="fan_in", distribution="truncated_normal", seed=None:
        _fbn.Initializer.variance_scaling(float(scale), mode, distribution, _seed(seed)),
    glorot_uniform=lambda seed=None: _fbn.Initializer.variance_scaling(
        1.0, "fan_avg", "uniform", _seed(seed)),
    glorot_normal=lambda seed=None: _fbn.Initializer.variance_scaling(
        1.0, "fan_avg", "truncated_normal", _seed(seed)),
    he_normal=lambda seed=None: _fbn.Initializer.variance_scaling(
        2.0, "fan_in", "truncated_normal", _seed(seed)),
    he_uniform=lambda seed=None: _fbn.Initializer.variance_scaling(
        2.0, "fan_in", "uniform", _seed(seed)),
)
initializers.__doc__ = "Keras initializers by name, with Keras's defaults (seedable)."

regularizers = types.SimpleNamespace(
    l1=lambda l1=0.01: _fbn.Regularizer.l1_l2(float(l1), 0.0),
    l2=lambda l2=0.01: _fbn.Regularizer.l1_l2(0.0, float(l2)),
    l1_l2=lambda l1=0.01, l2=0.01: _fbn.Regularizer.l1_l2(float(l1), float(l2)),
)
regularizers.__doc__ = "Keras regularizers: l1, l2, l1_l2 (loss and gradient in C++)."


def _axes(axis):
    return [int(axis)] if isinstance(axis, (int, np.integer)) else [int(a) for a in axis]


constraints = types.SimpleNamespace(
    non_neg=lambda: _fbn.Constraint.get("non_neg"),
    max_norm=lambda max_value=2, axis=0: _fbn.Constraint.max_norm(float(max_value), _axes(axis)),
    min_max_norm=lambda min_value=0.0, max_value=1.0, rate=1.0, axis=0:
        _fbn.Constraint.min_max_norm(float(min_value), float(max_value), float(rate),
                                     _axes(axis)),
    unit_norm=lambda axis=0: _fbn.Constraint.unit_norm(_axes(axis)),
)
constraints.__doc__ = "Keras constraints, applied by fbn.train.SGD after each update."


def _name_of(fn):
    return getattr(fn, "__name__", None) or type(fn).__name__


def _initializer(value):
    # None is get_variable's default for floating variables: glorot_uniform.
    if value is None:
        return _fbn.Initializer.get("glorot_uniform")
    if isinstance(value, _fbn.Initializer):
        return value
    if isinstance(value, str):
        return _fbn.Initializer.get(value)
    if callable(value):
        return _fbn.Initializer.from_callable(value, _name_of(value))
    raise ValueError(f"Could not interpret initializer identifier: {value!r}")


def _regularizer(value):
    if value is None:
        return None
    if isinstance(value, _fbn.Regularizer):
        return value
    if isinstance(value, str):
        return _fbn.Regularizer.get(value)
    if callable(value):
        return _fbn.Regularizer.from_callable(value, getattr(value, "gradient", None),
                                              _name_of(value))
    raise ValueError(f"Could not interpret regularizer identifier: {value!r}")


def _constraint(value):
    if value is None:
        return None
    if isinstance(value, _fbn.Constraint):
        return value
    if isinstance(value, str):
        return _fbn.Constraint.get(value)
    if callable(value):
        return _fbn.Constraint.from_callable(value, _name_of(value))
    raise ValueError(f"Could not interpret constraint identifier: {value!r}")


def _as_input(value, name):
    arr, code = as_input(value, name)
    # np.ascontiguousarray makes 0-d arrays 1-d: keep a scalar a scalar (rank 0 is an error).
    if np.ndim(value) == 0:
        arr = arr.reshape(())
    return arr, code


def _training(training, keras_v2=False):
    if isinstance(training, _fbn.TrainingFlag):
        return training
    if training is None:
        # Keras's learning phase: in a graph, a boolean placeholder defaulting to False; eagerly, 0.
        graph = get_default_graph()
        return graph.learning_phase if graph is not None else False
    # TensorFlow's checks: the Keras V2 layer turns a Python int into a bool; then a Python bool
    # or a value equal to 1 or 0 (1.0, numpy.int64(0), numpy.True_) is accepted, anything else
    # ("no", 2 in V1, a list, an array) is a TypeError.
    if keras_v2 and isinstance(training, int):
        return bool(training)
    try:
        valid = isinstance(training, bool) or training in {0, 1}
    except TypeError:  # unhashable: a list, an array
        valid = False
    if not valid:
        raise TypeError("`training` must be a Python bool, or 1 or 0, or an fbn.TrainingFlag. "
                        f"Received: {type(training)}")
    return bool(training)


def _mpi4py_module():
    try:
        from mpi4py import MPI  # pylint: disable=import-outside-toplevel
    except ImportError:
        return None
    return MPI


def _communicator(communicator):
    """The fbn Communicator for a synchronized layer's ``communicator`` argument: an mpi4py
    communicator, None (mpi4py's ``MPI.COMM_WORLD``), or an ``fbn.layers.Communicator``."""
    if isinstance(communicator, _fbn.Communicator):
        return communicator
    MPI = sys.modules.get("mpi4py.MPI") if communicator is not None else _mpi4py_module()
    if communicator is None:
        if MPI is None:
            raise ValueError(
                "synchronized=True with communicator=None synchronizes over mpi4py's "
                "MPI.COMM_WORLD, but mpi4py is not installed (pip install mpi4py); pass an mpi4py "
                "communicator, or use synchronized=False")
        communicator = MPI.COMM_WORLD
    if MPI is None or not isinstance(communicator, MPI.Comm):
        raise TypeError("`communicator` must be an mpi4py communicator (mpi4py.MPI.Comm), got "
                        f"{communicator!r}")
    if communicator == MPI.COMM_NULL:
        raise ValueError("`communicator` is MPI.COMM_NULL")
    if _fbn._with_mpi:
        ours, theirs = _fbn._mpi_library_version(), MPI.Get_library_version()
        if ours != theirs:
            raise ValueError(
                f"fbn was built with the MPI library {ours.splitlines()[0]!r} but mpi4py uses "
                f"{theirs.splitlines()[0]!r}; their communicators are not interchangeable")
        return _fbn._mpi_communicator(MPI._addressof(communicator))  # pylint: disable=protected-access
    size = communicator.Get_size()
    if size == 1:
        return _fbn._single_process_communicator()
    raise ValueError(
        f"fbn was built without MPI (FBN_WITH_MPI=OFF), so it cannot synchronize the {size} "
        "processes of this communicator; build it with -DFBN_WITH_MPI=ON (pip: "
        "-C cmake.define.FBN_WITH_MPI=ON)")


def _layer_args(axis, momentum, epsilon, center, scale, beta_initializer, gamma_initializer,
                moving_mean_initializer, moving_variance_initializer, beta_regularizer,
                gamma_regularizer, beta_constraint, gamma_constraint, renorm, renorm_clipping,
                renorm_momentum, fused, trainable, virtual_batch_size, adjustment, name, keras_v2,
                synchronized=False, communicator=None):
    # Errors TensorFlow raises after naming the layer are deferred (returned) so that the layer
    # is created first and takes its name, as there.
    error = None
    if isinstance(axis, (list, tuple)):
        axis = [int(a) for a in axis]
    elif isinstance(axis, (int, np.integer)) and not isinstance(axis, bool):
        axis = [int(axis)]
    else:
        error = TypeError("Expected an int or a list/tuple of ints for the argument 'axis', but "
                          f"received: {axis!r}")
        axis = [-1]
    a = _fbn._LayerArgs()
    a.axis = axis
    a.momentum = float(momentum)
    a.epsilon = float(epsilon)
    a.center = bool(center)
    a.scale = bool(scale)
    a.beta_initializer = _initializer(beta_initializer)
    a.gamma_initializer = _initializer(gamma_initializer)
    a.moving_mean_initializer = _initializer(moving_mean_initializer)
    a.moving_variance_initializer = _initializer(moving_variance_initializer)
    for key, value in (("beta_regularizer", _regularizer(beta_regularizer)),
                       ("gamma_regularizer", _regularizer(gamma_regularizer)),
                       ("beta_constraint", _constraint(beta_constraint)),
                       ("gamma_constraint", _constraint(gamma_constraint))):
        if value is not None:
            setattr(a, key, value)
    a.renorm = bool(renorm)
    if renorm:
        clipping = dict(renorm_clipping or {})
        keys = ["rmax", "rmin", "dmax"]
        if set(clipping) - set(keys) and error is None:
            error = ValueError("Received invalid keys for `renorm_clipping` argument: "
                               f"{renorm_clipping}. Supported values: {keys}.")
        for key in keys:
            if clipping.get(key) is not None:
                setattr(a, key, float(clipping[key]))
    a.renorm_momentum = float(renorm_momentum)
    if fused is not None:
        a.fused = bool(fused)
    a.trainable = bool(trainable)
    if virtual_batch_size is not None:
        a.virtual_batch_size = int(virtual_batch_size)
    if adjustment is not None and not callable(adjustment):
        raise TypeError(f"`adjustment` must be callable, got {adjustment!r}")
    if adjustment is not None:
        a.adjustment = adjustment
    a.name = "" if name is None else str(name)
    a.keras_v2 = keras_v2
    a.synchronized = bool(synchronized)
    if synchronized:
        a.communicator = _communicator(communicator)
    elif communicator is not None:
        raise ValueError("`communicator` is only used with synchronized=True")
    return a, error


class BatchNormalization:
    """``tf.compat.v1.layers.BatchNormalization`` (V1 behaviour: ``fused=None`` means fused where
    possible with a silent fallback; ``trainable`` only chooses collections; ``training``
    defaults to False).

    fbn extension: ``synchronized=True`` normalizes training calls with the statistics of the
    global batch spread over the processes of ``communicator`` (an mpi4py communicator; None:
    ``MPI.COMM_WORLD``), on the fused or the general path alike (see the module docstring)."""

    _KERAS_V2 = False

    def __init__(self, axis=-1, momentum=0.99, epsilon=1e-3, center=True, scale=True,
                 beta_initializer=zeros_initializer(), gamma_initializer=ones_initializer(),
                 moving_mean_initializer=zeros_initializer(),
                 moving_variance_initializer=ones_initializer(), beta_regularizer=None,
                 gamma_regularizer=None, beta_constraint=None, gamma_constraint=None,
                 renorm=False, renorm_clipping=None, renorm_momentum=0.99, fused=None,
                 trainable=True, virtual_batch_size=None, adjustment=None, name=None, **kwargs):
        # fbn's extensions stay keyword-only extras: the signature is TensorFlow's.
        synchronized = kwargs.pop("synchronized", False)
        communicator = kwargs.pop("communicator", None)
        for key in kwargs:
            raise TypeError(f"Keyword argument not understood: {key}")
        args, error = _layer_args(axis, momentum, epsilon, center, scale, beta_initializer,
                                  gamma_initializer, moving_mean_initializer,
                                  moving_variance_initializer, beta_regularizer,
                                  gamma_regularizer, beta_constraint, gamma_constraint, renorm,
                                  renorm_clipping, renorm_momentum, fused, trainable,
                                  virtual_batch_size, adjustment, name, self._KERAS_V2,
                                  synchronized, communicator)
        self._layer = _fbn.BatchNormalizationLayer(args)
        if error is not None:
            raise error
        self._set_config(locals())

    def _set_config(self, values):
        self._axis_arg = values["axis"]
        self.momentum = values["momentum"]
        self.epsilon = values["epsilon"]
        self.center = values["center"]
        self.scale = values["scale"]
        self.beta_initializer = values["beta_initializer"]
        self.gamma_initializer = values["gamma_initializer"]
        self.moving_mean_initializer = values["moving_mean_initializer"]
        self.moving_variance_initializer = values["moving_variance_initializer"]
        self.beta_regularizer = values["beta_regularizer"]
        self.gamma_regularizer = values["gamma_regularizer"]
        self.beta_constraint = values["beta_constraint"]
        self.gamma_constraint = values["gamma_constraint"]
        self.renorm = values["renorm"]
        if self.renorm:
            self.renorm_clipping = dict(values["renorm_clipping"] or {})
            self.renorm_momentum = values["renorm_momentum"]
        self.virtual_batch_size = values["virtual_batch_size"]
        self.adjustment = values["adjustment"]
        self.synchronized = bool(values["synchronized"])
        # The mpi4py communicator (kept alive: the layer holds a copy of its MPI handle).
        self.communicator = values["communicator"]
        if self.synchronized and self.communicator is None:
            MPI = sys.modules.get("mpi4py.MPI")
            self.communicator = MPI.COMM_WORLD if MPI is not None else None

    # --- calling

    def __call__(self, inputs, training=False):
        x, code = _as_input(inputs, "inputs")
        y = self._layer.call(x, code, _training(training, self._KERAS_V2))
        return y

    def apply(self, inputs, training=False):
        return self(inputs, training=training)

    def backward(self, dy, variables=None):
        """Gradients of the last call's output for the output gradient ``dy``: ``(dx, grads)``
        with ``grads`` aligned with ``variables`` (default: ``trainable_variables``); a variable
        the output does not depend on (the moving statistics) gets None."""
        d, code = _as_input(dy, "dy")
        dx, dgamma, dbeta = self._layer.backward(d, code)
        if variables is None:
            variables = self.trainable_variables
        gamma, beta = self._layer.gamma, self._layer.beta
        grads = []
        for v in variables:
            if gamma is not None and v.name == gamma.name:
                grads.append(dgamma)
            elif beta is not None and v.name == beta.name:
                grads.append(dbeta)
            else:
                grads.append(None)
        return dx, grads

    # --- state

    @property
    def name(self):
        return self._layer.name

    @property
    def built(self):
        return self._layer.built

    @property
    def fused(self):
        return self._layer.fused

    @property
    def axis(self):
        return list(self._layer.axis) if self._layer.built else self._axis_arg

    @property
    def dtype(self):
        return self._layer.dtype if self._layer.built else None

    @property
    def trainable(self):
        return self._layer.trainable

    @trainable.setter
    def trainable(self, value):
        self._layer.trainable = bool(value)

    gamma = property(lambda self: self._layer.gamma)
    beta = property(lambda self: self._layer.beta)
    moving_mean = property(lambda self: self._layer.moving_mean)
    moving_variance = property(lambda self: self._layer.moving_variance)
    moving_stddev = property(lambda self: self._layer.moving_stddev)
    renorm_mean = property(lambda self: self._layer.renorm_mean)
    renorm_stddev = property(lambda self: self._layer.renorm_stddev)
    variables = property(lambda self: list(self._layer.variables))
    trainable_variables = property(lambda self: list(self._layer.trainable_variables))
    non_trainable_variables = property(lambda self: list(self._layer.non_trainable_variables))
    weights = variables
    trainable_weights = trainable_variables
    non_trainable_weights = non_trainable_variables
    losses = property(lambda self: list(self._layer.losses),
                      doc="One regularization loss per regularized variable (``.numpy()``).")
    updates = property(lambda self: list(self._layer.updates),
                       doc="Update ops of the graph-mode training calls (two per call).")

    def compute_output_shape(self, input_shape):
        return input_shape

    def __repr__(self):
        return f"<fbn.layers.{type(self).__name__} name={self.name!r}>"


class BatchNormalizationV2(BatchNormalization):
    """``tf.keras.layers.BatchNormalization`` (V2): ``fused=True`` raises where the fused path
    cannot serve, ``trainable=False`` makes every call an inference call, ``training`` defaults
    to None (the learning phase). ``synchronized=True`` synchronizes over ``communicator`` (an
    mpi4py communicator; None: ``MPI.COMM_WORLD``) and, as in Keras, forbids ``fused=True`` and
    uses the non-fused path."""

    _KERAS_V2 = True

    def __init__(self, axis=-1, momentum=0.99, epsilon=1e-3, center=True, scale=True,
                 beta_initializer="zeros", gamma_initializer="ones",
                 moving_mean_initializer="zeros", moving_variance_initializer="ones",
                 beta_regularizer=None, gamma_regularizer=None, beta_constraint=None,
                 gamma_constraint=None, synchronized=False, **kwargs):
        if synchronized and kwargs.get("fused"):
            raise ValueError("`fused=True` is not supported when `synchronized=True`.")
        super().__init__(axis=axis, momentum=momentum, epsilon=epsilon, center=center,
                         scale=scale, beta_initializer=beta_initializer,
                         gamma_initializer=gamma_initializer,
                         moving_mean_initializer=moving_mean_initializer,
                         moving_variance_initializer=moving_variance_initializer,
                         beta_regularizer=beta_regularizer, gamma_regularizer=gamma_regularizer,
                         beta_constraint=beta_constraint, gamma_constraint=gamma_constraint,
                         synchronized=synchronized, **kwargs)

    def __call__(self, inputs, training=None):
        return super().__call__(inputs, training=training)


def batch_normalization(inputs, axis=-1, momentum=0.99, epsilon=1e-3, center=True, scale=True,
                        beta_initializer=zeros_initializer(), gamma_initializer=ones_initializer(),
                        moving_mean_initializer=zeros_initializer(),
                        moving_variance_initializer=ones_initializer(), beta_regularizer=None,
                        gamma_regularizer=None, beta_constraint=None, gamma_constraint=None,
                        training=False, trainable=True, name=None, reuse=None, renorm=False,
                        renorm_clipping=None, renorm_momentum=0.99, fused=None,
                        virtual_batch_size=None, adjustment=None):
    """``tf.compat.v1.layers.batch_normalization``: builds a layer and applies it once. Needs a
    default ``fbn.Graph`` (ValueError otherwise: use ``BatchNormalization`` eagerly). ``name`` is
    the variable scope as given; ``reuse=True`` (or a reusing ``variable_scope``) shares the
    variables of an earlier call."""
    args, error = _layer_args(axis, momentum, epsilon, center, scale, beta_initializer,
                              gamma_initializer, moving_mean_initializer,
                              moving_variance_initializer, beta_regularizer, gamma_regularizer,
                              beta_constraint, gamma_constraint, renorm, renorm_clipping,
                              renorm_momentum, fused, trainable, virtual_batch_size, adjustment,
                              name, False)
    if error is not None:
        _fbn.BatchNormalizationLayer(args)  # takes its name first, as TensorFlow's layer does
        raise error
    x, code = _as_input(inputs, "inputs")
    y, _ = _fbn.apply_batch_normalization(x, code, args, _training(training),
                                          None if reuse is None else bool(reuse))
    return y


BatchNorm = BatchNormalization
batch_norm = batch_normalization
