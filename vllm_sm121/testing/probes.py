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


DUMP_TOKENS = 200  # the token count of the one forward the dumps record (tests/test_tp_gpu.py)
# ... unless $SM121_DUMP_TOKENS says another (read in the workers, which inherit the environment):
# e.g. 110 with a 2049-token prompt in chunks of 1939 records the last chunk of a long prompt
DUMP_TOKENS_ENV = "SM121_DUMP_TOKENS"


def dump_tokens() -> int:
    """The token count of the forward the dumps record: $SM121_DUMP_TOKENS, else DUMP_TOKENS."""
    from vllm_sm121.envs import env_int

    n = env_int(DUMP_TOKENS_ENV, DUMP_TOKENS)
    if n < 2:
        raise ValueError(f"${DUMP_TOKENS_ENV}={n} is not supported; supported: an integer >= 2 (tokens)")
    return n


def install_layer_dumps(worker) -> int:
    """Forward hooks on each gpt-oss layer of this worker's model that keep, from the first forward
    of exactly ``dump_tokens()`` tokens, the attention core's inputs (this rank's q, k, v after the
    rotation, whichever qkv op produced them) and output (this rank's heads, before o_proj), the
    block's outputs (the MoE output and the residual, both whole after the all-reduces), and the
    model's logits for those tokens (whole vocabulary on rank 0 after vLLM's gather), as fp32 CPU
    tensors in
    ``worker._sm121_dumps``; returns the number of layers hooked. Eager engines only (hooks do not
    run inside compiled graphs)."""
    model = worker.model_runner.model
    layers = getattr(getattr(model, "model", model), "layers", [])
    store: dict = {}
    n = dump_tokens()

    def keep(name, inputs=False, sizes=(n,)):
        def hook(module, args, out=None):
            outs = args if inputs else out if isinstance(out, tuple) else (out,)
            if name not in store and hasattr(outs[0], "shape") and outs[0].shape[0] in sizes:
                store[name] = [o.detach().float().cpu() for o in outs if hasattr(o, "detach")]
        return hook

    for i, layer in enumerate(layers):
        layer.register_forward_hook(keep(f"{i}.block"))
        layer.attn.attn.register_forward_hook(keep(f"{i}.attn"))
        layer.attn.attn.register_forward_pre_hook(keep(f"{i}.qkv", inputs=True))
    if hasattr(model, "logits_processor"):
        # (prompt logprobs score every prompt position but the last)
        model.logits_processor.register_forward_hook(keep("logits", sizes=(n - 1, n)))
    worker._sm121_dumps = store
    worker._sm121_dump_layers = layers
    return len(layers)


def layer_dumps(worker) -> dict:
    """What ``install_layer_dumps`` kept: {"<layer>.qkv": [q, k, v], "<layer>.attn": [out], "<layer>.block":
    [mlp out, residual], "logits": [logits]}, plus, for layers on an nvfp4 cache, "<layer>.g": [the K and
    V global scales] and "<layer>.calib": [[tokens, capturing, cache elements] of each batch the
    scales' calibration saw] (``SM121AttentionImpl._calibrate``)."""
    import torch

    store = dict(getattr(worker, "_sm121_dumps", {}))
    for i, layer in enumerate(getattr(worker, "_sm121_dump_layers", [])):
        impl = getattr(layer.attn.attn, "impl", None)
        g = getattr(impl, "_g", None)
        if g is not None:
            store[f"{i}.g"] = [g.detach().float().cpu()]
            store[f"{i}.calib"] = [torch.tensor(getattr(impl, "_calib_log", []), dtype=torch.int64).view(-1, 3)]
    return store
