"""clops: OpenCL kernels for transformer training layers, templated per device.

Importing registers the ``cpu`` extra's OpenCL runtime with the ICD loader
when needed (see :mod:`clops.runtime`); nothing is built at import time.
"""
__version__ = "0.1.0"

from .runtime import default_context, default_queue  # noqa: E402  (registers the CPU runtime first)
from .program import BuildError, LimitError  # noqa: E402
from .args import memory_pool  # noqa: E402
from .profile import profile  # noqa: E402
from .attn import attention, attention_bwd  # noqa: E402
from .norm import add_rms_norm, add_rms_norm_bwd, rms_norm, rms_norm_bwd, rms_norm_dw  # noqa: E402
from .qk_rope import qk_norm_rope, qk_norm_rope_bwd  # noqa: E402
from .reference import rope_table  # noqa: E402  (a host helper: the reference's own function)
from .loss import cross_entropy, cross_entropy_bwd  # noqa: E402
from .optim import adamw  # noqa: E402
from .embed import embedding, embedding_bwd  # noqa: E402
from .blas import gemm  # noqa: E402  (CLBlast is loaded at the first call)
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
    "BuildError", "LimitError", "default_context", "default_queue", "memory_pool", "profile",
    "attention", "attention_bwd",
    "rms_norm", "rms_norm_bwd", "rms_norm_dw", "add_rms_norm", "add_rms_norm_bwd", "qk_norm_rope", "qk_norm_rope_bwd", "rope_table",
    "add", "sigmoid_gate", "sigmoid_gate_bwd", "swiglu", "swiglu_bwd", "swiglu_gated", "swiglu_gated_bwd",
    "swiglu_limit", "cross_entropy", "cross_entropy_bwd", "adamw", "embedding", "embedding_bwd", "gemm",
]
