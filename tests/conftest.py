"""Every test that takes ``ctx_factory`` (or ``queue``) runs once per OpenCL device found,
or per device that ``PYOPENCL_TEST`` names (pyopencl's convention)."""
import pyopencl as cl
import pytest

import clops  # noqa: F401  (registers the pip-installed CPU runtime before the first platform query)
from clops import mma
from pyopencl.tools import pytest_generate_tests_for_pyopencl as pytest_generate_tests  # noqa: F401


_contexts = {}  # device -> the context its tests share


@pytest.fixture(autouse=True)
def _tuning_reread():
    """Ops memoise their tuning choice (clops.tuning.reload() forgets it) and read CLOPS_CHECKED
    once (clops.program.reload_switches()): after each test, whose monkeypatching of the database
    and the environment has been undone by then (autouse fixtures are torn down last), the next
    one starts from the real database and environment, and from the tile overrides there were
    before it (a test's clops.tuning.override calls end with it)."""
    overrides = dict(clops.tuning._overrides)
    yield
    clops.tuning._overrides.clear()
    clops.tuning._overrides.update(overrides)
    clops.tuning.reload()
    clops.program.reload_switches()


@pytest.fixture
def portable_attention():
    """Attention on the portable kernels (CLOPS_MMA=0) for the test: the modules that test those
    kernels take it for every test, so that on NVIDIA, where attention takes the matrix units, they
    still test them."""
    with mma.using("0"):
        yield


@pytest.fixture
def queue(ctx_factory):
    """A profiling-enabled queue on the device under test, on one context per device for the whole
    session: NVIDIA's driver refused new contexts (OUT_OF_HOST_MEMORY) after some dozens per test
    process. Tests about contexts themselves take ``ctx_factory``."""
    # The dict also holds the context: Intel's CPU runtime loses a context whose last Python
    # reference is gone even while a queue on it lives.
    if ctx_factory.device not in _contexts:
        _contexts[ctx_factory.device] = ctx_factory()
    return cl.CommandQueue(_contexts[ctx_factory.device], properties=cl.command_queue_properties.PROFILING_ENABLE)
