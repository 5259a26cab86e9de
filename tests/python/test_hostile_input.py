"""Hostile input to fbn's Python API: wrong dtypes, odd memory layouts, wrong ranks, non-arrays,
huge and zero-stride shapes, allocations that cannot succeed, NaN/Inf, absurd thread counts and
concurrent callers. Every call either gives the right result or raises a clear exception; none
may crash or hang the interpreter (the risky ones run in a subprocess whose exit status is
checked, most under an address-space limit so that nothing large is really allocated).

NaN/Inf propagation is compared with TensorFlow (TF_ENABLE_ONEDNN_OPTS=0) when it is installed.
"""
import os
import re
import subprocess
import sys
import textwrap
import threading

import ml_dtypes
import numpy as np
import pytest

import fbn
from fbn import errors, nn, raw_ops

F32 = np.float32

# ---------------------------------------------------------------------------------------------
# Helpers.


def _forward_args(shape=(2, 3, 4, 5), dtype=F32, c=None, seed=0):
    rng = np.random.RandomState(seed)
    c = shape[-1] if c is None else c
    stats = np.float64 if dtype == np.float64 else F32
    return dict(x=rng.uniform(-2, 2, shape).astype(dtype), scale=rng.uniform(0.5, 2, c).astype(stats),
                offset=rng.uniform(-1, 1, c).astype(stats), mean=rng.uniform(-1, 1, c).astype(stats),
                variance=rng.uniform(0.5, 2, c).astype(stats))


def _grad_args(shape=(2, 3, 4, 5), dtype=F32, seed=1):
    rng = np.random.RandomState(seed)
    c = shape[-1]
    return dict(y_backprop=rng.uniform(-1, 1, shape).astype(dtype),
                x=rng.uniform(-2, 2, shape).astype(dtype), scale=rng.uniform(0.5, 2, c).astype(F32),
                reserve_space_1=rng.uniform(-1, 1, c).astype(F32),
                reserve_space_2=rng.uniform(0.5, 2, c).astype(F32),
                reserve_space_3=np.zeros((0,), F32))


def _bitwise_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


_PRELUDE = """
import os, resource, sys
import numpy as np
import fbn
from fbn import errors, nn, raw_ops

def _vm_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0

def limit_address_space(extra_bytes):
    # What the interpreter has mapped now, plus `extra_bytes`: larger allocations fail cleanly.
    limit = _vm_bytes() + int(extra_bytes)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
"""


