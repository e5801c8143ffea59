"""Functions the GPU tests run inside vLLM's workers through ``LLM.collective_rpc(fn)`` (a
callable is pickled by reference, so it must live in an importable module; vLLM 0.26 sends
callables only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` set for the engine, which the tests do)."""

from __future__ import annotations


def decode_parts_built(worker) -> int:
    """Mixed batches the SM121 builder gave a split decode launch in this worker so far."""
    from vllm_sm121.attention import metadata

    return metadata.DECODE_PARTS_BUILT


def carried_norm_layers(worker) -> int:
    """gpt-oss layers of this worker's model whose qkv op takes the input norm carried from the
    previous layer's FC2 (``sm121_norm_in_key`` set; ``vllm_sm121/moe/carry.py``)."""
    model = worker.model_runner.model
    layers = getattr(getattr(model, "model", model), "layers", [])
    return sum(1 for layer in layers if getattr(layer, "sm121_norm_in_key", ""))
