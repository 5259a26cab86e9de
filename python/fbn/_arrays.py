"""Array plumbing shared by the wrappers: NumPy (and ml_dtypes.bfloat16) in, fbn dtype codes out."""
import numpy as np
import ml_dtypes

from . import _fbn

_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
_CODES = {
    np.dtype(np.float16): _fbn.DT_HALF,
    _BFLOAT16: _fbn.DT_BFLOAT16,
    np.dtype(np.float32): _fbn.DT_FLOAT,
    np.dtype(np.float64): _fbn.DT_DOUBLE,
}
_NAMES = {np.dtype(np.float16): "half", _BFLOAT16: "bfloat16", np.dtype(np.float32): "float",
          np.dtype(np.float64): "double"}


def as_input(value, name, default_dtype=np.float32):
    """Returns (contiguous array as the binding takes it, fbn dtype code).

    NumPy arrays keep their dtype; Python scalars and lists become float32, as
    ``tf.convert_to_tensor`` makes them. bfloat16 and float16 travel as uint16 views.
    """
    if value is None:
        raise TypeError(f"{name} must be an array, got None")
    if isinstance(value, np.ndarray) or hasattr(value, "__array__") and not isinstance(value, (list, tuple)):
        arr = np.asarray(value)
    else:
        arr = np.asarray(value, dtype=default_dtype)
    code = _CODES.get(arr.dtype)
    if code is None:
        raise TypeError(
            f"{name} must be a float16, bfloat16, float32 or float64 array, got dtype {arr.dtype}")
    arr = np.require(arr, requirements="C")  # keeps 0-d arrays 0-d, unlike ascontiguousarray
    if arr.dtype.itemsize == 2:
        arr = arr.view(np.uint16)
    return arr, code


def from_output(arr, code):
    """Reinterprets an output buffer with its real dtype."""
    if code == _fbn.DT_HALF:
        return arr.view(np.float16)
    if code == _fbn.DT_BFLOAT16:
        return arr.view(_BFLOAT16)
    return arr
