"""Which kernel of a gpt-oss layer prefetches which weight into L2 (``kernels/l2_prefetch.py``).

``install(block, targets)`` runs in ``Sm121GptOssBlock.__init__`` (the fused MoE path) with the
targets of $VLLM_SM121_L2_PREFETCH (or the family's default):

    o               the layer's ``Attention`` gets a weak reference to its ``o_proj``; the SM121
                    backend's forward passes ``o_proj.weight`` to the attention kernel
    qkv / qkv_late  the MoE op of layer i is called with the key of layer i + 1, whose
                    ``qkv_proj.weight`` its FC2 prefetches (none after the last layer)
    w2 / w2_late    the MoE op's FC1 prefetches its experts' FC2 rows

The weights are looked up each time the kernels are launched (they are converted to FP8 after
construction; a graph captures the pointers), through weak references (the registry never keeps
a model alive) in a per-process registry keyed by "<model>:<block prefix>" ("0:model.layers.7";
a block with layer index 0 starts the next model number, so two models in one process do not
share entries). The MoE op takes the key as a string argument: the traced graph carries it as a
constant, one per layer, so with a MoE target on Inductor compiles each layer's piece of the graph
separately (a slower first compile; the option is off by default).
"""

from __future__ import annotations

import re
import weakref

import torch

from vllm_sm121 import platform as _platform
from vllm_sm121.config import L2_PREFETCH_ENV as PREFETCH_ENV
TARGETS = ("o", "qkv", "qkv_late", "w2", "w2_late")
# performance hyper-parameters: the default targets per family (none: no gain measured, stop 29;
# kernels/l2_prefetch.py has the numbers)
DEFAULT_TARGETS: dict[str, tuple[str, ...]] = {
    _platform.SM90: (),
    _platform.SM12X: (),
}
ATTN_ATTR = "_sm121_l2_prefetch"  # on vLLM's Attention module: weakref to the o_proj whose weight it prefetches
_QKV: dict[str, weakref.ref] = {}  # block key -> its qkv_proj
_BLOCKS: dict[str, tuple[frozenset, str]] = {}  # block key -> (MoE targets, the next block's key)
_models = [-1]  # the model number of the blocks being built (a block with layer index 0 starts the next)


def parse(text: str) -> frozenset[str]:
    """The targets of a $VLLM_SM121_L2_PREFETCH value; an unknown name is an error naming it."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if names == ["none"]:
        return frozenset()
    bad = [n for n in names if n not in TARGETS]
    if bad:
        raise ValueError(f"${PREFETCH_ENV}={text!r}: unknown target(s) {bad}; supported: a comma list of "
                         f"{', '.join(TARGETS)}, or none")
    for a in ("qkv", "w2"):
        if a in names and f"{a}_late" in names:
            raise ValueError(f"${PREFETCH_ENV}={text!r}: {a} and {a}_late are two placements of one prefetch; "
                             "pick one")
    return frozenset(names)


def targets_from(text: str) -> frozenset[str]:
    """The targets of a $VLLM_SM121_L2_PREFETCH value; blank: the current CUDA device family's
    default (none without CUDA)."""
    if text.strip():
        return parse(text)
    family = _platform.INTERPRETER
    if torch.cuda.is_available():
        family = _platform.device_family(torch.cuda.current_device())
    return frozenset(DEFAULT_TARGETS.get(family, ()))


def recorded_choice(text: str) -> str:
    """What the traced choices record for a $VLLM_SM121_L2_PREFETCH value: the resolved targets,
    sorted ("none" for none), so a family default is hashed as what it is."""
    return ",".join(sorted(targets_from(text))) or "none"


def _split(prefix: str) -> tuple[str, int]:
    m = re.fullmatch(r"(.*?)(\d+)", prefix)
    if m is None:
        raise ValueError(f"L2 prefetch: block prefix {prefix!r} does not end in a layer index")
    return m.group(1), int(m.group(2))


def next_prefix(prefix: str) -> str:
    """"model.layers.7" -> "model.layers.8" (the block after this one)."""
    stem, i = _split(prefix)
    return f"{stem}{i + 1}"


def install(block: torch.nn.Module, prefix: str, targets: frozenset[str]) -> str:
    """Register gpt-oss block ``block`` (``.attn.qkv_proj``, ``.attn.o_proj``, ``.attn.attn``) built
    under ``prefix`` for ``targets``; returns the key its MoE op passes ("" when the MoE prefetches
    nothing). A block whose attention is not upstream's ``OAIAttention`` layout (no such
    projections) prefetches nothing; that is logged once."""
    if _split(prefix)[1] == 0 or _models[0] < 0:
        _models[0] += 1
    key = f"{_models[0]}:{prefix}"
    parts = [getattr(block.attn, n, None) for n in ("qkv_proj", "o_proj", "attn")]
    if any(not isinstance(p, torch.nn.Module) for p in parts):
        _QKV.pop(key, None)
        _BLOCKS.pop(key, None)
        from vllm.logger import init_logger

        init_logger("vllm.sm121").info_once(
            "gpt-oss: $VLLM_SM121_L2_PREFETCH is not applied: the attention (%s) has no qkv_proj / o_proj / attn "
            "modules", type(block.attn).__name__)
        return ""
    qkv, o_proj, attn = parts
    _QKV[key] = weakref.ref(qkv)
    if "o" in targets:
        object.__setattr__(attn, ATTN_ATTR, weakref.ref(o_proj))
    elif hasattr(attn, ATTN_ATTR):
        object.__delattr__(attn, ATTN_ATTR)
    moe_targets = targets - {"o"}
    if not moe_targets:
        _BLOCKS.pop(key, None)
        return ""
    _BLOCKS[key] = (frozenset(moe_targets), f"{_models[0]}:{next_prefix(prefix)}")
    return key


def attention_prefetch(layer: torch.nn.Module) -> torch.Tensor | None:
    """The weight the attention kernel of vLLM ``Attention`` ``layer`` prefetches (None: nothing)."""
    ref = getattr(layer, ATTN_ATTR, None)
    mod = ref() if ref is not None else None
    return mod.weight if mod is not None else None


def moe_plan(key: str):
    """The MoE op's ``kernels.moe.L2Plan`` for block ``key`` ("" or unknown: None), resolved now
    (no reference to a weight outlives the call)."""
    entry = _BLOCKS.get(key) if key else None
    if entry is None:
        return None
    from vllm_sm121.kernels.moe import L2Plan

    targets, nxt = entry
    ref = _QKV.get(nxt)
    mod = ref() if ref is not None else None
    want_next = bool(targets & {"qkv", "qkv_late"})
    return L2Plan(next_weight=mod.weight if want_next and mod is not None else None, next_late="qkv_late" in targets,
                  w2=bool(targets & {"w2", "w2_late"}), w2_late="w2_late" in targets)
