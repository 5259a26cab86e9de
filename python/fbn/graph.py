"""TF1-style graphs for fbn's layers: ``Graph``, ``GraphKeys``, ``variable_scope``.

A ``Graph`` holds variables (named as ``tf.compat.v1.get_variable`` names them) and collections.
Execution is eager: a layer call computes its output at once, but what a TF1 session run would
defer stays deferred: the moving-average updates of a training call are update ops in
``GraphKeys.UPDATE_OPS``, and the moving statistics change only when they run::

    g = fbn.Graph()
    with g.as_default():
        y = fbn.layers.batch_normalization(x, training=True)
        for op in g.get_collection(fbn.GraphKeys.UPDATE_OPS):
            op.run()            # or g.run(ops): one "session run" for several ops
"""
import contextlib
import re
import threading

import numpy as np

from . import _fbn
from ._arrays import _CODES

__all__ = ["Graph", "GraphKeys", "VariableScope", "variable_scope", "get_default_graph",
           "AUTO_REUSE"]


class _AutoReuse:
    def __repr__(self):
        return "AUTO_REUSE"


#: ``reuse=AUTO_REUSE``: get a variable if it exists, create it otherwise.
AUTO_REUSE = _AutoReuse()


class GraphKeys:
    """``tf.compat.v1.GraphKeys``: the collection names."""
    GLOBAL_VARIABLES = "variables"
    TRAINABLE_VARIABLES = "trainable_variables"
    UPDATE_OPS = "update_ops"
    REGULARIZATION_LOSSES = "regularization_losses"


_local = threading.local()


def _stack():
    if not hasattr(_local, "graphs"):
        _local.graphs = []
    return _local.graphs


def get_default_graph():
    """The innermost ``Graph`` entered with ``as_default()`` on this thread, or None (eager)."""
    stack = _stack()
    return stack[-1] if stack else None


class Graph:
    """Variables, collections and variable scopes, as a ``tf.Graph`` in TF1 graph mode."""

    def __init__(self):
        self._graph = _fbn.Graph.create()
        self._learning_phase = _fbn.TrainingFlag(False)

    @contextlib.contextmanager
    def as_default(self):
        """Makes this the default graph inside the ``with`` block."""
        self._graph.push_default()
        _stack().append(self)
        try:
            yield self
        finally:
            _stack().pop()
            self._graph.pop_default()

    @property
    def learning_phase(self):
        """The runtime flag that ``training=None`` means in this graph (Keras's learning phase,
        a boolean placeholder defaulting to False)."""
        return self._learning_phase

    def get_collection(self, key, scope=None):
        """The collection's items; with ``scope``, those whose name matches it (``re.match``)."""
        items = self._graph.get_collection(key)
        if scope is None:
            return items
        return [item for item in items if re.match(scope, item.name)]

    def add_to_collection(self, name, value):
        self._graph.add_to_collection(name, value)

    def global_variables(self, scope=None):
        return self.get_collection(GraphKeys.GLOBAL_VARIABLES, scope)

    def trainable_variables(self, scope=None):
        return self.get_collection(GraphKeys.TRAINABLE_VARIABLES, scope)

    def get_variable(self, name, shape, dtype=np.float32, initializer=None, trainable=True):
        """``tf.compat.v1.get_variable`` in this graph's current variable scope."""
        from . import layers  # the initializer resolution lives with the layer
        code = _CODES[np.dtype(dtype)]
        return self._graph.get_variable(name, [int(d) for d in shape], code,
                                        layers._initializer(initializer), bool(trainable))

    @staticmethod
    def run(ops):
        """Runs update ops as one TensorFlow session run: dependencies they share (batch
        renormalization's renorm statistics) run once."""
        _fbn.run_update_ops(list(ops))


class VariableScope:
    """What ``with variable_scope(...) as scope`` gives: the scope's full name and reuse mode.
    It can be passed to ``variable_scope`` again to re-enter the same scope."""

    def __init__(self, name, reuse, auto_reuse):
        self.name = name
        self._reuse = reuse
        self._auto_reuse = auto_reuse

    @property
    def reuse(self):
        return AUTO_REUSE if self._auto_reuse else self._reuse

    @property
    def original_name_scope(self):
        return self.name + "/" if self.name else ""

    def __repr__(self):
        return f"VariableScope(name={self.name!r}, reuse={self.reuse!r})"


def _reuse_code(reuse):
    if reuse is AUTO_REUSE:
        return 2
    if reuse is True:
        return 1
    if reuse is None or reuse is False:
        return 0  # False cannot undo an outer reuse, as in TensorFlow
    raise ValueError("The reuse parameter must be True or False or None.")


@contextlib.contextmanager
def variable_scope(name_or_scope, default_name=None, values=None, reuse=None):
    """``tf.compat.v1.variable_scope`` on the default graph: names, reuse (True, None/False to
    inherit, AUTO_REUSE) and ``default_name`` made unique as TensorFlow does."""
    del values
    graph = _fbn.Graph.get_default()
    if graph is None:
        raise ValueError("fbn.variable_scope needs a default graph: variables live in a Graph. "
                         "Use `with fbn.Graph().as_default():`.")
    code = _reuse_code(reuse)
    if isinstance(name_or_scope, VariableScope):
        graph.enter_captured_scope(name_or_scope.name, bool(name_or_scope._reuse),
                                   bool(name_or_scope._auto_reuse), code)
    else:
        if name_or_scope is None and default_name is None:
            raise TypeError("If default_name is None then name_or_scope is required")
        if name_or_scope is not None and not isinstance(name_or_scope, str):
            raise TypeError("VariableScope: name_or_scope must be a string or VariableScope.")
        graph.enter_scope(name_or_scope or "", code, default_name or "")
    try:
        yield VariableScope(*graph.current_scope())
    finally:
        graph.exit_scope()
