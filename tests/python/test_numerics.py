"""Numerical accuracy and determinism of fbn's fused ops, against a float64 NumPy reference.

Criteria:
- float32 outputs: element-wise with a floor, |fbn - ref64| <= 1e-5 · (|ref64| + floor), where the
  floor is the magnitude of the quantity before cancellation (bn_reference: y_floor, dx_floor,
  stat_scales, grad_scales), so near-zero results are judged against what was summed.
- 16-bit outputs (y, x_backprop): |fbn16 - round16(ref32)| <= 1 ulp of the 16-bit type at the
  larger of the two magnitudes, plus 8·eps32·floor, the float32 rounding of the terms (it only
  matters for results that are near zero by cancellation). ref32 is the float64 reference rounded
  to float32; the inputs are the same 16-bit values, upcast.
- Gradients of the fused op: the gradient ops against central finite differences of the forward
  op, all in float64 (x, scale, offset; training and inference).
- Threads: outputs are bit-identical for 1, 2 and 3 threads.
"""
import numpy as np
import pytest

import fbn
import bn_reference as ref
from bn_reference import COUNTS, EPS32, F64

SHAPES = {
    "NHWC": [(2, 3, 4, 5), (4, 9, 11, 31), (16, 64, 64, 3), (1, 1, 1, 19)],
    "NCHW": [(2, 5, 4, 3), (4, 31, 9, 11), (16, 3, 64, 64), (1, 19, 1, 1)],
    "NDHWC": [(2, 3, 4, 5, 6), (3, 5, 7, 9, 17)],
    "NCDHW": [(2, 6, 3, 4, 5), (3, 17, 5, 7, 9)],
}
CASES = [pytest.param(fmt, shape, id=f"{fmt}-{'x'.join(map(str, shape))}")
         for fmt, shapes in SHAPES.items() for shape in shapes]
EPS = 1e-3


def _inputs(shape, fmt, seed, x_dtype=np.float32, loc=0.5, spread=2.0):
    rng = np.random.default_rng(seed)
    c = ref.num_channels(shape, fmt)
    x = (rng.standard_normal(shape) * spread + loc).astype(x_dtype)
    dy = rng.standard_normal(shape).astype(x_dtype)
    scale = rng.uniform(0.5, 2.0, c).astype(np.float32) * rng.choice([-1, 1], c).astype(np.float32)
    offset = rng.standard_normal(c).astype(np.float32)
    mean = (rng.standard_normal(c) + loc).astype(np.float32)
    var = rng.uniform(0.5, 4.0, c).astype(np.float32)
    return x, dy, scale, offset, mean, var


def _forward(x, scale, offset, mean, var, fmt, is_training, factor=1.0):
    return fbn.raw_ops.FusedBatchNormV3(x=x, scale=scale, offset=offset, mean=mean, variance=var,
                                        epsilon=EPS, exponential_avg_factor=factor,
                                        data_format=fmt, is_training=is_training)


def _grad(dy, x, scale, rs1, rs2, fmt, is_training):
    return fbn.raw_ops.FusedBatchNormGradV3(
        y_backprop=dy, x=x, scale=scale, reserve_space_1=rs1, reserve_space_2=rs2,
        reserve_space_3=np.zeros(0, rs1.dtype), epsilon=EPS, data_format=fmt,
        is_training=is_training)


def _check_forward_stats(out, want, floors, is_training, rtol=1e-5):
    names = ["batch_mean", "batch_variance"]
    if is_training:
        names += ["reserve_space_1", "reserve_space_2"]
    for name in names:
        ref.check_close(getattr(out, name), want[name], rtol, floors[name], what=name)


