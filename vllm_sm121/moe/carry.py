"""Which gpt-oss layer boundaries carry the next layer's input norm from FC2 into the qkv GEMV.

Architecture
    ``kernels/next_norm.py`` says what is carried and why. Here: the link between two consecutive
    ``Sm121GptOssBlock`` s of one model. When block i is built and block i - 1 of the same vLLM config
    was built before it (on this rank) and both qualify, block i registers a key (its input norm's
    name) with its ``input_layernorm``; block i - 1's FC2 writes that key's buffers
    (``sm121_norm_out_key``) and block i's qkv op reads them (``sm121_norm_in_key``). The ops find
    the buffers by the key at run time, as vLLM's attention ops find their KV cache by layer name:
    the traced graph orders the two ops through the block output, which the qkv op takes.

    Buffers are allocated when the layers are linked, on the norm weight's device (vLLM builds the
    model on its target device), NEXT_NORM_MAX_T rows each: ~25 KB per boundary for gpt-oss; a call
    on another device reallocates them there.

Limitations
    Layers are found by their index in the module prefix (``extract_layer_index``); the norm
    module is held weakly (a model that is dropped drops its entries' weights). Keys are the input
    norms' module names, stable across processes as vLLM's compile cache needs (the ops take them
    as constants): two gpt-oss models with the same layer names alive in one process would share
    the entries (the later one's), so such a process must turn the option off
    ($VLLM_SM121_NORM_IN_QKV=0); vLLM's own draft models live under other prefixes.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from vllm_sm121.kernels.next_norm import NextNormBuffers


@dataclasses.dataclass
class _Entry:
    norm: weakref.ref  # the consumer block's input_layernorm (RMSNorm)
    bufs: NextNormBuffers | None = None


_ENTRIES: dict[str, _Entry] = {}
_BLOCKS: dict[tuple[int, int], weakref.ref] = {}  # (id(vllm_config), layer index) -> block


def link(block: torch.nn.Module, vllm_config, prefix: str) -> str:
    """Registers ``block`` (layer ``prefix``) as able to take part; when the previous layer of the
    same config is registered, links the two and returns the boundary's key ("" otherwise)."""
    from vllm.model_executor.models.utils import extract_layer_index

    idx = extract_layer_index(prefix)
    block._sm121_carry_config = vllm_config
    _BLOCKS[(id(vllm_config), idx)] = weakref.ref(block)
    ref = _BLOCKS.get((id(vllm_config), idx - 1))
    prev = ref() if ref is not None else None
    if prev is None or getattr(prev, "_sm121_carry_config", None) is not vllm_config:
        return ""
    key = f"{prefix}.input_layernorm"
    w = block.input_layernorm.weight
    bufs = NextNormBuffers.alloc(w.shape[0], w.device) if w.device.type not in ("meta",) else None
    _ENTRIES[key] = _Entry(weakref.ref(block.input_layernorm), bufs)
    prev.sm121_norm_out_key = key
    return key


def _entry(key: str) -> _Entry:
    e = _ENTRIES.get(key)
    norm = e.norm() if e is not None else None
    if norm is None:
        raise RuntimeError(f"the carried input norm {key!r} is not registered (its layer was not built or was dropped)")
    return e


def norm_weight(key: str) -> torch.Tensor:
    """The consumer layer's input-norm weight."""
    return _entry(key).norm().weight


def buffers(key: str, hidden: int, device) -> NextNormBuffers:
    """The boundary's buffers on ``device`` (allocated at the first call)."""
    e = _entry(key)
    b = e.bufs
    if b is None or b.s.device != torch.device(device) or b.s.shape[1] != hidden:
        b = e.bufs = NextNormBuffers.alloc(hidden, device)
    return b