def run_isolated(code, timeout=180):
    """Runs `code` (after _PRELUDE) in a fresh interpreter and returns its CompletedProcess.

    A hang is a test failure, not a stuck test run.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    try:
        return subprocess.run([sys.executable, "-c", _PRELUDE + textwrap.dedent(code)],
                              capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"subprocess hung for {timeout} s\nstdout: {e.stdout}\nstderr: {e.stderr}")


def assert_clean_exit(proc, expect=None):
    sig = f" (killed by signal {-proc.returncode})" if proc.returncode < 0 else ""
    assert proc.returncode == 0, (f"exit status {proc.returncode}{sig}\nstdout:\n{proc.stdout[-3000:]}"
                                  f"\nstderr:\n{proc.stderr[-5000:]}")
    if expect is not None:
        assert expect in proc.stdout, proc.stdout + proc.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# Wrong dtypes: a TypeError naming the argument and the dtype.

_BAD_DTYPES = [np.int8, np.int32, np.int64, np.uint16, np.bool_, np.complex64, np.complex128,
               object, np.str_, "datetime64[s]"]


@pytest.mark.parametrize("dtype", _BAD_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("arg", ["x", "scale", "mean"])
def test_fused_batch_norm_rejects_non_float_dtypes(dtype, arg):
    args = _forward_args()
    args[arg] = np.zeros(args[arg].shape, dtype=dtype)
    with pytest.raises(TypeError, match=rf"{arg} must be a float16, bfloat16, float32 or float64 "
                                        rf"array, got dtype {re.escape(str(args[arg].dtype))}"):
        raw_ops.FusedBatchNormV3(**args)


@pytest.mark.parametrize("dtype", _BAD_DTYPES, ids=lambda d: np.dtype(d).name)
def test_grad_moments_and_batch_normalization_reject_non_float_dtypes(dtype):
    bad = np.zeros((2, 2, 2, 3), dtype=dtype)
    g = _grad_args((2, 2, 2, 3))
    with pytest.raises(TypeError, match="y_backprop must be a float16"):
        raw_ops.FusedBatchNormGradV3(**dict(g, y_backprop=bad))
    with pytest.raises(TypeError, match="x must be a float16"):
        nn.moments(bad, axes=[0])
    m = np.zeros(3, F32)
    with pytest.raises(TypeError, match="x must be a float16"):
        nn.batch_normalization(bad, m, m + 1, None, None, 1e-3)
    with pytest.raises(TypeError, match="variance must be a float16"):
        nn.batch_normalization(np.zeros((2, 3), F32), m, np.zeros(3, dtype=dtype), None, None, 1e-3)


def test_mismatched_float_dtypes_get_tensorflow_texts():
    args = _forward_args()
    with pytest.raises(errors.InvalidArgumentError,
                       match=r"Value for attr 'U' of half is not in the list of allowed values"):
        raw_ops.FusedBatchNormV3(**dict(args, scale=args["scale"].astype(np.float16)))
    with pytest.raises(errors.InvalidArgumentError, match=r"input #4\(zero-based\) was expected "
                                                          r"to be a float tensor but is a double"):
        raw_ops.FusedBatchNormV3(**dict(args, variance=args["variance"].astype(np.float64)))
    with pytest.raises(errors.InvalidArgumentError, match="Value for attr 'T' of half"):
        raw_ops.FusedBatchNorm(**dict(args, x=args["x"].astype(np.float16)))
    with pytest.raises(errors.InvalidArgumentError, match="mean must have the dtype of x"):
        nn.batch_normalization(np.zeros((2, 3), F32), np.zeros(3, np.float64), np.ones(3, F32),
                               None, None, 1e-3)


def test_bfloat16_and_half_are_accepted():
    for dt in (np.float16, ml_dtypes.bfloat16):
        out = raw_ops.FusedBatchNormV3(**_forward_args(dtype=dt))
        assert out.y.dtype == np.dtype(dt) and out.batch_mean.dtype == F32


# ---------------------------------------------------------------------------------------------
# Memory layouts: strided, transposed, negative strides, Fortran order and read-only arrays give
# exactly the result of a C-contiguous copy, and inputs are never written.


def _layouts(base):
    """(name, array equal in value to `base`, not C-contiguous or not writeable)."""
    big = np.zeros((base.shape[0], base.shape[1] * 2) + base.shape[2:], base.dtype)
    big[:, ::2] = base
    transposed = np.ascontiguousarray(base.transpose(3, 1, 2, 0)).transpose(3, 1, 2, 0)
    reversed_ = np.ascontiguousarray(base[::-1, :, ::-1])[::-1, :, ::-1]
    readonly = base.copy()
    readonly.setflags(write=False)
    return [("strided", big[:, ::2]), ("transposed", transposed), ("negative_strides", reversed_),
            ("fortran", np.asfortranarray(base)), ("readonly", readonly)]


@pytest.mark.parametrize("layout", ["strided", "transposed", "negative_strides", "fortran",
                                    "readonly"])
def test_odd_layouts_match_contiguous(layout):
    args = _forward_args((2, 3, 4, 5))
    want = raw_ops.FusedBatchNormV3(**args)
    x = dict(_layouts(args["x"]))[layout]
    assert np.array_equal(x, args["x"])
    assert not x.flags.c_contiguous or not x.flags.writeable
    before = x.copy()
    got = raw_ops.FusedBatchNormV3(**dict(args, x=x))
    for a, b in zip(got, want):
        assert _bitwise_equal(a, b)
    assert _bitwise_equal(x, before)

    g = _grad_args((2, 3, 4, 5))
    want_g = raw_ops.FusedBatchNormGradV3(**g)
    got_g = raw_ops.FusedBatchNormGradV3(**dict(g, x=dict(_layouts(g["x"]))[layout],
                                                y_backprop=dict(_layouts(g["y_backprop"]))[layout]))
    for a, b in zip(got_g, want_g):
        assert _bitwise_equal(a, b)

    m_want = nn.moments(args["x"], axes=[0, 1, 2])
    m_got = nn.moments(x, axes=[0, 1, 2])
    assert _bitwise_equal(m_got[0], m_want[0]) and _bitwise_equal(m_got[1], m_want[1])
    bn_want = nn.batch_normalization(args["x"], args["mean"], args["variance"], args["offset"],
                                     args["scale"], 1e-3)
    bn_got = nn.batch_normalization(x, args["mean"], args["variance"], args["offset"],
                                    args["scale"], 1e-3)
    assert _bitwise_equal(bn_got, bn_want)


def test_strided_per_channel_vectors():
    args = _forward_args()
    wide = np.zeros(10, F32)
    wide[::2] = args["scale"]
    got = raw_ops.FusedBatchNormV3(**dict(args, scale=wide[::2], offset=args["offset"][::-1][::-1]))
    want = raw_ops.FusedBatchNormV3(**args)
    assert all(_bitwise_equal(a, b) for a, b in zip(got, want))


def test_inputs_are_never_written():
    args = _forward_args()
    copies = {k: v.copy() for k, v in args.items()}
    raw_ops.FusedBatchNormV3(**args, is_training=False)
    raw_ops.FusedBatchNormV3(**args, exponential_avg_factor=0.5)
    for k in args:
        assert _bitwise_equal(args[k], copies[k]), k


# ---------------------------------------------------------------------------------------------
# Non-arrays, wrong ranks, scalars and 0-d arrays.


@pytest.mark.parametrize("arg", ["x", "scale", "offset", "mean", "variance"])
def test_none_is_a_type_error(arg):
    with pytest.raises(TypeError, match=f"{arg} must be an array, got None"):
        raw_ops.FusedBatchNormV3(**dict(_forward_args(), **{arg: None}))


def test_none_elsewhere():
    with pytest.raises(TypeError, match="x must be an array, got None"):
        nn.moments(None, axes=[0])
    with pytest.raises(TypeError, match="mean must be an array, got None"):
        nn.batch_normalization(np.zeros(3, F32), None, np.ones(3, F32), None, None, 1e-3)
    with pytest.raises(TypeError, match="reserve_space_1 must be an array, got None"):
        raw_ops.FusedBatchNormGradV3(**dict(_grad_args(), reserve_space_1=None))


def test_lists_become_float32():
    args = _forward_args((1, 2, 2, 3))
    as_lists = {k: v.tolist() for k, v in args.items()}
    got = raw_ops.FusedBatchNormV3(**as_lists)
    want = raw_ops.FusedBatchNormV3(**args)
    assert all(_bitwise_equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("value, exc, match", [
    ([[1.0, 2.0], [3.0]], ValueError, "inhomogeneous|sequence"),  # ragged
    ([["a", "b"]], ValueError, "could not convert"),
    ({"a": 1}, TypeError, "float"),
    ("abc", ValueError, "could not convert"),
])
def test_non_numeric_containers(value, exc, match):
    with pytest.raises(exc, match=match):
        nn.moments(value, axes=[0])


@pytest.mark.parametrize("x, rank_text", [
    (1.0, "[]"), (np.float32(1.0), "[]"), (np.array(2.0, F32), "[]"),
    (np.zeros((3,), F32), "[3]"), (np.zeros((2, 3), F32), "[2,3]"),
    (np.zeros((1, 1, 1, 1, 1, 3), F32), "[1,1,1,1,1,3]"),
])
def test_fused_ops_reject_wrong_ranks(x, rank_text):
    c = np.ones(3, F32)
    with pytest.raises(errors.InvalidArgumentError,
                       match=rf"^input must be 4 or 5-dimensional{re.escape(rank_text)}$"):
        raw_ops.FusedBatchNormV3(x=x, scale=c, offset=c, mean=c, variance=c)


def test_per_channel_rank_errors():
    args = _forward_args()
    with pytest.raises(errors.InvalidArgumentError, match=r"^scale must be 1-dimensional\[1,5\]$"):
        raw_ops.FusedBatchNormV3(**dict(args, scale=args["scale"][None]))
    with pytest.raises(errors.InvalidArgumentError, match=r"^offset must be 1-dimensional\[\]$"):
        raw_ops.FusedBatchNormV3(**dict(args, offset=np.float32(0)))
    with pytest.raises(errors.InvalidArgumentError,
                       match="scale must have the same number of elements as the channels of x"):
        raw_ops.FusedBatchNormV3(**dict(args, scale=np.ones(0, F32)))


def test_rank_above_eight_is_rejected():
    x = np.zeros((1,) * 9, F32)
    with pytest.raises(errors.InvalidArgumentError, match="rank 9, above the supported 8"):
        nn.moments(x, axes=[0])


def test_scalars_and_0d_in_nonfused_ops():
    mean, var = nn.moments(np.array(3.0, F32), axes=[])
    assert mean.shape == () and mean == 3.0 and var == 0.0
    y = nn.batch_normalization(np.float32(3.0), np.float32(1.0), np.float32(4.0), np.float32(0.5),
                               np.float32(2.0), 0.0)
    assert y.shape == () and y == pytest.approx(2.5)
    y = nn.batch_normalization(2.0, 1.0, 1.0, None, None, 0.0)
    assert y.dtype == F32 and y == 1.0


@pytest.mark.parametrize("axes, match", [
    ([3], r"Invalid reduction dimension"), ([-4], r"Invalid reduction dimension"),
    ([0, 0], "duplicate"), ([1, -2], "duplicate"), ([2**31 - 1], "Invalid reduction dimension"),
])
def test_moments_bad_axes(axes, match):
    with pytest.raises(errors.InvalidArgumentError, match=match):
        nn.moments(np.zeros((2, 3, 4), F32), axes=axes)


def test_moments_axes_beyond_c_int():
    with pytest.raises((TypeError, OverflowError, errors.InvalidArgumentError)):
        nn.moments(np.zeros((2, 3), F32), axes=[2**40])


# ---------------------------------------------------------------------------------------------
# Attributes.


@pytest.mark.parametrize("fmt", ["nhwc", "NHWC ", "", "NCDHW\0", "HWNC", "NDHWC"])
def test_bad_data_format(fmt):
    # V2 does not list the 3-D names; nothing else lists anything but the exact names.
    with pytest.raises(errors.InvalidArgumentError, match="Value for attr 'data_format' of"):
        raw_ops.FusedBatchNormV2(**_forward_args(), data_format=fmt)


def test_non_numeric_attributes():
    with pytest.raises((TypeError, ValueError)):
        raw_ops.FusedBatchNormV3(**_forward_args(), epsilon="small")
    with pytest.raises(TypeError):
        raw_ops.FusedBatchNormV3(**_forward_args(), exponential_avg_factor=None)
    # Beyond float32's range: epsilon becomes +inf (y = offset in inference), no error.
    args = _forward_args()
    out = raw_ops.FusedBatchNormV3(**args, epsilon=1e39, is_training=False)
    assert np.array_equal(out.y, np.broadcast_to(args["offset"], out.y.shape))


@pytest.mark.parametrize("value", ["no", "", 1, 0, np.bool_(True), 1.0, [True],
                                   object(), np.array(True)], ids=repr)
def test_is_training_accepts_only_a_bool(value):
    # TensorFlow's op wrappers: TypeError for anything but a Python bool (None: the default).
    for op, args in (("FusedBatchNormV3", _forward_args()), ("FusedBatchNormGradV3", _grad_args())):
        with pytest.raises(TypeError, match=re.escape(
                f"Expected bool for argument 'is_training' not {value!r}.")):
            getattr(raw_ops, op)(**args, is_training=value)
    with pytest.raises(TypeError, match="Expected bool for argument 'is_training'"):
        a = _forward_args()
        nn.fused_batch_norm(a["x"], a["scale"], a["offset"], a["mean"], a["variance"],
                            is_training=value)


@pytest.mark.parametrize("value", ["no", "", 2, 0.5, object(), [True], np.array(True)], ids=repr)
def test_layer_training_must_be_a_bool_or_0_or_1(value):
    layer = fbn.layers.BatchNormalization()
    x = np.ones((4, 3), F32)
    with pytest.raises(TypeError, match=re.escape(
            "`training` must be a Python bool, or 1 or 0, or an fbn.TrainingFlag. Received: "
            f"{type(value)}")):
        layer(x, training=value)
    assert not layer.built  # nothing was created or updated
    y = layer(x, training=1)  # 1 and 0 (and numpy's 1/0 scalars) are accepted, as in TensorFlow
    assert layer.built and np.asarray(y).shape == x.shape
    before = np.array(layer.moving_mean.numpy())
    with pytest.raises(TypeError):
        layer(x + 5, training=value)
    assert np.array_equal(layer.moving_mean.numpy(), before)
    # The Keras V2 layer turns a Python int into a bool first (2 is True there, as in Keras).
    v2 = fbn.layers.BatchNormalizationV2()
    if isinstance(value, int):
        v2(x, training=value)
    else:
        with pytest.raises(TypeError, match="`training` must be a Python bool"):
            v2(x, training=value)


@pytest.mark.parametrize("eps", [float("nan"), float("inf"), -1.0, -1e-30, 0.0])
def test_hostile_epsilon_never_crashes(eps):
    args = _forward_args()
    out = raw_ops.FusedBatchNormV3(**args, epsilon=eps, is_training=False)
    v = args["variance"].astype(np.float64) + np.float64(F32(eps))
    expect_nan = np.isnan(np.sqrt(v, where=v >= 0, out=np.full_like(v, np.nan)))
    assert np.array_equal(np.isnan(out.y).all(axis=(0, 1, 2)), expect_nan)


@pytest.mark.parametrize("factor", [float("nan"), float("inf"), -1.0, 0.0, 2.0])
def test_hostile_exponential_avg_factor(factor):
    args = _forward_args()
    out = raw_ops.FusedBatchNormV3(**args, exponential_avg_factor=factor)
    assert np.isfinite(out.y).all()  # y uses the batch statistics only
    if np.isnan(factor) or np.isinf(factor):
        assert not np.isfinite(out.batch_mean).any()


# ---------------------------------------------------------------------------------------------
# Huge shapes, zero-stride views and allocations that cannot succeed (in subprocesses).


def test_empty_batch_with_large_channel_count():
    c = 1 << 20
    x = np.zeros((0, 1, 1, c), F32)
    v = np.ones(c, F32)
    out = raw_ops.FusedBatchNormV3(x=x, scale=v, offset=v, mean=v, variance=v)
    assert out.y.shape == x.shape and np.isnan(out.batch_mean).all()


def test_zero_stride_view_of_moderate_size():
    # 16 Mi elements (64 MiB) described by 4 bytes of memory: copied once, then computed.
    x = np.broadcast_to(F32(3.0), (64, 64, 64, 64))
    c = np.ones(64, F32)
    out = raw_ops.FusedBatchNormV3(x=x, scale=c, offset=c * 0.5, mean=c, variance=c)
    assert np.all(out.y == 0.5) and np.all(out.batch_mean == 3.0)
    mean, var = nn.moments(x, axes=[0, 1, 2])
    assert np.all(mean == 3.0) and np.all(var == 0.0)


def test_zero_stride_views_of_two_to_the_31_and_more_elements():
    proc = run_isolated("""
        limit_address_space(3 << 30)
        base = np.zeros(8, np.float32)
        cases = {
            "fused_2^31+8": np.lib.stride_tricks.as_strided(base, shape=(1, 1, 2**28 + 1, 8),
                                                            strides=(0, 0, 0, 4)),
            "fused_2^40": np.broadcast_to(np.float32(1), (2**20, 2**10, 2**10, 1)),
        }
        c8, c1 = np.ones(8, np.float32), np.ones(1, np.float32)
        for name, x in cases.items():
            c = c8 if x.shape[-1] == 8 else c1
            for call in (lambda: raw_ops.FusedBatchNormV3(x=x, scale=c, offset=c, mean=c, variance=c),
                         lambda: nn.moments(x, axes=[0, 1, 2]),
                         lambda: nn.batch_normalization(x, c, c, None, None, 1e-3)):
                try:
                    call()
                    print(name, "computed")
                except MemoryError as e:
                    print(name, "MemoryError", type(e).__name__)
        print("OK")
    """)
    assert_clean_exit(proc, "OK")
    assert "computed" not in proc.stdout  # 8 GiB and 4 TiB copies cannot fit in 3 GiB


def test_empty_batch_with_absurd_channel_count():
    # x has no elements, but scale must hold 2^40 of them: NumPy's copy of the zero-stride view
    # fails, before fbn is reached.
    proc = run_isolated("""
        limit_address_space(2 << 30)
        x = np.zeros((0, 1, 1, 2**40), np.float32)
        v = np.broadcast_to(np.float32(1), (2**40,))
        try:
            raw_ops.FusedBatchNormV3(x=x, scale=v, offset=v, mean=v, variance=v)
            print("computed")
        except MemoryError:
            print("MemoryError")
        print("OK")
    """)
    assert_clean_exit(proc, "MemoryError")


@pytest.mark.parametrize("op", ["batch_normalization", "fused_batch_norm_v3", "grad_v3"])
def test_output_allocation_failure_raises_resource_exhausted(op):
    # The inputs fit in the address space; the output of the same size does not.
    proc = run_isolated(f"""
        n = 96 << 20  # elements: 384 MiB of float32
        x = np.zeros((1, 1, n // 8, 8), np.float32)   # calloc: mapped, not touched
        limit_address_space(160 << 20)  # less than the output needs
        c = np.ones(8, np.float32)
        try:
            if "{op}" == "batch_normalization":
                nn.batch_normalization(x, c, c, None, None, 1e-3)
            elif "{op}" == "fused_batch_norm_v3":
                raw_ops.FusedBatchNormV3(x=x, scale=c, offset=c, mean=c, variance=c)
            else:
                raw_ops.FusedBatchNormGradV3(y_backprop=x, x=x, scale=c, reserve_space_1=c,
                                             reserve_space_2=c, reserve_space_3=c)
            print("computed")
        except errors.ResourceExhaustedError as e:
            assert isinstance(e, MemoryError)
            print("ResourceExhaustedError:", e)
        print("OK")
    """)
    assert_clean_exit(proc, "ResourceExhaustedError: could not allocate an output of")


def test_layer_with_absurd_axis_size_on_an_empty_input():
    # (0, 2**62 - 1) float16 is a valid empty NumPy array; the layer's float32 variables would need
    # 2^64 - 4 bytes each: a clean MemoryError, never a tiny buffer written past its end.
    proc = run_isolated("""
        limit_address_space(2 << 30)
        for shape, dtype in [((0, 2**62 - 1), np.float16), ((0, 2**33), np.float32)]:
            layer = fbn.layers.BatchNormalization()
            try:
                layer(np.empty(shape, dtype), training=True)
                print(shape, "computed")
            except MemoryError as e:
                print(shape, "MemoryError", type(e).__name__, str(e)[:80])
        print("OK")
    """)
    assert_clean_exit(proc, "OK")
    assert "computed" not in proc.stdout


# ---------------------------------------------------------------------------------------------
# The private binding, called directly with inconsistent codes: errors, never crashes.


def test_private_binding_with_inconsistent_arguments():
    proc = run_isolated("""
        from fbn import _fbn
        x = np.zeros((1, 2, 2, 3), np.float32)
        c = np.ones(3, np.float32)
        F, D = _fbn.DT_FLOAT, _fbn.DT_DOUBLE
        attempts = {
            "dtype code 9": lambda: _fbn.fused_batch_norm(3, x, 9, c, F, c, F, c, F, c, F, 1e-3, 1.0, "NHWC", True),
            "code says double for float32 data": lambda: _fbn.fused_batch_norm(3, x, D, c, D, c, D, c, D, c, D, 1e-3, 1.0, "NHWC", True),
            "complex64 passed as double": lambda: _fbn.moments(np.zeros((2, 2), np.complex64), D, [0], False),
            "int32 passed as float": lambda: _fbn.moments(np.zeros((2, 2), np.int32), F, [0], False),
            "non-contiguous": lambda: _fbn.moments(np.zeros((4, 4), np.float32)[:, ::2], F, [0], False),
            "version 7": lambda: _fbn.fused_batch_norm(7, x, F, c, F, c, F, c, F, c, F, 1e-3, 1.0, "NHWC", True),
            "version -1 grad": lambda: _fbn.fused_batch_norm_grad(-1, x, x, F, c, F, c, F, c, F, c, F, 1e-3, "NHWC", True, F),
            "object array": lambda: _fbn.moments(np.zeros(3, object), F, [0], False),
        }
        for name, f in attempts.items():
            try:
                f()
                print(name, ": accepted")
            except Exception as e:
                print(name, ":", type(e).__name__, str(e)[:100])
        print("OK")
    """)
    assert_clean_exit(proc, "OK")
    out = proc.stdout
    assert "dtype code 9 : InvalidArgumentError" in out
    assert "code says double for float32 data : InvalidArgumentError" in out
    # A version outside 1..3 is rejected first (ParseDataFormat is the binding's first call).
    assert ("version 7 : InvalidArgumentError ParseDataFormat: argument version must be "
            "fbn::OpVersion::kV1, kV2 or kV3") in out
    assert ("version -1 grad : InvalidArgumentError ParseDataFormat: argument version must be "
            "fbn::OpVersion::kV1, kV2 or kV3") in out


# ---------------------------------------------------------------------------------------------
# NaN and Inf: no crash, no hang, TensorFlow's propagation.


def _nan_cases():
    rng = np.random.RandomState(3)
    x = rng.uniform(-2, 2, (2, 3, 3, 4)).astype(F32)
    c = dict(scale=np.ones(4, F32), offset=np.zeros(4, F32), mean=rng.uniform(-1, 1, 4).astype(F32),
             variance=rng.uniform(0.5, 2, 4).astype(F32))
    nan_x = x.copy()
    nan_x[0, 1, 1, 1] = np.nan
    inf_x = x.copy()
    inf_x[1, 2, 0, 2] = np.inf
    ninf_x = x.copy()
    ninf_x[1, 2, 0, 0] = -np.inf
    nan_scale = dict(c, scale=np.array([1, np.nan, 1, 1], F32))
    nan_mean = dict(c, mean=np.array([0, 0, np.nan, 0], F32))
    inf_var = dict(c, variance=np.array([1, np.inf, 1, 1], F32))
    return {
        "nan_in_x_training": (dict(c, x=nan_x), dict(is_training=True)),
        "inf_in_x_training": (dict(c, x=inf_x), dict(is_training=True)),
        "minus_inf_in_x_training": (dict(c, x=ninf_x), dict(is_training=True)),
        "nan_in_x_inference": (dict(c, x=nan_x), dict(is_training=False)),
        "nan_scale_training": (dict(nan_scale, x=x), dict(is_training=True)),
        "nan_mean_inference": (dict(nan_mean, x=x), dict(is_training=False)),
        "nan_mean_training_factor_half": (dict(nan_mean, x=x),
                                          dict(is_training=True, exponential_avg_factor=0.5)),
        "inf_variance_inference": (dict(inf_var, x=x), dict(is_training=False)),
    }


@pytest.fixture(scope="module")
def tf():
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return pytest.importorskip("tensorflow")


def _assert_same_values(got, want, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, what
    assert np.array_equal(np.isnan(got), np.isnan(want)), f"{what}: NaN positions differ"
    fin = np.isfinite(want)
    assert np.array_equal(np.isinf(got), np.isinf(want)), f"{what}: Inf positions differ"
    assert np.array_equal(got[np.isinf(got)], want[np.isinf(want)]), f"{what}: Inf signs differ"
    np.testing.assert_allclose(got[fin], want[fin], rtol=2e-5, atol=2e-5, err_msg=what)


@pytest.mark.parametrize("case", list(_nan_cases()))
def test_nan_and_inf_propagate_as_tensorflow(tf, case):
    inputs, attrs = _nan_cases()[case]
    got = raw_ops.FusedBatchNormV3(**inputs, epsilon=1e-3, **attrs)
    want = tf.raw_ops.FusedBatchNormV3(**inputs, epsilon=1e-3, **attrs)
    names = ["y", "batch_mean", "batch_variance"]
    if attrs["is_training"]:
        names += ["reserve_space_1", "reserve_space_2"]  # undefined in TF's CPU inference
    for i, name in enumerate(["y", "batch_mean", "batch_variance", "reserve_space_1",
                              "reserve_space_2"]):
        if name in names:
            _assert_same_values(got[i], want[i], f"{case}: {name}")


@pytest.mark.parametrize("case", ["nan_in_x_training", "inf_in_x_training", "nan_scale_training"])
def test_nan_and_inf_in_the_gradient_as_tensorflow(tf, case):
    inputs, _ = _nan_cases()[case]
    fwd = raw_ops.FusedBatchNormV3(**inputs, epsilon=1e-3, is_training=True)
    dy = np.random.RandomState(5).uniform(-1, 1, inputs["x"].shape).astype(F32)
    args = dict(y_backprop=dy, x=inputs["x"], scale=inputs["scale"],
                reserve_space_1=np.asarray(fwd.reserve_space_1),
                reserve_space_2=np.asarray(fwd.reserve_space_2),
                reserve_space_3=np.asarray(fwd.reserve_space_3), epsilon=1e-3, is_training=True)
    got = raw_ops.FusedBatchNormGradV3(**args)
    want = tf.raw_ops.FusedBatchNormGradV3(**args)
    for i, name in enumerate(["x_backprop", "scale_backprop", "offset_backprop"]):
        _assert_same_values(got[i], want[i], f"{case}: {name}")


def test_nan_propagation_is_per_channel():
    # Documented in docs/bad-input.md: a NaN in x poisons its own channel only.
    inputs, attrs = _nan_cases()["nan_in_x_training"]
    out = raw_ops.FusedBatchNormV3(**inputs, **attrs)
    assert np.isnan(out.y[..., 1]).all() and np.isfinite(np.delete(out.y, 1, axis=-1)).all()
    assert np.isnan(out.batch_mean[1]) and np.isfinite(np.delete(out.batch_mean, 1)).all()
    mean, var = nn.moments(inputs["x"], axes=[0, 1, 2])
    assert np.isnan(mean[1]) and np.isnan(var[1]) and np.isfinite(np.delete(var, 1)).all()


def test_all_nan_and_all_inf_inputs_finish():
    for value in (np.nan, np.inf, -np.inf, np.finfo(F32).max, np.finfo(F32).tiny / 2):
        x = np.full((4, 8, 8, 16), value, F32)
        c = np.ones(16, F32)
        raw_ops.FusedBatchNormV3(x=x, scale=c, offset=c, mean=c, variance=c)
        raw_ops.FusedBatchNormGradV3(y_backprop=x, x=x, scale=c, reserve_space_1=c,
                                     reserve_space_2=c, reserve_space_3=c)
        nn.moments(x, axes=[0, 1, 2])
        nn.batch_normalization(x, c, c, c, c, 1e-3)


# ---------------------------------------------------------------------------------------------
# Thread counts and concurrency.


def test_set_num_threads_values():
    # In a subprocess: a pool that hangs must not take the test run with it.
    proc = run_isolated("""
        x = np.random.RandomState(0).uniform(-1, 1, (8, 16, 16, 32)).astype(np.float32)
        c = np.linspace(0.5, 2, 32).astype(np.float32)
        fbn.set_num_threads(1)
        want = raw_ops.FusedBatchNormV3(x=x, scale=c, offset=c, mean=c, variance=c)
        for n in [0, -1, -(2**31), 1, 3, 64, 2]:
            fbn.set_num_threads(n)
            assert fbn.get_num_threads() >= 1, n
            for _ in range(20):
                got = raw_ops.FusedBatchNormV3(x=x, scale=c, offset=c, mean=c, variance=c)
                assert all(np.asarray(a).tobytes() == np.asarray(b).tobytes()
                           for a, b in zip(got, want)), n
        print("OK")
    """)
    assert_clean_exit(proc, "OK")


def test_set_num_threads_out_of_int_range():
    with pytest.raises(TypeError):
        fbn.set_num_threads(2**40)
    with pytest.raises(TypeError):
        fbn.set_num_threads("4")


def test_absurd_thread_count_under_a_thread_limit():
    # 100000 threads cannot all start in 2 GiB of address space: the op must still finish (with
    # fewer threads, or an error), never abort or hang.
    proc = run_isolated("""
        x = np.random.RandomState(0).uniform(-1, 1, (16, 32, 32, 32)).astype(np.float32)
        c = np.ones(32, np.float32)
        fbn.set_num_threads(1)
        want = raw_ops.FusedBatchNormV3(x=x, scale=c, offset=c, mean=c, variance=c)
        limit_address_space(2 << 30)
        fbn.set_num_threads(100000)
        try:
            got = raw_ops.FusedBatchNormV3(x=x, scale=c, offset=c, mean=c, variance=c)
            assert all(np.array_equal(a, b) for a, b in zip(got, want)), "different results"
            print("computed with", fbn.get_num_threads(), "threads configured")
        except (MemoryError, RuntimeError) as e:
            print("error:", type(e).__name__, e)
        print("OK")
    """, timeout=240)
    assert_clean_exit(proc, "OK")


def test_back_to_back_calls_with_many_threads_do_not_hang():
    # Each op runs ParallelFor phases with different thread counts; many calls in a row once
    # left the pool waiting for a worker that had skipped its run.
    proc = run_isolated("""
        fbn.set_num_threads(8)
        rng = np.random.RandomState(0)
        big = rng.uniform(-1, 1, (8, 32, 32, 32)).astype(np.float32)
        small = rng.uniform(-1, 1, (4, 8, 8, 32)).astype(np.float32)
        c = np.ones(32, np.float32)
        for i in range(3000):
            x = big if i % 3 else small
            raw_ops.FusedBatchNormV3(x=x, scale=c, offset=c, mean=c, variance=c)
        print("OK")
    """, timeout=300)
    assert_clean_exit(proc, "OK")


def test_python_threads_calling_at_once_match_serial():
    proc = run_isolated("""
        import threading
        rng = np.random.RandomState(0)
        xs = [rng.uniform(-1, 1, s).astype(np.float32)
              for s in [(4, 32, 32, 16), (2, 16, 16, 8), (8, 8, 8, 64), (1, 64, 64, 4)]]
        def run(x):
            c = np.linspace(0.5, 2, x.shape[-1]).astype(np.float32)
            out = raw_ops.FusedBatchNormV3(x=x, scale=c, offset=c, mean=c, variance=c)
            g = raw_ops.FusedBatchNormGradV3(y_backprop=x, x=x, scale=c, reserve_space_1=out[3],
                                             reserve_space_2=out[4], reserve_space_3=out[5])
            m = nn.moments(x, axes=[0, 1])
            return [np.asarray(a).tobytes() for a in list(out) + list(g) + list(m)]
        fbn.set_num_threads(1)
        want = [run(x) for x in xs]
        bad = []
        def worker(t):
            for k in range(40):
                i = (t + k) % len(xs)
                if run(xs[i]) != want[i]:
                    bad.append((t, k))
        def churn(stop):
            k = 0
            while not stop.is_set():
                fbn.set_num_threads([1, 2, 4, 8, 0][k % 5]); k += 1
        stop = threading.Event()
        ch = threading.Thread(target=churn, args=(stop,))
        ch.start()
        ts = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
        for t in ts: t.start()
        for t in ts: t.join()
        stop.set(); ch.join()
        fbn.set_num_threads(0)
        print("mismatches", len(bad))
        print("OK")
    """, timeout=300)
    assert_clean_exit(proc, "mismatches 0")
