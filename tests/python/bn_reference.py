"""NumPy references and comparison helpers shared by the fbn Python test suites.

Everything here is independent of fbn and of TensorFlow: the formulas are those of TensorFlow's
CPU kernels (shared/spec/tf-semantics.md §4-5) and of TensorFlow's own tests (tf-tests.md A, D),
evaluated in float64 unless stated otherwise.
"""
import collections
import math
import os

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)
DTYPES = {"float16": F16, "bfloat16": BF16, "float32": F32, "float64": F64}
EPS32 = float(np.finfo(np.float32).eps)

_TF = {}


def import_tensorflow():
    """TensorFlow with its Eigen CPU kernels (the reference semantics), imported once; None if it
    cannot be imported. oneDNN kernels are switched off: their messages and shapes differ."""
    if "module" not in _TF:
        os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        try:
            import tensorflow as tf  # pylint: disable=import-outside-toplevel
            _TF["module"], _TF["error"] = tf, None
        except Exception as e:  # noqa: BLE001 - any import failure means "no reference"
            _TF["module"], _TF["error"] = None, e
    return _TF["module"]


def tensorflow_import_error():
    return _TF.get("error")


# Tallies printed at the end of the run (cases compared with TF, error cases, ...).
COUNTS = collections.Counter()

FORMATS_4D = ("NHWC", "NCHW")
FORMATS_5D = ("NDHWC", "NCDHW")
FORMATS = FORMATS_4D + FORMATS_5D


# ----------------------------------------------------------------------------------------------
# Layouts
# ----------------------------------------------------------------------------------------------
def channels_last(data_format):
    if data_format not in FORMATS:
        raise ValueError(f"unknown data_format {data_format!r}")
    return data_format in ("NHWC", "NDHWC")


def channel_axis(data_format, rank):
    return rank - 1 if channels_last(data_format) else 1


def num_channels(shape, data_format):
    return shape[channel_axis(data_format, len(shape))]


def to_nhwc(x, data_format):
    """Moves the channel axis last (what TF's reference and CPU kernel do for NCHW/NCDHW)."""
    if channels_last(data_format):
        return x
    return np.moveaxis(x, 1, -1)


def from_nhwc(x, data_format):
    if channels_last(data_format):
        return x
    return np.moveaxis(x, -1, 1)


def convert_format(x, src, dst):
    return from_nhwc(to_nhwc(x, src), dst)


def reshape_5d_to_4d(shape, data_format):
    """The 4-D view TF's kernels use for 5-D x: [N, D, H*W, C] or [N, C, D, H*W]."""
    n, a, b, c, d = shape
    return (n, a, b, c * d) if not channels_last(data_format) else (n, a, b * c, d)


def nhwc_format(data_format):
    """The channels-last format of the same rank (TF's inference-gradient transposes)."""
    return "NDHWC" if data_format in FORMATS_5D else "NHWC"


# ----------------------------------------------------------------------------------------------
# Dtypes, rounding, ulps
# ----------------------------------------------------------------------------------------------
def finfo(dtype):
    dtype = np.dtype(dtype)
    return ml_dtypes.finfo(dtype) if dtype == BF16 else np.finfo(dtype)


def ulp(values, dtype):
    """Spacing of `dtype` at |values| (subnormal spacing below the smallest normal)."""
    fi = finfo(dtype)
    a = np.abs(np.asarray(values, np.float64))
    tiny = float(fi.smallest_normal)
    exp = np.floor(np.log2(np.maximum(a, tiny)))
    return np.exp2(exp - fi.nmant)


def is16(dtype):
    return np.dtype(dtype) in (F16, BF16)


def stats_dtype(x_dtype):
    """TF's U for a given T: float for 16-bit and float x; double for fbn's float64 extension."""
    return F64 if np.dtype(x_dtype) == F64 else F32


def f64(a):
    return np.asarray(a).astype(np.float64)


