"""Helpers shared by the test modules (pytest puts this folder on sys.path)."""
import pyopencl.array as cla


def to_device(queue, *arrays):
    """A new device array on ``queue`` for each host array, in order."""
    return [cla.to_device(queue, a) for a in arrays]


def assert_storage_close(name, got, want, dtype, tol32):
    """``got`` (stored as the 16-bit ``dtype``) against the float64 ``want`` rounded once to ``dtype``:
    within 1 ulp of ``dtype`` at the row's scale (max |want| over the last axis; a vector is one row)
    plus the float32 parity tolerance ``tol32`` of that scale. An ulp at scale s is at most
    s·2^-nmant, so ``tol32``·s is at least ``tol32``·2^nmant of those ulps: that many are allowed
    beside the one (float16: 1e-5 → 0.01 ulp, bfloat16: 0.0013)."""
    import ml_dtypes
    import numpy as np

    from clops.reference import ulps_off

    assert got.dtype == dtype, f"{name}: dtype {got.dtype}, expected {dtype}"
    want = np.asarray(want, dtype=np.float64)
    scale = np.max(np.abs(want), axis=-1, keepdims=True)
    off = ulps_off(got.get() if hasattr(got, "get") else got, want, dtype, scale)
    allowed = 1 + tol32 * 2.0 ** ml_dtypes.finfo(dtype).nmant
    assert off <= allowed, f"{name}: {off:.4g} ulps of {dtype} at the row's scale > {allowed:.4g}"
