"""clops.blas.gemm (CLBlast through ctypes) against float64 numpy: transposes, beta, refusals."""
import ctypes.util
import os

import numpy as np
import pytest

from clops import blas
from clops.reference import rel_err, rnd
from helpers import to_device

pytestmark = pytest.mark.skipif(not (os.environ.get("CLOPS_CLBLAST") or ctypes.util.find_library("clblast")),
                                reason="CLBlast is not installed (apt install libclblast1)")


@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (True, False), (False, True), (True, True)])
def test_gemm(queue, trans_a, trans_b):
    m, n, k = 33, 20, 17
    a = rnd((k, m) if trans_a else (m, k), 1)
    b = rnd((n, k) if trans_b else (k, n), 2)
    da, db = to_device(queue, a, b)
    want = (a.T if trans_a else a).astype(np.float64) @ (b.T if trans_b else b).astype(np.float64)
    c = blas.gemm(queue, da, db, trans_a=trans_a, trans_b=trans_b)
    assert rel_err(c.get(), want) <= 1e-6
    c = blas.gemm(queue, da, db, trans_a=trans_a, trans_b=trans_b, alpha=2.0, beta=-1.0, out=c)
    assert rel_err(c.get(), want) <= 1e-6  # 2·ab − ab


def test_refusals(queue):
    a, b = to_device(queue, rnd((4, 3), 1), rnd((4, 5), 2))
    with pytest.raises(ValueError, match="b: op\\(b\\) has 4 rows, op\\(a\\) 3 columns"):
        blas.gemm(queue, a, b)
    with pytest.raises(ValueError, match="out: needed when beta"):
        blas.gemm(queue, a, b, trans_a=True, beta=1.0)
    with pytest.raises(TypeError, match="trans_a"):
        blas.gemm(queue, a, b, trans_a=1)
    with pytest.raises(ValueError, match="out: shares memory with b"):
        blas.gemm(queue, a, b, trans_a=True, out=b.reshape(20)[:15].reshape(3, 5))  # a view of b's buffer


def test_missing_library_says_how_to_install(monkeypatch):
    monkeypatch.setattr(blas, "_lib", {})
    monkeypatch.delenv("CLOPS_CLBLAST", raising=False)
    monkeypatch.setattr(blas.ctypes.util, "find_library", lambda name: None)
    with pytest.raises(RuntimeError, match="apt install libclblast1"):
        blas.library()