# ----------------------------------------------------------------------------------------------
# Float64 references of the kernels (tf-semantics.md §4.4, §4.5, §5.3, §5.4)
# ----------------------------------------------------------------------------------------------
def forward_ref(x, scale, offset, mean, variance, epsilon, factor, data_format, is_training):
    """Returns dict(y, batch_mean, batch_variance, reserve_space_1, reserve_space_2) in float64.

    `epsilon` is used as the float32 value the op attr holds. Inference reserve spaces are not
    defined by TF and are left out.
    """
    eps = float(np.float32(epsilon))
    xh = f64(to_nhwc(np.asarray(x), data_format))
    c = xh.shape[-1]
    axes = tuple(range(xh.ndim - 1))
    scale, offset = f64(scale), f64(offset)
    if xh.size == 0:
        nan = np.full(c, np.nan)
        return {"y": from_nhwc(xh.copy(), data_format), "batch_mean": nan, "batch_variance": nan}
    if is_training:
        n = xh.size // c
        m = xh.mean(axis=axes)
        v = ((xh - m) ** 2).mean(axis=axes)
        y = (xh - m) / np.sqrt(v + eps) * scale + offset
        unbiased = v * n / max(n - 1, 1)
        f = float(np.float32(factor))
        if f != 1.0:
            bm = (1.0 - f) * f64(mean) + f * m
            bv = (1.0 - f) * f64(variance) + f * unbiased
        else:
            bm, bv = m, unbiased
        return {"y": from_nhwc(y, data_format), "batch_mean": bm, "batch_variance": bv,
                "reserve_space_1": m, "reserve_space_2": v}
    m, v = f64(mean), f64(variance)
    y = (xh - m) / np.sqrt(v + eps) * scale + offset
    return {"y": from_nhwc(y, data_format), "batch_mean": m.copy(), "batch_variance": v.copy()}


def grad_ref(dy, x, scale, saved_mean, saved_var, epsilon, data_format, is_training):
    """FusedBatchNormGrad's outputs (x_backprop, scale_backprop, offset_backprop) in float64.

    Training uses the saved (biased) batch statistics it is given, as TF's CPU kernel does;
    inference uses the population statistics and does not depend on x through the statistics.
    """
    eps = float(np.float32(epsilon))
    dyh = f64(to_nhwc(np.asarray(dy), data_format))
    xh = f64(to_nhwc(np.asarray(x), data_format))
    c = xh.shape[-1]
    if xh.size == 0:
        return from_nhwc(dyh.copy(), data_format), np.zeros(c), np.zeros(c)
    axes = tuple(range(xh.ndim - 1))
    m, v, s = f64(saved_mean), f64(saved_var), f64(scale)
    inv = 1.0 / np.sqrt(v + eps)
    xc = xh - m
    offset_bp = dyh.sum(axis=axes)
    scale_bp = (dyh * xc).sum(axis=axes) * inv
    if is_training:
        mean_dy = dyh.mean(axis=axes)
        mean_dy_xc = (dyh * xc).mean(axis=axes)
        dx = s * inv * ((dyh - mean_dy) - xc * inv * inv * mean_dy_xc)
    else:
        dx = dyh * s * inv
    return from_nhwc(dx, data_format), scale_bp, offset_bp


def grad_scales(dy, x, saved_mean, saved_var, epsilon, data_format):
    """Per-output magnitudes (no cancellation) used as floors when comparing grads."""
    eps = float(np.float32(epsilon))
    dyh = f64(to_nhwc(np.asarray(dy), data_format))
    xh = f64(to_nhwc(np.asarray(x), data_format))
    axes = tuple(range(xh.ndim - 1))
    inv = 1.0 / np.sqrt(f64(saved_var) + eps)
    return {"scale_backprop": (np.abs(dyh) * np.abs(xh - f64(saved_mean))).sum(axis=axes) * inv,
            "offset_backprop": np.abs(dyh).sum(axis=axes)}


