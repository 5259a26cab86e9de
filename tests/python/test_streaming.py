"""Outputs larger than the cache are written with streaming (non-temporal) stores: the results
must be the same as for cache-resident outputs. Every element type and layout, training and
inference forward, both gradients, on a tensor above the 16 MB streaming threshold."""
import ml_dtypes
import numpy as np
import pytest

import fbn

# One 4-byte and one 2-byte type: the store paths differ by width (float16 streams like bfloat16,
# double like float).
DTYPES = [np.float32, ml_dtypes.bfloat16]


def _ref_forward(x, scale, offset, mean, var, eps, axis):
    shape = [1] * x.ndim
    shape[axis] = -1
    r = lambda v: v.astype(np.float64).reshape(shape)
    return (x.astype(np.float64) - r(mean)) / np.sqrt(r(var) + eps) * r(scale) + r(offset)


# 64 channels: one strip of a row; 256: rows that Zen 4 streams in row order (float).
@pytest.mark.parametrize("c", [64, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fmt", ["NHWC", "NCHW"])
def test_large_outputs_match_reference(dtype, fmt, c):
    rng = np.random.default_rng(7)
    # Just above the 16 MB streaming threshold for the element type.
    n = 16 * 1024 * 1024 // (np.dtype(dtype).itemsize * 256 * 256 * c) + 1
    shape = (n, 256, 256, c) if fmt == "NHWC" else (n, c, 256, 256)
    axis = 3 if fmt == "NHWC" else 1
    red = tuple(i for i in range(4) if i != axis)
    x = rng.normal(2.0, 3.0, shape).astype(dtype)
    dy = rng.normal(0.0, 1.0, shape).astype(dtype)
    scale = rng.uniform(0.5, 1.5, c).astype(np.float64 if dtype == np.float64 else np.float32)
    offset = rng.normal(size=c).astype(scale.dtype)
    mean, var = x.astype(np.float64).mean(red), x.astype(np.float64).var(red)
    e = np.zeros(0, scale.dtype)
    tol = {np.float64: 1e-9, np.float32: 2e-5}.get(dtype, 2e-2)

    out = fbn.raw_ops.FusedBatchNormV3(x=x, scale=scale, offset=offset, mean=e, variance=e,
                                       epsilon=1e-3, data_format=fmt)
    ref = _ref_forward(x, scale, offset, mean, var, 1e-3, axis)
    np.testing.assert_allclose(out.y.astype(np.float64), ref, atol=tol * 8, rtol=tol)

    inf = fbn.raw_ops.FusedBatchNormV3(x=x, scale=scale, offset=offset,
                                       mean=mean.astype(scale.dtype), variance=var.astype(scale.dtype),
                                       epsilon=1e-3, data_format=fmt, is_training=False)
    np.testing.assert_allclose(inf.y.astype(np.float64), ref, atol=tol * 8, rtol=tol)

    for training in (True, False):
        g = fbn.raw_ops.FusedBatchNormGradV3(
            y_backprop=dy, x=x, scale=scale, reserve_space_1=mean.astype(scale.dtype),
            reserve_space_2=var.astype(scale.dtype), reserve_space_3=e, epsilon=1e-3,
            data_format=fmt, is_training=training)
        shape_c = [1] * 4
        shape_c[axis] = -1
        inv = (1.0 / np.sqrt(var + 1e-3)).reshape(shape_c)
        d64 = dy.astype(np.float64)
        if training:
            xc = x.astype(np.float64) - mean.reshape(shape_c)
            n = x.size // c
            dx = scale.reshape(shape_c) * inv * (
                d64 - d64.sum(red).reshape(shape_c) / n
                - xc * inv**2 * (d64 * xc).sum(red).reshape(shape_c) / n)
        else:
            dx = d64 * scale.reshape(shape_c) * inv
        np.testing.assert_allclose(g.x_backprop.astype(np.float64), dx, atol=tol * 8, rtol=tol)
