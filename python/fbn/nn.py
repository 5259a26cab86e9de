"""``tf.compat.v1.nn``-compatible wrappers: fused_batch_norm, moments, batch_normalization."""
import numpy as np

from . import _fbn, raw_ops
from ._arrays import as_input, from_output

__all__ = ["fused_batch_norm", "moments", "batch_normalization"]


def fused_batch_norm(x, scale, offset, mean=None, variance=None, epsilon=0.001, data_format="NHWC",
                     is_training=True, name=None, exponential_avg_factor=1.0):
    """tf.compat.v1.nn.fused_batch_norm: FusedBatchNormV3, returning (y, running_mean, running_var).

    Default epsilon 0.001 (the op's is 0.0001), passed through unclamped as in current TensorFlow.
    mean and variance may be None only when training with exponential_avg_factor == 1.
    """
    del name
    if (not is_training or exponential_avg_factor != 1.0) and (mean is None or variance is None):
        raise ValueError(
            "Both `mean` and `variance` must be a 1D tensor when `is_training` is False or "
            "`exponential_avg_factor` != 1.0. "
            f"Received: `mean` {mean!r} and `variance` {variance!r}")
    empty = np.zeros((0,), np.float64 if np.asarray(x).dtype == np.float64 else np.float32)
    if mean is None:
        mean = empty
    if variance is None:
        variance = empty
    y, running_mean, running_var = raw_ops.FusedBatchNormV3(
        x=x, scale=scale, offset=offset, mean=mean, variance=variance, epsilon=epsilon,
        exponential_avg_factor=exponential_avg_factor, data_format=data_format,
        is_training=is_training)[:3]
    return y, running_mean, running_var


def moments(x, axes, shift=None, name=None, keep_dims=None, keepdims=None):
    """tf.compat.v1.nn.moments: (mean, biased variance) over ``axes``; shift is unused, as in TF."""
    del shift, name
    if keep_dims is not None and keepdims is not None:
        raise ValueError("Cannot specify both 'keep_dims' and 'keepdims'")
    keep = bool(keepdims if keepdims is not None else (keep_dims or False))
    xa, xt = as_input(x, "x")
    axes = [int(a) for a in (axes if isinstance(axes, (list, tuple, np.ndarray)) else [axes])]
    mean, variance = _fbn.moments(xa, xt, axes, keep)
    return from_output(mean, xt), from_output(variance, xt)


def batch_normalization(x, mean, variance, offset, scale, variance_epsilon, name=None):
    """tf.nn.batch_normalization: x * inv + (offset - mean * inv), inv = rsqrt(variance+eps)*scale."""
    del name
    xa, xt = as_input(x, "x")
    ma, mt = as_input(mean, "mean")
    va, vt = as_input(variance, "variance")
    oa, ot = (None, xt) if offset is None else as_input(offset, "offset")
    sa, st = (None, xt) if scale is None else as_input(scale, "scale")
    y = _fbn.batch_normalization(xa, xt, ma, mt, va, vt, oa, ot, sa, st, float(variance_epsilon))
    return from_output(y, xt)
