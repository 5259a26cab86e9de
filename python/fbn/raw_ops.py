"""``tf.raw_ops``-compatible entry points for the fused batch-norm ops.

Each op takes exactly TensorFlow's keyword arguments (keyword-only, ``name`` accepted and ignored)
and returns a named tuple in TensorFlow's output order, dtypes and shapes. Bad input raises
``fbn.errors.InvalidArgumentError`` with TensorFlow's message.
"""
import collections

import numpy as np

from . import _fbn
from ._arrays import as_input, from_output

__all__ = ["FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3", "FusedBatchNormGrad",
           "FusedBatchNormGradV2", "FusedBatchNormGradV3"]

_FORWARD_FIELDS = ["y", "batch_mean", "batch_variance", "reserve_space_1", "reserve_space_2"]
_FusedBatchNormOutput = {
    1: collections.namedtuple("FusedBatchNorm", _FORWARD_FIELDS),
    2: collections.namedtuple("FusedBatchNormV2", _FORWARD_FIELDS),
    3: collections.namedtuple("FusedBatchNormV3", _FORWARD_FIELDS + ["reserve_space_3"]),
}
_GRAD_FIELDS = ["x_backprop", "scale_backprop", "offset_backprop"]
_FusedBatchNormGradOutput = {
    1: collections.namedtuple("FusedBatchNormGrad", _GRAD_FIELDS + ["reserve_space_3", "reserve_space_4"]),
    2: collections.namedtuple("FusedBatchNormGradV2", _GRAD_FIELDS + ["reserve_space_3", "reserve_space_4"]),
    3: collections.namedtuple("FusedBatchNormGradV3", _GRAD_FIELDS + ["reserve_space_4", "reserve_space_5"]),
}


def _bool_attr(value, name, default=True):
    """A bool attribute as TensorFlow's op wrappers take it: a Python bool, or None for the
    default; anything else (1, numpy.bool_, "no", ...) is TensorFlow's TypeError."""
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    raise TypeError(f"Expected bool for argument '{name}' not {value!r}.")


def _forward(version, x, scale, offset, mean, variance, epsilon, exponential_avg_factor,
             data_format, is_training):
    is_training = _bool_attr(is_training, "is_training")
    xa, xt = as_input(x, "x")
    sa, st = as_input(scale, "scale")
    oa, ot = as_input(offset, "offset")
    ma, mt = as_input(mean, "mean")
    va, vt = as_input(variance, "variance")
    outs = _fbn.fused_batch_norm(version, xa, xt, sa, st, oa, ot, ma, mt, va, vt,
                                 float(epsilon), float(exponential_avg_factor), str(data_format),
                                 is_training)
    outs = (from_output(outs[0], xt),) + tuple(outs[1:])
    return _FusedBatchNormOutput[version](*outs)


def _grad(version, y_backprop, x, scale, reserve_space_1, reserve_space_2, reserve_space_3,
          epsilon, data_format, is_training):
    is_training = _bool_attr(is_training, "is_training")
    da, dt = as_input(y_backprop, "y_backprop")
    xa, xt = as_input(x, "x")
    sa, st = as_input(scale, "scale")
    r1, r1t = as_input(reserve_space_1, "reserve_space_1")
    r2, r2t = as_input(reserve_space_2, "reserve_space_2")
    if reserve_space_3 is None:
        r3, r3t = np.zeros((0,), r1.dtype), r1t
    else:
        r3, r3t = as_input(reserve_space_3, "reserve_space_3")
    outs = _fbn.fused_batch_norm_grad(version, da, xa, xt, sa, st, r1, r1t, r2, r2t, r3, r3t,
                                      float(epsilon), str(data_format), is_training, dt)
    outs = (from_output(outs[0], xt),) + tuple(outs[1:])
    return _FusedBatchNormGradOutput[version](*outs)


def FusedBatchNorm(*, x, scale, offset, mean, variance, epsilon=0.0001, exponential_avg_factor=1,
                   data_format="NHWC", is_training=True, name=None):
    """tf.raw_ops.FusedBatchNorm: every tensor float32 (or float64)."""
    del name
    return _forward(1, x, scale, offset, mean, variance, epsilon, exponential_avg_factor,
                    data_format, is_training)


def FusedBatchNormV2(*, x, scale, offset, mean, variance, epsilon=0.0001, exponential_avg_factor=1,
                     data_format="NHWC", is_training=True, name=None):
    """tf.raw_ops.FusedBatchNormV2: x in half/bfloat16/float, statistics float."""
    del name
    return _forward(2, x, scale, offset, mean, variance, epsilon, exponential_avg_factor,
                    data_format, is_training)


def FusedBatchNormV3(*, x, scale, offset, mean, variance, epsilon=0.0001, exponential_avg_factor=1,
                     data_format="NHWC", is_training=True, name=None):
    """tf.raw_ops.FusedBatchNormV3: as V2, plus 5-D formats and a reserve_space_3 output."""
    del name
    return _forward(3, x, scale, offset, mean, variance, epsilon, exponential_avg_factor,
                    data_format, is_training)


def FusedBatchNormGrad(*, y_backprop, x, scale, reserve_space_1, reserve_space_2, epsilon=0.0001,
                       data_format="NHWC", is_training=True, name=None):
    """tf.raw_ops.FusedBatchNormGrad."""
    del name
    return _grad(1, y_backprop, x, scale, reserve_space_1, reserve_space_2, None, epsilon,
                 data_format, is_training)


def FusedBatchNormGradV2(*, y_backprop, x, scale, reserve_space_1, reserve_space_2, epsilon=0.0001,
                         data_format="NHWC", is_training=True, name=None):
    """tf.raw_ops.FusedBatchNormGradV2."""
    del name
    return _grad(2, y_backprop, x, scale, reserve_space_1, reserve_space_2, None, epsilon,
                 data_format, is_training)


def FusedBatchNormGradV3(*, y_backprop, x, scale, reserve_space_1, reserve_space_2,
                         reserve_space_3, epsilon=0.0001, data_format="NHWC", is_training=True,
                         name=None):
    """tf.raw_ops.FusedBatchNormGradV3 (reserve_space_3 is accepted and not read, as on CPU)."""
    del name
    return _grad(3, y_backprop, x, scale, reserve_space_1, reserve_space_2, reserve_space_3,
                 epsilon, data_format, is_training)
