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


def assert_storage_close(name, got, want, dtype, tol32, scale=None):
    """``got`` (stored as the 16-bit ``dtype``) against the float64 ``want`` rounded once to ``dtype``:
    within 1 ulp of ``dtype`` at the row's scale (max |want| over the last axis, a vector being one
    row, unless ``scale`` gives the rows' scales) plus the float32 parity tolerance ``tol32`` of that
    scale (:func:`narrow_ulps`)."""
    from clops.reference import ulps_off

    assert got.dtype == dtype, f"{name}: dtype {got.dtype}, expected {dtype}"
    want = np.asarray(want, dtype=np.float64)
    if scale is None:
        scale = np.max(np.abs(want), axis=-1, keepdims=True)
    off = ulps_off(got.get() if hasattr(got, "get") else got, want, dtype, scale)
    allowed = narrow_ulps(dtype, tol32)
    assert off <= allowed, f"{name}: {off:.4g} ulps of {dtype} at the row's scale > {allowed:.4g}"


def storage_override(op, sc, params):
    """``clops.tuning.override`` of family ``op`` at shape class ``sc`` and every storage type (None:
    removed), for the families whose shape class carries it."""
    from clops import tuning

    for st in ("float", "half", "bf16"):
        tuning.override(op, dict(sc, st=st), params)


ROW_OPS = ("rms_norm", "rms_norm_bwd")  # the row norms' two specs (forward and add; backward without dw)


def norm_override(ops, d, params):
    """``storage_override`` of norm family ``ops`` (a name or a tuple of them) at width ``d``."""
    for op in (ops,) if isinstance(ops, str) else ops:
        storage_override(op, {"d": d}, params)
