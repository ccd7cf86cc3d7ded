"""clops: OpenCL kernels for transformer training layers, templated per device.

Importing registers the ``cpu`` extra's OpenCL runtime with the ICD loader
when needed (see :mod:`clops.runtime`); nothing is built at import time.
"""
__version__ = "0.1.0"

from .runtime import default_context, default_queue  # noqa: E402  (registers the CPU runtime first)
from .program import BuildError, LimitError  # noqa: E402
from .profile import profile  # noqa: E402
from .attention import attention  # noqa: E402
from .elementwise import (  # noqa: E402
    add,
    sigmoid_gate,
    sigmoid_gate_bwd,
    swiglu,
    swiglu_bwd,
    swiglu_gated,
    swiglu_gated_bwd,
    swiglu_limit,
)

__all__ = [
    "BuildError", "LimitError", "default_context", "default_queue", "profile",
    "attention",
    "add", "sigmoid_gate", "sigmoid_gate_bwd", "swiglu", "swiglu_bwd", "swiglu_gated", "swiglu_gated_bwd",
    "swiglu_limit",
]
