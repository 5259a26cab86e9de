"""The Python contract of fbn.raw_ops, fbn.nn, fbn.errors and the thread-count API.

Checks against TensorFlow (signatures, namedtuple fields, ValueError texts) run when TensorFlow is
importable and skip otherwise; everything else is fbn alone.
"""
import inspect

import numpy as np
import pytest

import fbn
import bn_reference as ref
from bn_reference import BF16, F16, F32, F64

FORWARD_OPS = ["FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"]
GRAD_OPS = ["FusedBatchNormGrad", "FusedBatchNormGradV2", "FusedBatchNormGradV3"]
ALL_OPS = FORWARD_OPS + GRAD_OPS

# TensorFlow's output names (tf.raw_ops.<Op>(...)._fields).
EXPECTED_FIELDS = {
    "FusedBatchNorm": ("y", "batch_mean", "batch_variance", "reserve_space_1", "reserve_space_2"),
    "FusedBatchNormV2": ("y", "batch_mean", "batch_variance", "reserve_space_1",
                         "reserve_space_2"),
    "FusedBatchNormV3": ("y", "batch_mean", "batch_variance", "reserve_space_1",
                         "reserve_space_2", "reserve_space_3"),
    "FusedBatchNormGrad": ("x_backprop", "scale_backprop", "offset_backprop", "reserve_space_3",
                           "reserve_space_4"),
    "FusedBatchNormGradV2": ("x_backprop", "scale_backprop", "offset_backprop", "reserve_space_3",
                             "reserve_space_4"),
    "FusedBatchNormGradV3": ("x_backprop", "scale_backprop", "offset_backprop", "reserve_space_4",
                             "reserve_space_5"),
}


def _inputs(op, dtype=np.float32, shape=(2, 3, 4, 5), seed=0):
    """Valid keyword arguments for `op` (training, NHWC)."""
    rng = np.random.default_rng(seed)
    c = shape[-1]
    u = ref.stats_dtype(dtype) if op not in ("FusedBatchNorm", "FusedBatchNormGrad") else dtype
    x = rng.standard_normal(shape).astype(dtype)
    if op in FORWARD_OPS:
        return dict(x=x, scale=rng.standard_normal(c).astype(u),
                    offset=rng.standard_normal(c).astype(u), mean=np.zeros(0, u),
                    variance=np.zeros(0, u))
    kwargs = dict(y_backprop=rng.standard_normal(shape).astype(dtype), x=x,
                  scale=rng.standard_normal(c).astype(u),
                  reserve_space_1=x.astype(np.float64).mean(axis=(0, 1, 2)).astype(u),
                  reserve_space_2=x.astype(np.float64).var(axis=(0, 1, 2)).astype(u))
    if op.endswith("V3"):
        kwargs["reserve_space_3"] = np.zeros(0, u)
    return kwargs


def _same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# ----------------------------------------------------------------------------------------------
# Calling convention
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ALL_OPS)
def test_positional_arguments_raise_type_error(op):
    kwargs = _inputs(op)
    with pytest.raises(TypeError):
        getattr(fbn.raw_ops, op)(*kwargs.values())
    first = next(iter(kwargs))
    rest = {k: v for k, v in kwargs.items() if k != first}
    with pytest.raises(TypeError):
        getattr(fbn.raw_ops, op)(kwargs[first], **rest)


@pytest.mark.parametrize("op", ALL_OPS)
def test_unknown_and_missing_keywords_raise_type_error(op):
    kwargs = _inputs(op)
    with pytest.raises(TypeError):
        getattr(fbn.raw_ops, op)(**kwargs, momentum=0.9)
    with pytest.raises(TypeError):
        getattr(fbn.raw_ops, op)(**dict(list(kwargs.items())[1:]))


@pytest.mark.parametrize("op", ALL_OPS)
def test_name_is_accepted_and_ignored(op):
    kwargs = _inputs(op)
    plain = getattr(fbn.raw_ops, op)(**kwargs)
    named = getattr(fbn.raw_ops, op)(**kwargs, name="bn/FusedBatchNorm")
    for a, b in zip(plain, named):
        assert _same_bits(a, b)


