"""Helpers shared by the test modules (pytest puts this folder on sys.path)."""
import ml_dtypes
import numpy as np
import pyopencl.array as cla


def to_device(queue, *arrays):
    """A new device array on ``queue`` for each host array, in order."""
    return [cla.to_device(queue, a) for a in arrays]


NARROW = [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]  # the 16-bit storage dtypes


def narrow_ulps(dtype, f32_tol):
    """The tolerance, in ulps of ``dtype`` at a row's scale s (``reference.ulps_off(..., scale=s)``),
    of a 16-bit result: 1 ulp (its one rounding) plus the float32 error ``f32_tol``·s that the
    float32 tests allow, which is at most 2·f32_tol/eps ulps of s."""
    return 1 + 2 * f32_tol / float(ml_dtypes.finfo(dtype).eps)