def y_floor(x, scale, offset, mean, variance, epsilon, data_format, is_training):
    """Per-channel magnitude of y = x·a + (offset - m·a) without cancellation, broadcast over x:
    |a|·(max|x| + |m|) + |offset|, with m, v the statistics the op normalizes with."""
    eps = float(np.float32(epsilon))
    xh = f64(to_nhwc(np.asarray(x), data_format))
    c = xh.shape[-1]
    if xh.size == 0:
        return 0.0
    axes = tuple(range(xh.ndim - 1))
    if is_training:
        m = xh.mean(axis=axes)
        v = ((xh - m) ** 2).mean(axis=axes)
    else:
        m, v = f64(mean), f64(variance)
    a = np.abs(f64(scale)) / np.sqrt(np.maximum(v, 0) + eps)
    floor = a * (np.abs(xh).max(axis=axes) + np.abs(m)) + np.abs(f64(offset))
    return channel_scale(floor.reshape(c), np.shape(x), data_format)


def dx_floor(dy, x, scale, saved_mean, saved_var, epsilon, data_format, is_training):
    """Per-channel magnitude of x_backprop's terms without cancellation, broadcast over x."""
    eps = float(np.float32(epsilon))
    dyh = f64(to_nhwc(np.asarray(dy), data_format))
    xh = f64(to_nhwc(np.asarray(x), data_format))
    if xh.size == 0:
        return 0.0
    axes = tuple(range(xh.ndim - 1))
    inv = 1.0 / np.sqrt(f64(saved_var) + eps)
    k = np.abs(f64(scale)) * inv
    ady = np.abs(dyh).max(axis=axes)
    if is_training:
        axc = np.abs(xh - f64(saved_mean))
        floor = k * (2 * ady + axc.max(axis=axes) * inv * inv * (np.abs(dyh) * axc).mean(axis=axes))
    else:
        floor = k * ady
    return channel_scale(floor, np.shape(x), data_format)


def stat_scales(x, mean, variance, factor, data_format, is_training):
    """Per-channel magnitudes of the statistics outputs: |mean| + std (plus the blended-in old
    values), and the variance itself."""
    xh = f64(to_nhwc(np.asarray(x), data_format))
    c = xh.shape[-1]
    if xh.size == 0 or not is_training:
        mm = np.abs(f64(mean)) if np.size(mean) == c else np.zeros(c)
        vv = np.abs(f64(variance)) if np.size(variance) == c else np.zeros(c)
        return {"batch_mean": mm, "batch_variance": vv, "reserve_space_1": mm,
                "reserve_space_2": vv}
    axes = tuple(range(xh.ndim - 1))
    m = xh.mean(axis=axes)
    v = ((xh - m) ** 2).mean(axis=axes)
    ms = np.abs(xh).mean(axis=axes) + np.sqrt(v)
    n = xh.size // c
    vs = v * n / max(n - 1, 1)
    if float(np.float32(factor)) != 1.0:
        ms = ms + np.abs(f64(mean))
        vs = vs + np.abs(f64(variance))
    return {"batch_mean": ms, "batch_variance": vs, "reserve_space_1": ms, "reserve_space_2": v}


# ----------------------------------------------------------------------------------------------
# TensorFlow's test references (nn_fused_batchnorm_test.py, compiler/tests/fused_batchnorm_test.py)
# ----------------------------------------------------------------------------------------------
def tf_batch_norm(x, mean, var, offset, scale, epsilon):
    """nn_fused_batchnorm_test._batch_norm: computed in scale's dtype (float32), cast to x's."""
    x = np.asarray(x)
    u = np.asarray(scale).dtype
    inv = (1.0 / np.sqrt(np.asarray(var, u) + u.type(epsilon))).astype(u) * scale
    y = x.astype(u) * inv + (offset - np.asarray(mean, u) * inv)
    return y.astype(x.dtype)


def tf_inference_ref(x, scale, offset, mean, var, epsilon, data_format):
    y = tf_batch_norm(to_nhwc(x, data_format), mean, var, offset, scale, epsilon)
    return from_nhwc(y, data_format)