@pytest.mark.parametrize("op", ALL_OPS)
def test_signature(op):
    """Keyword-only parameters with TF's names, order and defaults."""
    params = inspect.signature(getattr(fbn.raw_ops, op)).parameters
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values())
    defaults = {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}
    assert defaults["epsilon"] == pytest.approx(0.0001)
    assert defaults["data_format"] == "NHWC" and defaults["is_training"] is True
    assert defaults["name"] is None
    if op in FORWARD_OPS:
        assert defaults["exponential_avg_factor"] == 1


@pytest.mark.parametrize("op", ALL_OPS)
def test_signature_matches_tf(op, tf):
    mine = inspect.signature(getattr(fbn.raw_ops, op)).parameters
    theirs = inspect.signature(getattr(tf.raw_ops, op)).parameters
    assert list(mine) == list(theirs)
    for name, p in theirs.items():
        assert mine[name].default == p.default, name


@pytest.mark.parametrize("op", ALL_OPS)
def test_output_fields(op):
    out = getattr(fbn.raw_ops, op)(**_inputs(op))
    assert isinstance(out, tuple)
    assert out._fields == EXPECTED_FIELDS[op]
    assert type(out).__name__ == op
    for field, value in zip(out._fields, out):
        assert getattr(out, field) is value


@pytest.mark.parametrize("op", ALL_OPS)
def test_output_fields_match_tf(op, tf):
    kwargs = _inputs(op)
    theirs = getattr(tf.raw_ops, op)(**{k: tf.constant(v) for k, v in kwargs.items()})
    assert getattr(fbn.raw_ops, op)(**kwargs)._fields == theirs._fields


def _x_dtypes(op):
    return [F32, F64] if op in ("FusedBatchNorm", "FusedBatchNormGrad") else [F16, BF16, F32, F64]


@pytest.mark.parametrize("op", ALL_OPS)
def test_output_dtypes_and_shapes(op):
    """y / x_backprop keep x's dtype and shape; the rest are U (float, or double for float64 x):
    vectors of C, V3's reserve_space_3 a scalar, the gradient placeholders empty [0]."""
    for dtype in _x_dtypes(op):
        out = getattr(fbn.raw_ops, op)(**_inputs(op, dtype))
        u = F64 if dtype == F64 else F32
        assert out[0].dtype == dtype and out[0].shape == (2, 3, 4, 5), dtype
        for value in out[1:]:
            assert value.dtype == u, (dtype, value.dtype)
        if op in FORWARD_OPS:
            assert all(v.shape == (5,) for v in out[1:5])
            if op.endswith("V3"):
                assert out.reserve_space_3.shape == () and out.reserve_space_3 == 0
        else:
            assert out[1].shape == out[2].shape == (5,)
            assert out[3].shape == out[4].shape == (0,)
        assert all(isinstance(v, np.ndarray) for v in out)


def test_inputs_are_not_modified_and_outputs_are_fresh():
    kwargs = _inputs("FusedBatchNormV3")
    kwargs.update(mean=np.ones(5, np.float32), variance=np.ones(5, np.float32),
                  exponential_avg_factor=0.5)
    before = {k: v.copy() for k, v in kwargs.items() if isinstance(v, np.ndarray)}
    out = fbn.raw_ops.FusedBatchNormV3(**kwargs)
    for k, v in before.items():
        assert _same_bits(kwargs[k], v), k
    for value in out:
        for k in before:
            assert not np.shares_memory(value, kwargs[k])
    out.batch_mean[...] = 123.0  # writable, and owned by the result
    assert _same_bits(kwargs["mean"], before["mean"])


