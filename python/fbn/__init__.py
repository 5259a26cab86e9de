"""fbn: TensorFlow's batch normalization (fused ops, non-fused ops) as a C++ library.

The ops mirror TensorFlow's names and keyword arguments, so code written against ``tf.raw_ops``
or ``tf.compat.v1.nn`` runs with ``fbn.raw_ops`` / ``fbn.nn`` swapped in::

    import fbn
    y, mean, var, rs1, rs2, rs3 = fbn.raw_ops.FusedBatchNormV3(
        x=x, scale=scale, offset=offset, mean=empty, variance=empty, is_training=True)
"""
from . import _fbn
from . import errors, nn, raw_ops
from . import graph, layers, train
from ._fbn import get_num_threads, set_num_threads
from .graph import AUTO_REUSE, Graph, GraphKeys, variable_scope
from .layers import TrainingFlag

__version__ = _fbn.__version__

__all__ = ["errors", "nn", "raw_ops", "get_num_threads", "set_num_threads", "__version__",
           "layers", "train", "Graph", "GraphKeys", "variable_scope", "AUTO_REUSE", "TrainingFlag"]
