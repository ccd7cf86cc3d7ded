"""Checked builds (CLOPS_CHECKED=1): guarded global accesses, raised on the host."""
import re
import warnings

import numpy as np
import pyopencl as cl
import pyopencl.array as cla
import pytest

import clops
from clops import program
from clops.check import all_cases
from clops.program import BuildError, Kernel, OutOfBoundsError, kernels, render

PARAMS = {"wg": 16, "vw": 4, "ept": 2, "idx": "uint", "st": "float", "gst": "float", "row_aligned": 0}


def test_unchecked_source_has_no_guards(monkeypatch):
    monkeypatch.delenv("CLOPS_CHECKED", raising=False)
    program.reload_switches()  # CLOPS_CHECKED is read once
    plain = render("elementwise.cl.mako", **PARAMS, checked=False)
    assert "clops_guard" not in plain and "clops_err" not in plain
    assert "clops_guard(" in render("elementwise.cl.mako", **PARAMS, checked=True)


def test_checked_variant_has_its_own_cache_entry(queue, monkeypatch):
    monkeypatch.delenv("CLOPS_CHECKED", raising=False)
    program.reload_switches()  # CLOPS_CHECKED is read once
    plain = kernels(queue, "elementwise.cl.mako", PARAMS)["add"]
    monkeypatch.setenv("CLOPS_CHECKED", "1")
    program.reload_switches()  # CLOPS_CHECKED is read once
    checked = kernels(queue, "elementwise.cl.mako", PARAMS)["add"]
    assert checked is not plain and checked.params["checked"] and not plain.params["checked"]
    assert checked.knl.num_args > plain.knl.num_args