def tf_training_ref(x, scale, offset, old_mean, old_var, factor, epsilon, data_format):
    """nn_fused_batchnorm_test._training_ref: moments (biased) for y, Bessel for the running var."""
    xh = to_nhwc(np.asarray(x), data_format)
    axes = tuple(range(xh.ndim - 1))
    x64 = xh.astype(np.float64)
    if x64.size == 0:  # tf.nn.moments of an empty batch: 0/0
        batch_mean = batch_var = np.full(xh.shape[-1], np.nan)
    else:
        batch_mean = x64.mean(axis=axes)
        batch_var = ((x64 - batch_mean) ** 2).mean(axis=axes)
    u = np.asarray(scale).dtype
    y = tf_batch_norm(xh, batch_mean.astype(u), batch_var.astype(u), offset, scale, epsilon)
    n = xh.size / np.size(scale)
    corrected = batch_var * n / max(n - 1.0, 1.0)
    if factor == 1.0:
        mean, var = batch_mean, corrected
    else:
        mean = (1.0 - factor) * old_mean + factor * batch_mean
        var = (1.0 - factor) * old_var + factor * corrected
    return from_nhwc(y, data_format), mean, var


def xla_reference_training(x, scale, offset, old_mean, old_var, epsilon, factor):
    """compiler/tests/fused_batchnorm_test._reference_training (NHWC, E[x²]-mean² variance)."""
    x = f64(x)
    element_count = x.size / x.shape[-1]
    mean = x.sum(axis=(0, 1, 2)) / element_count
    var = (x * x).sum(axis=(0, 1, 2)) / element_count - mean * mean
    corrected_var = var * (element_count / max(element_count - 1, 1))
    normalized = (x - mean) / np.sqrt(var + epsilon)
    if factor != 1.0:
        mean = (1.0 - factor) * old_mean + factor * mean
        corrected_var = (1.0 - factor) * old_var + factor * corrected_var
    return normalized * scale + offset, mean, var, corrected_var


def xla_reference_grad(x, grad_y, scale, mean, var, epsilon):
    """compiler/tests/fused_batchnorm_test._reference_grad (NHWC)."""
    x, grad_y = f64(x), f64(grad_y)
    ax = (0, 1, 2)
    grad_x = scale * (grad_y - grad_y.mean(axis=ax)
                      - (x - mean) * (grad_y * (x - mean)).mean(axis=ax) / (var + epsilon)
                      ) / np.sqrt(var + epsilon)
    grad_scale = (grad_y * (x - mean) / np.sqrt(var + epsilon)).sum(axis=ax)
    grad_offset = grad_y.sum(axis=ax)
    return grad_x, grad_scale, grad_offset


def tf_python_batch_norm_grad(grad_y, x, scale, pop_mean, pop_var, epsilon, data_format,
                              is_training):
    """nn_grad._BatchNormGrad: TF's Python reference of the first-order gradient.

    16-bit x and grad_y are computed in float32 (as TF casts them); in training the statistics are
    recomputed from x (biased variance) instead of taken from the reserve spaces.
    """
    work = np.float32 if is16(np.asarray(x).dtype) or np.asarray(x).dtype == F32 else np.float64
    xh = to_nhwc(np.asarray(x), data_format).astype(work)
    gy = to_nhwc(np.asarray(grad_y), data_format).astype(work)
    axes = tuple(range(xh.ndim - 1))
    scale = np.asarray(scale).astype(work)
    if is_training:
        mean = xh.mean(axis=axes)
        var = ((xh - mean) ** 2).mean(axis=axes)
        inv = (1.0 / np.sqrt(var + work(epsilon))).astype(work)
        gmean = gy.mean(axis=axes)
        xc = xh - mean
        gx = scale * inv * (gy - gmean - xc * (gy * xc).mean(axis=axes) / (var + work(epsilon)))
        gs = inv * (gy * xc).sum(axis=axes)
        go = gy.sum(axis=axes)
    else:
        inv = (1.0 / np.sqrt(np.asarray(pop_var, work) + work(epsilon))).astype(work)
        go = gy.sum(axis=axes)
        gs = (gy * (xh - np.asarray(pop_mean, work)) * inv).sum(axis=axes)
        gx = gy * scale * inv
    return from_nhwc(gx, data_format).astype(np.asarray(x).dtype), gs, go