# ----------------------------------------------------------------------------------------------
# float32 against float64
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("factor", [1.0, 0.6])
@pytest.mark.parametrize("is_training", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("fmt,shape", CASES)
def test_forward_float32_accuracy(fmt, shape, is_training, factor):
    x, _, scale, offset, mean, var = _inputs(shape, fmt, 1)
    out = _forward(x, scale, offset, mean, var, fmt, is_training, factor)
    want = ref.forward_ref(x, scale, offset, mean, var, EPS, factor, fmt, is_training)
    ref.check_close(out.y, want["y"], 1e-5,
                    ref.y_floor(x, scale, offset, mean, var, EPS, fmt, is_training), what="y")
    _check_forward_stats(out, want, ref.stat_scales(x, mean, var, factor, fmt, is_training),
                         is_training)
    COUNTS["numerics: float32 forward cases vs float64"] += 1


@pytest.mark.parametrize("is_training", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("fmt,shape", CASES)
def test_grad_float32_accuracy(fmt, shape, is_training):
    x, dy, scale, _, mean, var = _inputs(shape, fmt, 2)
    if is_training:
        xh = ref.to_nhwc(x.astype(np.float64), fmt)
        axes = tuple(range(xh.ndim - 1))
        mean = xh.mean(axis=axes).astype(np.float32)
        var = xh.var(axis=axes).astype(np.float32)
    out = _grad(dy, x, scale, mean, var, fmt, is_training)
    gx, gs, go = ref.grad_ref(dy, x, scale, mean, var, EPS, fmt, is_training)
    floors = ref.grad_scales(dy, x, mean, var, EPS, fmt)
    ref.check_close(out.x_backprop, gx, 1e-5,
                    ref.dx_floor(dy, x, scale, mean, var, EPS, fmt, is_training),
                    what="x_backprop")
    ref.check_close(out.scale_backprop, gs, 1e-5, floors["scale_backprop"], what="scale_backprop")
    ref.check_close(out.offset_backprop, go, 1e-5, floors["offset_backprop"],
                    what="offset_backprop")
    COUNTS["numerics: float32 gradient cases vs float64"] += 1


# ----------------------------------------------------------------------------------------------
# 16-bit: one rounding of the float32 result
# ----------------------------------------------------------------------------------------------
def _check_one_rounding(actual16, ref64, floor, dtype, what):
    dtype = np.dtype(dtype)
    ref16 = ref64.astype(np.float32).astype(dtype)
    assert actual16.dtype == dtype, what
    a = actual16.astype(np.float64)
    r = ref16.astype(np.float64)
    allowed = ref.ulp(np.maximum(np.abs(a), np.abs(r)), dtype) + 8 * EPS32 * np.broadcast_to(
        floor, a.shape)
    diff = np.abs(a - r)
    bad = diff > allowed
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {a.size} elements more than one "
                           f"{dtype} rounding away; worst |diff| {diff.max():.3g}")


@pytest.mark.parametrize("dname", ["float16", "bfloat16"])
@pytest.mark.parametrize("is_training", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("fmt,shape", CASES)
def test_forward_16bit_one_rounding(fmt, shape, is_training, dname):
    dtype = ref.DTYPES[dname]
    x, _, scale, offset, mean, var = _inputs(shape, fmt, 3, x_dtype=dtype)
    out = _forward(x, scale, offset, mean, var, fmt, is_training, 0.6)
    want = ref.forward_ref(x, scale, offset, mean, var, EPS, 0.6, fmt, is_training)
    floor = ref.y_floor(x, scale, offset, mean, var, EPS, fmt, is_training)
    _check_one_rounding(out.y, want["y"], floor, dtype, "y")
    _check_forward_stats(out, want, ref.stat_scales(x, mean, var, 0.6, fmt, is_training),
                         is_training)
    COUNTS["numerics: 16-bit forward cases (one rounding)"] += 1


@pytest.mark.parametrize("dname", ["float16", "bfloat16"])
@pytest.mark.parametrize("is_training", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("fmt,shape", CASES)
def test_grad_16bit_one_rounding(fmt, shape, is_training, dname):
    dtype = ref.DTYPES[dname]
    x, dy, scale, _, mean, var = _inputs(shape, fmt, 4, x_dtype=dtype)
    out = _grad(dy, x, scale, mean, var, fmt, is_training)
    gx, gs, go = ref.grad_ref(dy, x, scale, mean, var, EPS, fmt, is_training)
    _check_one_rounding(out.x_backprop, gx,
                        ref.dx_floor(dy, x, scale, mean, var, EPS, fmt, is_training), dtype,
                        "x_backprop")
    floors = ref.grad_scales(dy, x, mean, var, EPS, fmt)
    ref.check_close(out.scale_backprop, gs, 1e-5, floors["scale_backprop"], what="scale_backprop")
    ref.check_close(out.offset_backprop, go, 1e-5, floors["offset_backprop"],
                    what="offset_backprop")
    COUNTS["numerics: 16-bit gradient cases (one rounding)"] += 1


# ----------------------------------------------------------------------------------------------
# Large offsets and constant channels
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,shape", [("NHWC", (8, 16, 16, 8)), ("NCHW", (8, 8, 16, 16)),
                                       ("NHWC", (1, 1, 100000, 3)),
                                       ("NCDHW", (2, 5, 8, 8, 8))])
def test_large_offset_keeps_accuracy(fmt, shape):
    """x ~ N(1e4, 1): no cancellation, the variance's relative error stays <= 1e-5."""
    rng = np.random.default_rng(5)
    c = ref.num_channels(shape, fmt)
    x = (rng.standard_normal(shape) + 1e4).astype(np.float32)
    scale = rng.uniform(0.5, 2.0, c).astype(np.float32)
    offset = rng.standard_normal(c).astype(np.float32)
    empty = np.zeros(0, np.float32)
    out = _forward(x, scale, offset, empty, empty, fmt, True)
    want = ref.forward_ref(x, scale, offset, empty, empty, EPS, 1.0, fmt, True)
    for name in ("batch_variance", "reserve_space_2", "batch_mean", "reserve_space_1"):
        ref.check_close(getattr(out, name), want[name], 1e-5, 0.0, what=name)
    # y is (x - m)·a + offset with m the float32 batch mean (reserve_space_1), as in TF: m carries
    # up to half an ulp of 1e4, so y is checked against the reference built on that m.
    xh = ref.to_nhwc(x.astype(np.float64), fmt)
    v = want["reserve_space_2"]
    m32 = out.reserve_space_1.astype(np.float64)
    y_ref = ref.from_nhwc((xh - m32) * scale / np.sqrt(v + float(np.float32(EPS))) + offset, fmt)
    ref.check_close(out.y, y_ref, 1e-5,
                    ref.y_floor(x - np.float32(1e4), scale, offset, None, None, EPS, fmt, True),
                    what="y")
    COUNTS["numerics: large-offset cases"] += 1


@pytest.mark.parametrize("value", [1e3, 1e5, 1e7, -3.25e6])
@pytest.mark.parametrize("fmt", ["NHWC", "NCHW"])
def test_constant_channel_gives_offset(value, fmt):
    """A constant channel: mean == the constant, variance 0 up to rounding (far below eps), so
    x - mean is 0 and y == offset exactly (user-needs §3: not ±1, not NaN)."""
    shape = (4, 6, 5, 3) if fmt == "NHWC" else (4, 3, 6, 5)
    x = np.full(shape, value, np.float32)
    scale = np.array([1.5, -2.0, 0.25], np.float32)
    offset = np.array([0.5, -1.0, 3.0], np.float32)
    empty = np.zeros(0, np.float32)
    out = _forward(x, scale, offset, empty, empty, fmt, True)
    assert np.array_equal(out.y, np.broadcast_to(ref.channel_scale(offset, shape, fmt), shape))
    assert np.array_equal(out.batch_mean, np.full(3, value, np.float32))
    for name in ("batch_variance", "reserve_space_2"):
        v = getattr(out, name)
        assert (v >= 0).all() and (v <= 1e-7).all(), f"{name} = {v}"
    COUNTS["numerics: constant-channel cases"] += 1


# ----------------------------------------------------------------------------------------------
# Gradients against central finite differences, float64
# ----------------------------------------------------------------------------------------------
FD_CASES = [("NHWC", (2, 3, 2, 4)), ("NCHW", (2, 4, 3, 2)), ("NDHWC", (2, 2, 2, 3, 3)),
            ("NCDHW", (2, 3, 2, 3, 2))]


@pytest.mark.parametrize("is_training", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("fmt,shape", FD_CASES)
def test_gradients_match_finite_differences(fmt, shape, is_training):
    """d/d(x, scale, offset) of L = sum(w · y) from FusedBatchNormGradV3 (dy = w, and the
    forward's reserve spaces in training or the population statistics in inference) against
    central differences of FusedBatchNormV3, in float64."""
    rng = np.random.default_rng(6)
    c = ref.num_channels(shape, fmt)
    x = rng.standard_normal(shape) * 1.5 + 0.3
    w = rng.standard_normal(shape)  # non-uniform upstream gradient
    scale = rng.uniform(0.5, 2.0, c) * rng.choice([-1.0, 1.0], c)
    offset = rng.standard_normal(c)
    mean = rng.standard_normal(c)
    var = rng.uniform(0.5, 2.0, c)

    def loss(xv, sv, ov):
        y = _forward(xv, sv, ov, mean, var, fmt, is_training).y
        assert y.dtype == F64
        return float(np.sum(w * y))

    fwd = _forward(x, scale, offset, mean, var, fmt, is_training)
    rs1, rs2 = (fwd.reserve_space_1, fwd.reserve_space_2) if is_training else (mean, var)
    grads = _grad(w, x, scale, rs1, rs2, fmt, is_training)

    def numeric(index):
        args = [x, scale, offset]
        base = args[index]
        g = np.zeros(base.shape)
        for i in np.ndindex(base.shape):
            h = 1e-6 * max(1.0, abs(base[i]))
            plus, minus = base.copy(), base.copy()
            plus[i] += h
            minus[i] -= h
            args_p = list(args)
            args_m = list(args)
            args_p[index], args_m[index] = plus, minus
            g[i] = (loss(*args_p) - loss(*args_m)) / (plus[i] - minus[i])
        return g

    for index, (name, analytic) in enumerate(zip(("x", "scale", "offset"), grads[:3])):
        ref.check_close(analytic, numeric(index), 1e-7, float(np.abs(analytic).max()) + 1e-12,
                        what=f"d L / d {name}")
    COUNTS["numerics: finite-difference gradient cases"] += 1


@pytest.mark.parametrize("is_training", [True, False], ids=["train", "infer"])
def test_gradient_is_linear_in_y_backprop(is_training):
    """grad(a·g1 + b·g2) == a·grad(g1) + b·grad(g2): an all-ones upstream gradient would hide
    bugs (its x_backprop is zero in training), so linearity is checked with random ones."""
    rng = np.random.default_rng(7)
    shape, fmt = (3, 4, 5, 6), "NHWC"
    x = rng.standard_normal(shape)
    g1, g2 = rng.standard_normal(shape), rng.standard_normal(shape)
    scale, m, v = rng.standard_normal(6), rng.standard_normal(6), rng.uniform(0.5, 2, 6)
    a, b = 1.75, -0.5
    combo = _grad(a * g1 + b * g2, x, scale, m, v, fmt, is_training)
    parts = [_grad(g, x, scale, m, v, fmt, is_training) for g in (g1, g2)]
    for k in range(3):
        expected = a * parts[0][k] + b * parts[1][k]
        ref.check_close(combo[k], expected, 1e-12, float(np.abs(expected).max()), what=str(k))
    ones = _grad(np.ones(shape), x, scale, x.mean(axis=(0, 1, 2)), x.var(axis=(0, 1, 2)), fmt,
                 True)
    assert np.abs(ones.x_backprop).max() < 1e-12
    COUNTS["numerics: linearity cases"] += 1


# ----------------------------------------------------------------------------------------------
# Determinism across thread counts
# ----------------------------------------------------------------------------------------------
THREAD_CASES = [("NHWC", (4, 56, 56, 64), "float32"), ("NCHW", (8, 64, 28, 28), "float32"),
                ("NHWC", (1, 1, 100000, 3), "float32"), ("NCHW", (4, 64, 28, 28), "bfloat16")]


def _bits(outputs):
    return [np.ascontiguousarray(o).view(np.uint8).tobytes() for o in outputs]


@pytest.mark.parametrize("fmt,shape,dname", THREAD_CASES,
                         ids=[f"{f}-{'x'.join(map(str, s))}-{d}" for f, s, d in THREAD_CASES])
def test_results_bit_identical_across_threads(fmt, shape, dname):
    dtype = ref.DTYPES[dname]
    x, dy, scale, offset, mean, var = _inputs(shape, fmt, 8, x_dtype=dtype)
    empty = np.zeros(0, np.float32)
    results = {}
    for threads in (1, 2, 3, 2):
        fbn.set_num_threads(threads)
        assert fbn.get_num_threads() == threads
        fwd = _forward(x, scale, offset, empty, empty, fmt, True)
        g_train = _grad(dy, x, scale, fwd.reserve_space_1, fwd.reserve_space_2, fmt, True)
        g_infer = _grad(dy, x, scale, mean, var, fmt, False)
        bits = _bits(fwd[:5]) + _bits(g_train[:3]) + _bits(g_infer[:3])
        if threads in results:  # a repeated run with the same count
            assert bits == results[threads], f"{threads} threads: repeated run differs"
        results[threads] = bits
    names = ["y", "batch_mean", "batch_variance", "reserve_space_1", "reserve_space_2",
             "train x_backprop", "train scale_backprop", "train offset_backprop",
             "infer x_backprop", "infer scale_backprop", "infer offset_backprop"]
    for threads in (2, 3):
        for name, b1, bt in zip(names, results[1], results[threads]):
            assert b1 == bt, f"{name} differs between 1 and {threads} threads"
    COUNTS["numerics: thread-determinism cases"] += 1