def test_lists_and_python_scalars_are_accepted():
    """Python lists become float32 tensors, as tf.convert_to_tensor makes them."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 2, 3, 2)).astype(np.float32)
    as_arrays = fbn.raw_ops.FusedBatchNormV3(
        x=x, scale=np.array([1.5, -0.5], np.float32), offset=np.array([0.25, 2.0], np.float32),
        mean=np.array([0.1, 0.2], np.float32), variance=np.array([1.0, 2.0], np.float32),
        epsilon=0.001, is_training=False)
    as_lists = fbn.raw_ops.FusedBatchNormV3(
        x=x.tolist(), scale=[1.5, -0.5], offset=[0.25, 2], mean=[0.1, 0.2], variance=[1, 2.0],
        epsilon=0.001, is_training=False)
    for a, b in zip(as_arrays, as_lists):
        assert _same_bits(a, b)
    # epsilon and the factor as ints, as TF accepts them.
    out = fbn.raw_ops.FusedBatchNormV3(x=x, scale=[1.0, 1.0], offset=[0.0, 0.0], mean=[],
                                       variance=[], epsilon=1, exponential_avg_factor=1)
    assert out.y.dtype == F32


def test_non_contiguous_inputs():
    rng = np.random.default_rng(2)
    base = rng.standard_normal((2, 5, 4, 3)).astype(np.float32)
    x = np.transpose(base, (0, 2, 3, 1))  # an NHWC view of NCHW data
    assert not x.flags.c_contiguous
    kwargs = dict(scale=np.ones(5, np.float32)[::1], offset=np.arange(10, dtype=np.float32)[::2],
                  mean=np.zeros(0, np.float32), variance=np.zeros(0, np.float32))
    strided = fbn.raw_ops.FusedBatchNormV3(x=x, **kwargs)
    copied = fbn.raw_ops.FusedBatchNormV3(x=np.ascontiguousarray(x), **kwargs)
    for a, b in zip(strided, copied):
        assert _same_bits(a, b)


@pytest.mark.parametrize("dtype", [np.int32, np.bool_, np.complex64])
def test_non_float_inputs_raise_type_error(dtype):
    kwargs = _inputs("FusedBatchNormV3")
    kwargs["x"] = np.ones((2, 3, 4, 5), dtype)
    with pytest.raises(TypeError):
        fbn.raw_ops.FusedBatchNormV3(**kwargs)


@pytest.mark.parametrize("arg,message", [
    ("scale", "scale must be 1-dimensional[]"), ("offset", "offset must be 1-dimensional[]"),
    ("mean", "estimated_mean must be 1-dimensional[]"),
    ("variance", "estimated_variance must be 1-dimensional[]")])
def test_scalar_inputs_keep_rank_zero(arg, message):
    """0-d arrays must reach the op as rank 0 (TF: "... must be 1-dimensional[]")."""
    kwargs = _inputs("FusedBatchNormV3")
    kwargs[arg] = np.array(1.0, np.float32)
    with pytest.raises(fbn.errors.InvalidArgumentError) as err:
        fbn.raw_ops.FusedBatchNormV3(**kwargs)
    assert str(err.value) == message


@pytest.mark.parametrize("op", ["FusedBatchNormGrad", "FusedBatchNormGradV2"])
def test_grad_v1_v2_float64(op):
    """The float64 extension covers the gradient ops without reserve_space_3 too."""
    out = getattr(fbn.raw_ops, op)(**_inputs(op, np.float64))
    assert all(v.dtype == F64 for v in out)


def test_grad_v1_half_gives_tf_attr_error():
    kwargs = _inputs("FusedBatchNormGrad", np.float16)
    with pytest.raises(fbn.errors.InvalidArgumentError) as err:
        fbn.raw_ops.FusedBatchNormGrad(**kwargs)
    assert str(err.value).startswith("Value for attr 'T' of half is not in the list of allowed "
                                     "values: float")


def test_float64_x_needs_float64_statistics():
    kwargs = _inputs("FusedBatchNormV3", np.float64)
    kwargs["scale"] = kwargs["scale"].astype(np.float32)
    with pytest.raises(fbn.errors.InvalidArgumentError, match="attr 'U' of float"):
        fbn.raw_ops.FusedBatchNormV3(**kwargs)


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------
def test_error_types():
    assert issubclass(fbn.errors.InvalidArgumentError, ValueError)
    assert issubclass(fbn.errors.ResourceExhaustedError, MemoryError)
    assert issubclass(fbn.errors.InternalError, RuntimeError)
    kwargs = _inputs("FusedBatchNormV3")
    kwargs["scale"] = np.ones(4, np.float32)
    with pytest.raises(ValueError) as err:
        fbn.raw_ops.FusedBatchNormV3(**kwargs)
    assert type(err.value) is fbn.errors.InvalidArgumentError
    assert str(err.value) == ("scale must have the same number of elements as the channels of x, "
                              "got 4 and 5")


@pytest.mark.parametrize("data_format", ["NCWH", "nhwc", "", "NDHWC "])
def test_bad_data_format(data_format):
    with pytest.raises(fbn.errors.InvalidArgumentError) as err:
        fbn.raw_ops.FusedBatchNormV3(**_inputs("FusedBatchNormV3"), data_format=data_format)
    assert str(err.value) == (f"Value for attr 'data_format' of \"{data_format}\" is not in the "
                              "list of allowed values: \"NHWC\", \"NCHW\", \"NDHWC\", \"NCDHW\"")


# is_training is a bool attribute: TensorFlow's op wrappers take a Python bool (None: the
# default) and raise TypeError for anything else, ints and numpy.bool_ included.
BAD_BOOLS = ["no", "", "True", 1, 0, 2, 1.0, np.bool_(True), np.int64(1), [True], object(),
             np.array(True)]


@pytest.mark.parametrize("op", ALL_OPS)
@pytest.mark.parametrize("value", BAD_BOOLS, ids=repr)
def test_is_training_must_be_a_bool(op, value):
    with pytest.raises(TypeError) as err:
        getattr(fbn.raw_ops, op)(**_inputs(op), is_training=value)
    assert str(err.value) == f"Expected bool for argument 'is_training' not {value!r}."


@pytest.mark.parametrize("value", ["no", 1, np.bool_(False), object()], ids=repr)
def test_is_training_type_error_matches_tf(value, tf):
    kwargs = _inputs("FusedBatchNormV3")
    with pytest.raises(TypeError) as theirs:
        tf.raw_ops.FusedBatchNormV3(**kwargs, is_training=value)
    with pytest.raises(TypeError) as mine:
        fbn.raw_ops.FusedBatchNormV3(**kwargs, is_training=value)
    assert str(mine.value) == str(theirs.value)
    c = kwargs["scale"].shape[0]
    args = (kwargs["x"], kwargs["scale"], kwargs["offset"], np.zeros(c, np.float32),
            np.ones(c, np.float32))
    with pytest.raises(TypeError) as theirs:
        tf.compat.v1.nn.fused_batch_norm(*args, is_training=value)
    with pytest.raises(TypeError) as mine:
        fbn.nn.fused_batch_norm(*args, is_training=value)
    assert str(mine.value) == str(theirs.value)


@pytest.mark.parametrize("op", ALL_OPS)
def test_is_training_none_is_the_default(op):
    kwargs = _inputs(op)
    assert all(_same_bits(a, b) for a, b in zip(getattr(fbn.raw_ops, op)(**kwargs, is_training=None),
                                                getattr(fbn.raw_ops, op)(**kwargs)))


# ----------------------------------------------------------------------------------------------
# fbn.nn
# ----------------------------------------------------------------------------------------------
NONE_MESSAGE = ("Both `mean` and `variance` must be a 1D tensor when `is_training` is False or "
                "`exponential_avg_factor` != 1.0. Received: `mean` {!r} and `variance` {!r}")


def _fbn_case(kind):
    x = np.ones((1, 1, 2, 2), np.float32)
    m = np.ones(2, np.float32)
    return {
        "inference-none": (dict(is_training=False), None, None),
        "inference-variance-none": (dict(mean=m, is_training=False), m, None),
        "factor-none": (dict(exponential_avg_factor=0.5), None, None),
        "factor-mean-none": (dict(variance=m, exponential_avg_factor=0.9), None, m),
    }[kind], x


KINDS = ["inference-none", "inference-variance-none", "factor-none", "factor-mean-none"]


@pytest.mark.parametrize("kind", KINDS)
def test_fused_batch_norm_value_error(kind):
    (kwargs, mean, variance), x = _fbn_case(kind)
    with pytest.raises(ValueError) as err:
        fbn.nn.fused_batch_norm(x, [1.0, 1.0], [0.0, 0.0], **kwargs)
    assert not isinstance(err.value, fbn.errors.InvalidArgumentError)
    assert str(err.value) == NONE_MESSAGE.format(mean, variance)


@pytest.mark.parametrize("kind", KINDS)
def test_fused_batch_norm_value_error_matches_tf(kind, tf):
    (kwargs, _, _), x = _fbn_case(kind)
    with pytest.raises(ValueError) as theirs:
        tf.compat.v1.nn.fused_batch_norm(x, np.ones(2, np.float32), np.zeros(2, np.float32),
                                         **kwargs)
    with pytest.raises(ValueError) as mine:
        fbn.nn.fused_batch_norm(x, np.ones(2, np.float32), np.zeros(2, np.float32), **kwargs)
    assert str(mine.value) == str(theirs.value)


def test_fused_batch_norm_defaults():
    """epsilon 0.001 (not the op's 0.0001), V3, (y, running_mean, running_var)."""
    kwargs = _inputs("FusedBatchNormV3")
    result = fbn.nn.fused_batch_norm(kwargs["x"], kwargs["scale"], kwargs["offset"])
    assert isinstance(result, tuple) and len(result) == 3
    raw = fbn.raw_ops.FusedBatchNormV3(**kwargs, epsilon=0.001)
    for a, b in zip(result, raw[:3]):
        assert _same_bits(a, b)
    # Training with the factor 1 ignores given mean/variance.
    given = fbn.nn.fused_batch_norm(kwargs["x"], kwargs["scale"], kwargs["offset"],
                                    mean=np.full(5, 7.0, np.float32),
                                    variance=np.full(5, 9.0, np.float32))
    for a, b in zip(result, given):
        assert _same_bits(a, b)
    params = inspect.signature(fbn.nn.fused_batch_norm).parameters
    assert list(params) == ["x", "scale", "offset", "mean", "variance", "epsilon", "data_format",
                            "is_training", "name", "exponential_avg_factor"]
    assert params["epsilon"].default == 0.001


def test_nn_signatures_match_tf(tf):
    pairs = [(fbn.nn.fused_batch_norm, tf.compat.v1.nn.fused_batch_norm),
             (fbn.nn.moments, tf.compat.v1.nn.moments),
             (fbn.nn.batch_normalization, tf.nn.batch_normalization)]
    for mine, theirs in pairs:
        p_mine = inspect.signature(mine).parameters
        p_theirs = inspect.signature(theirs).parameters
        assert list(p_mine) == list(p_theirs), mine.__name__
        for name, p in p_theirs.items():
            assert p_mine[name].default == p.default, (mine.__name__, name)


def test_moments_keep_dims_conflict():
    with pytest.raises(ValueError, match="Cannot specify both 'keep_dims' and 'keepdims'"):
        fbn.nn.moments(np.ones((2, 3), np.float32), [0], keep_dims=True, keepdims=True)


def test_moments_axes_forms():
    x = np.random.default_rng(3).standard_normal((2, 3, 4)).astype(np.float32)
    for axes in ([1], (1,), np.array([1]), 1, [-2]):
        mean, var = fbn.nn.moments(x, axes)
        assert mean.shape == var.shape == (2, 4)
        ref.check_close(mean, x.astype(np.float64).mean(axis=1), 1e-6, 1.0, what="mean")
        ref.check_close(var, x.astype(np.float64).var(axis=1), 1e-6, 1.0, what="variance")


def test_batch_normalization_dtype_rules():
    x = np.ones((2, 3), np.float16)
    p = np.ones(3, np.float16)
    assert fbn.nn.batch_normalization(x, p, p, None, None, 1e-3).dtype == F16
    with pytest.raises(fbn.errors.InvalidArgumentError):
        fbn.nn.batch_normalization(x, p.astype(np.float32), p, None, None, 1e-3)
    with pytest.raises(fbn.errors.InvalidArgumentError, match="Incompatible shapes"):
        fbn.nn.batch_normalization(x, np.ones(4, np.float16), p, None, None, 1e-3)


# ----------------------------------------------------------------------------------------------
# Threads
# ----------------------------------------------------------------------------------------------
def test_thread_count_api():
    default = fbn.get_num_threads()
    assert default >= 1
    for n in (1, 2, 3, 7):
        fbn.set_num_threads(n)
        assert fbn.get_num_threads() == n
    for reset in (0, -1):
        fbn.set_num_threads(reset)
        assert fbn.get_num_threads() == default
    with pytest.raises(TypeError):
        fbn.set_num_threads("2")


def test_results_do_not_depend_on_threads_small():
    kwargs = _inputs("FusedBatchNormV3", shape=(3, 7, 9, 13))
    fbn.set_num_threads(1)
    one = fbn.raw_ops.FusedBatchNormV3(**kwargs)
    fbn.set_num_threads(4)
    four = fbn.raw_ops.FusedBatchNormV3(**kwargs)
    for a, b in zip(one, four):
        assert _same_bits(a, b)


def test_public_names():
    assert set(fbn.raw_ops.__all__) == set(ALL_OPS)
    assert {"fused_batch_norm", "moments", "batch_normalization"} <= set(fbn.nn.__all__)
    assert isinstance(fbn.__version__, str) and fbn.__version__