# ----------------------------------------------------------------------------------------------
# Comparison
# ----------------------------------------------------------------------------------------------
def tf_rtol(n):
    """Relative tolerance for float32 results of fbn against TensorFlow's Eigen CPU kernel.

    TF accumulates the per-channel sums in float32 (sequentially for channels-last), so its own
    error grows like eps32·sqrt(n) (n = elements per channel); fbn accumulates more precisely.
    """
    return 4e-6 + 8 * EPS32 * math.sqrt(max(n, 1))


def check_close(actual, expected, rtol, scale=None, dtype=None, what="", atol=0.0):
    """Element-wise check with a floor: |a - e| <= rtol * (|e| + scale) + atol [+ 1 ulp16].

    `scale` (scalar or broadcastable, default max|e|) is the magnitude of the quantity without
    cancellation, so results that are near zero by cancellation are judged against the size of
    what was summed. For a 16-bit `dtype` one ulp of that type at max(|a|, |e|) is added: both
    sides may round the same float32 value to neighbouring 16-bit numbers. NaNs must coincide.
    """
    a = f64(actual)
    e = f64(expected)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    nan_a, nan_e = np.isnan(a), np.isnan(e)
    assert np.array_equal(nan_a, nan_e), f"{what}: NaN positions differ"
    if a.size == 0:
        return
    if scale is None:
        finite = e[~nan_e]
        scale = float(np.max(np.abs(finite))) if finite.size else 0.0
    scale = np.broadcast_to(f64(scale), e.shape)
    allowed = rtol * (np.abs(e) + scale) + atol
    if dtype is not None and is16(dtype):
        allowed = allowed + ulp(np.maximum(np.abs(a), np.abs(e)), dtype)
    diff = np.abs(a - e)
    bad = (diff > allowed) & ~nan_e
    if bad.any():
        i = np.unravel_index(np.argmax(np.where(bad, diff - allowed, -np.inf)), e.shape)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {e.size} elements out of tolerance; worst at {i}: "
            f"actual {a[i]!r} expected {e[i]!r} |diff| {diff[i]:.3g} allowed {allowed[i]:.3g}")


def channel_scale(scale_vec, shape, data_format):
    """Broadcasts a per-channel vector over an x-shaped tensor."""
    ax = channel_axis(data_format, len(shape))
    bshape = [1] * len(shape)
    bshape[ax] = shape[ax]
    return np.reshape(f64(scale_vec), bshape)


# ----------------------------------------------------------------------------------------------
# Jacobians (TF's gradient_checker, re-done with NumPy)
# ----------------------------------------------------------------------------------------------
def numeric_jacobian(f, x0, delta):
    """d f(x)/dx by central differences, shape (x.size, f.size), evaluated in x0's dtype."""
    x0 = np.array(x0)
    flat = x0.reshape(-1)
    cols = []
    for i in range(flat.size):
        xp = flat.copy()
        xm = flat.copy()
        xp[i] = xp[i] + flat.dtype.type(delta)
        xm[i] = xm[i] - flat.dtype.type(delta)
        yp = f64(f(xp.reshape(x0.shape))).reshape(-1)
        ym = f64(f(xm.reshape(x0.shape))).reshape(-1)
        # Divide by the perturbation actually applied after rounding to x's dtype.
        h = f64(xp[i]) - f64(xm[i])
        cols.append((yp - ym) / h)
    out_size = cols[0].size if cols else 0
    return np.array(cols).reshape(flat.size, out_size)


def theoretical_jacobian(vjp, in_size, out_shape, dtype):
    """Rows of the Jacobian from vector-Jacobian products with unit output vectors."""
    out_size = int(np.prod(out_shape))
    jac = np.zeros((in_size, out_size))
    for j in range(out_size):
        e = np.zeros(out_size)
        e[j] = 1.0
        jac[:, j] = f64(vjp(e.reshape(out_shape).astype(dtype))).reshape(-1)
    return jac


def unit_response(f, in_shape, dtype):
    """Matrix whose row i is f(e_i): the exact Jacobian of a function linear in its input."""
    size = int(np.prod(in_shape))
    rows = []
    for i in range(size):
        e = np.zeros(size)
        e[i] = 1.0
        rows.append(f64(f(e.reshape(in_shape).astype(dtype))).reshape(-1))
    return np.array(rows)
