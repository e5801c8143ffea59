"""Triton kernels of vllm-sm121, installed as ``vllm_sm121.kernels``.

Each public module holds a launcher and its pure-torch reference side by side; the ``@triton.jit``
code lives in ``<module>_details/``. Kernels import ``triton`` directly (``vllm.triton_utils``
disables Triton when no GPU is visible, even under ``TRITON_INTERPRET=1``).
"""

from .kv_cache import write_kv_cache, write_kv_cache_torch
from .paged_attention import (
    SplitWorkspace,
    paged_attention,
    paged_attention_torch,
    choose_num_splits,
)

__all__ = [
    "SplitWorkspace",
    "choose_num_splits",
    "paged_attention",
    "paged_attention_torch",
    "write_kv_cache",
    "write_kv_cache_torch",
]
