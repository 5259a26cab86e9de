"""Exceptions raised by fbn, named as TensorFlow's.

``InvalidArgumentError`` subclasses ``ValueError``: bad shapes, dtypes or attributes. Its message
is TensorFlow's text for the same mistake.
"""
from ._fbn import InternalError, InvalidArgumentError, ResourceExhaustedError

__all__ = ["InvalidArgumentError", "ResourceExhaustedError", "InternalError"]
