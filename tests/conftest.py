"""Every test that takes ``ctx_factory`` (or ``queue``) runs once per OpenCL device found,
or per device that ``PYOPENCL_TEST`` names (pyopencl's convention)."""
import pyopencl as cl
import pytest

import clops  # noqa: F401  (registers the pip-installed CPU runtime before the first platform query)
from pyopencl.tools import pytest_generate_tests_for_pyopencl as pytest_generate_tests  # noqa: F401


@pytest.fixture
def queue(ctx_factory):
    """A profiling-enabled queue on the device under test."""
    # Hold the context: Intel's CPU runtime loses a context whose last Python reference is gone
    # even while a queue on it lives.
    ctx = ctx_factory()
    yield cl.CommandQueue(ctx, properties=cl.command_queue_properties.PROFILING_ENABLE)
    del ctx
