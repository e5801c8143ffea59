"""Functions the GPU tests run inside vLLM's workers through ``LLM.collective_rpc(fn)`` (a
callable is pickled by reference, so it must live in an importable module; vLLM 0.26 sends
callables only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` set for the engine, which the tests do)."""

from __future__ import annotations


def decode_parts_built(worker) -> int:
    """Mixed batches the SM121 builder gave a split decode launch in this worker so far."""
    from vllm_sm121.attention import metadata

    return metadata.DECODE_PARTS_BUILT
