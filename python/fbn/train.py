"""Optimizers for fbn's layer variables: ``SGD`` (with momentum), applying variable constraints
after each update as Keras optimizers do."""
from . import _fbn

__all__ = ["SGD"]


class SGD:
    """``tf.keras.optimizers.SGD``: ``velocity = momentum * velocity - learning_rate * grad``,
    ``w += velocity`` (nesterov: ``w += momentum * velocity - learning_rate * grad``); then each
    variable with a constraint is projected. The arithmetic runs in C++."""

    def __init__(self, learning_rate=0.01, momentum=0.0, nesterov=False, name="SGD"):
        self.name = name
        self._opt = _fbn.SGD(float(learning_rate), float(momentum), bool(nesterov))

    learning_rate = property(lambda self: self._opt.learning_rate)
    momentum = property(lambda self: self._opt.momentum)
    nesterov = property(lambda self: self._opt.nesterov)
    iterations = property(lambda self: self._opt.iterations)

    def apply_gradients(self, grads_and_vars):
        """``grads_and_vars``: (gradient, variable) pairs; a None gradient skips its variable."""
        self._opt.apply_gradients([(g, v) for g, v in grads_and_vars])
        return self.iterations
