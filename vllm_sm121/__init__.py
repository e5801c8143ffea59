"""vllm-sm121: a vLLM 0.26.0 plugin for serving gpt-oss fast on NVIDIA GB10 (sm_121).

vLLM loads ``register`` through the ``vllm.general_plugins`` entry point ``sm121`` in every
process (API server, engine core, workers). It must stay cheap and side-effect free beyond
registration: no CUDA initialisation, lazy imports, safe to call twice.

What it registers grows feature by feature (see ../docs and design.md's table); a feature is
registered only once it is complete.
"""

from __future__ import annotations

import threading

__version__ = "0.1.0"

_lock = threading.Lock()
_registered: list[str] | None = None


def _features() -> list[str]:
    """Register every finished feature with vLLM; return their names."""
    from . import compat, moe

    compat.register_attention_backend()
    compat.register_drafter_inherits_sm121()
    compat.register_gpt_oss_dense_weights()
    compat.register_whole_model_graph()
    attention = (f"attention backend {compat.BACKEND_NAME} (--attention-backend {compat.BACKEND_NAME}; "
                 "speculative drafters follow it unless their config names a backend)")
    dense = "gpt-oss FP8 qkv/o/lm_head weights (--additional-config option sm121.dense_weights = fp8)"
    graphs = ("whole-model CUDA graphs: lm_head + greedy sampling in the FULL decode graph, steady decode "
              "steps on device inputs (--additional-config option sm121.cudagraph = whole_model)")
    return [attention, dense, graphs] + ([moe.register()] if moe.READY else [])


def register() -> list[str]:
    """Entry point for ``vllm.general_plugins``; idempotent, lazily importing, no CUDA."""
    global _registered
    with _lock:
        if _registered is None:
            _registered = _features()
            what = ", ".join(_registered) if _registered else "kernel library only (no vLLM feature enabled yet)"
            from vllm.logger import init_logger  # after vLLM configured logging (a logger made
            # earlier would be disabled by its dictConfig)

            init_logger("vllm.sm121").info("vllm-sm121 %s loaded: %s", __version__, what)
        return list(_registered)