@pytest.mark.parametrize("n", [100, 131])  # the vector path, then the scalar tail, runs past the buffers
def test_planted_out_of_range_geometry_raises(queue, monkeypatch, n):
    monkeypatch.setenv("CLOPS_CHECKED", "1")
    program.reload_switches()  # CLOPS_CHECKED is read once
    size = 64
    a = cla.to_device(queue, np.ones(size, np.float32))
    b = cla.to_device(queue, np.ones(size, np.float32))
    c = cla.empty(queue, size, np.float32)
    knl = kernels(queue, "elementwise.cl.mako", PARAMS)["add"]
    per_group = PARAMS["wg"] * PARAMS["vw"] * PARAMS["ept"]
    with pytest.raises(OutOfBoundsError, match=r"kernel add \(elementwise\.cl\.mako\)") as info:
        knl(queue, (-(-n // per_group),), [c.data, a.data, b.data, np.uint32(n)])
    msg = str(info.value)
    index = int(re.search(r"at index (\d+)", msg).group(1))
    assert size - PARAMS["vw"] < index < n, msg
    assert re.search(r"(c_out|a_in|b_in)\[", msg), msg


def test_planted_gather_out_of_range_raises(queue, monkeypatch):
    """A row weight shorter than the rows it is indexed by."""
    monkeypatch.setenv("CLOPS_CHECKED", "1")
    program.reload_switches()  # CLOPS_CHECKED is read once
    rows, width = 5, 16
    a = cla.to_device(queue, np.ones(rows * width, np.float32))
    rw = cla.to_device(queue, np.ones(rows - 2, np.float32))
    c = cla.empty(queue, rows * width, np.float32)
    knl = kernels(queue, "elementwise.cl.mako", PARAMS)["swiglu_limit_rows_fwd"]
    args = [c.data, a.data, a.data, rw.data, np.uint32(rows * width), np.float32(0), np.float32(1), np.uint32(width)]
    with pytest.raises(OutOfBoundsError, match=r"swiglu_limit_rows_fwd .*rw_src\[.* at index [34],"):
        knl(queue, (1,), args)


def _zeros(queue, *shape):
    return cla.zeros(queue, shape, np.float32)


def _rms_norm_rows(queue, small=3, big=40, d=64):
    """rms_norm_fwd told of 40 rows, given buffers of 3."""
    from clops.norm import _row_kernel

    knl, groups, sizes = _row_kernel(queue, "rms_norm_fwd", big, d)
    bufs = [_zeros(queue, small, d), _zeros(queue, small), _zeros(queue, small, d), _zeros(queue, d)]
    return knl, groups, [b.data for b in bufs] + sizes + [np.float32(1e-6), np.float32(0)]


def _qk_units(queue, small=4, big=50, hd=32, heads=2):
    """qk_norm_rope_fwd told of 50 units, given buffers of 4."""
    from clops.qk_rope import _plan

    p, knl, units = _plan(queue, "qk_norm_rope_fwd", big, hd, 0)
    bufs = [_zeros(queue, small, hd), _zeros(queue, small), _zeros(queue, small, hd), _zeros(queue, hd)]
    args = [b.data for b in bufs] + [units, np.uint32(heads), np.uint32(1), np.float32(1e-6), np.float32(1)]
    return knl, (-(-big // (p["upg"] * p["hpw"])),), args


def _attention_window(queue, small=8, big=40, nh=2, hd=8):
    """attention_fwd told of a window of 40 tokens, given 8."""
    from clops.attn import FWD

    p, knl = FWD.kernels(queue, {"hd": hd}, idx="uint")
    knl = knl["attention_fwd"]
    q, kv, o, lse = _zeros(queue, small, nh, hd), _zeros(queue, small, 1, hd), _zeros(queue, small, nh, hd), _zeros(
        queue, small, nh)
    args = [q.data, kv.data, kv.data, o.data, lse.data, np.uint32(big), np.uint32(nh), np.uint32(nh), np.float32(1)]
    return knl, (nh, 1, -(-big // p["bq"])), args


def _attention_dsum_rows(queue, small=8, big=40, hd=8):
    """attn_bwd_dsum told of 40 (row, head) pairs, given 8."""
    from clops.attn import BWD

    p, knl = BWD["dkv"].kernels(queue, {"hd": hd}, idx="uint", store_ds=0)
    o, dsum = _zeros(queue, small, hd), _zeros(queue, small)
    return knl["attn_bwd_dsum"], (-(-big // (p["wg"] // p["lanes"])),), [o.data, o.data, dsum.data, np.uint32(big)]


PLANTED = {"rms_norm_fwd": _rms_norm_rows, "qk_norm_rope_fwd": _qk_units, "attention_fwd": _attention_window,
           "attn_bwd_dsum": _attention_dsum_rows}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_planted_geometry_of_each_family_raises(queue, monkeypatch, name):
    monkeypatch.setenv("CLOPS_CHECKED", "1")
    program.reload_switches()  # CLOPS_CHECKED is read once
    knl, groups, args = PLANTED[name](queue)
    with pytest.raises(OutOfBoundsError, match=rf"kernel {name} .* at index \d+, outside"):
        knl(queue, groups, args)


def test_checked_op_on_valid_input_matches_unchecked(queue, monkeypatch):
    x = np.linspace(-3, 3, 4099).astype(np.float32)
    a, b = cla.to_device(queue, x), cla.to_device(queue, x[::-1].copy())
    monkeypatch.delenv("CLOPS_CHECKED", raising=False)
    program.reload_switches()  # CLOPS_CHECKED is read once
    want = clops.swiglu(queue, a, b).get()
    monkeypatch.setenv("CLOPS_CHECKED", "1")
    program.reload_switches()  # CLOPS_CHECKED is read once
    got = clops.swiglu(queue, a, b).get()
    assert np.array_equal(got, want)


def test_checked_args_out_of_order_fail(queue):
    """A kernel whose size arguments do not follow its buffers' order is refused when loaded."""
    src = ("__kernel __attribute__((reqd_work_group_size(1, 1, 1))) void f(__global float *a, __global float *b,"
           " __global uint *clops_err, const ulong b_bytes, const ulong a_bytes) { a[0] = b[0]; }")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cl.CompilerWarning)  # Intel's runtime logs its progress
        prg = cl.Program(cl._cl._Program(queue.context, src)).build(options=["-cl-std=CL1.2", "-cl-kernel-arg-info"])
    with pytest.raises(BuildError, match=r"checked_args must name its buffers \['a', 'b'\] in order"):
        Kernel(prg.f, "planted.cl.mako", {"checked": True}, queue.device)


CASES = all_cases()


@pytest.mark.parametrize("case", CASES, ids=[f"{c.family}:{c.name}" for c in CASES])
def test_parity_cases_pass_checked(queue, monkeypatch, case):
    """Every parity case in a checked build: no guard fires on valid input, results stay right."""
    monkeypatch.setenv("CLOPS_CHECKED", "1")
    program.reload_switches()  # CLOPS_CHECKED is read once
    bad = [f"{r.op} {r.shape}: {r.err:.3e}" for r in case.run(queue) if not r.ok]
    assert not bad, bad
