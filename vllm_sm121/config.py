"""The ``sm121`` options of ``--additional-config``, read and validated in one place.

    vllm serve <gpt-oss> --attention-backend SM121 \\
        --additional-config '{"sm121": {"moe": "mxfp8", "dense_weights": "bf16"}}'

Each option lists every value the design admits and, separately, the values this release
implements. An unknown key or value, or a value that is not implemented yet, is a ``ValueError``
naming the option and what is supported -- never a silent fallback to stock behaviour.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from .envs import env_int

SECTION = "sm121"


@dataclasses.dataclass(frozen=True)
class Option:
    name: str
    values: tuple[str, ...]  # every value of the design (design.md's table)
    implemented: tuple[str, ...]  # the ones this release can run
    default: str | None  # None: decided from the rest of the config (see ``resolve_moe``)
    help: str


from vllm_sm121 import moe as _moe  # noqa: E402  (import-light: READY, the opt-in gate)

OPTIONS: dict[str, Option] = {
    o.name: o
    for o in (
        Option("moe", ("mxfp8", "upstream"), ("upstream",), None,
               "gpt-oss MXFP4 experts with MXFP8 activations (on by default for gpt-oss MXFP4 checkpoints "
               "with --attention-backend SM121 once vllm_sm121.moe.READY; see resolve_moe); 'upstream' keeps vLLM's MoE"),
        Option("dense_weights", ("bf16", "fp8", "mxfp4"), ("bf16", "fp8"), "bf16",
               "gpt-oss qkv / o / lm_head weight format ('fp8': e4m3 + one fp32 scale per output channel, "
               "converted at load time; vllm_sm121/dense/)"),
        Option("cudagraph", ("upstream", "whole_model"), ("upstream", "whole_model"), "upstream",
               "'whole_model': lm_head + sampling inside the FULL decode graph (stage A: greedy batches of "
               "<= 32 requests, single GPU, no speculative decoding; other batches fall back per batch; "
               "vllm_sm121/graph/)"),
    )
}


@dataclasses.dataclass(frozen=True)
class Sm121Config:
    moe: str | None = None
    dense_weights: str = "bf16"
    cudagraph: str = "upstream"

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def implemented(name: str) -> tuple[str, ...]:
    """The values of option ``name`` this process can run: ``OPTIONS[name].implemented``, and every
    value of "moe" while the gated MoE is on (``vllm_sm121.moe.READY``, read now)."""
    opt = OPTIONS[name]
    if name == "moe" and _moe.READY:
        return opt.values
    return opt.implemented


def _where(name: str) -> str:
    return f'--additional-config \'{{"{SECTION}": {{"{name}": ...}}}}\''


def parse(additional_config: dict | None) -> Sm121Config:
    """Validate ``additional_config[SECTION]`` (other sections belong to others and are ignored)."""
    if not additional_config:
        return Sm121Config()
    if not isinstance(additional_config, dict):
        raise ValueError(f"--additional-config must be a JSON object, got {type(additional_config).__name__}")  # noqa: TRY004 (a config error)
    section = additional_config.get(SECTION)
    if section is None:
        return Sm121Config()
    if not isinstance(section, dict):
        msg = f'--additional-config "{SECTION}" must be a JSON object of options ({", ".join(OPTIONS)}), got {section!r}'
        raise ValueError(msg)  # noqa: TRY004 (a config error, reported like the others)
    unknown = sorted(set(section) - set(OPTIONS))
    if unknown:
        raise ValueError(f'--additional-config "{SECTION}": unknown option(s) {unknown}; '
                         f"supported options: {', '.join(OPTIONS)}")
    values = {}
    for name, value in section.items():
        opt, runs = OPTIONS[name], implemented(name)
        if value not in opt.values:
            raise ValueError(f"{_where(name)}: {value!r} is not a valid value for '{name}'; "
                             f"supported: {', '.join(runs)}")
        if value not in runs:
            raise ValueError(f"{_where(name)}: '{name}': {value!r} is not implemented in this vllm-sm121 release; "
                             f"supported now: {', '.join(runs)}")
        values[name] = value
    return Sm121Config(**values)


def from_vllm_config(vllm_config: Any) -> Sm121Config:
    return parse(getattr(vllm_config, "additional_config", None))


def current() -> Sm121Config:
    """Options of the vLLM config being built or run in this process (stock options if none)."""
    from vllm.config import get_current_vllm_config

    return from_vllm_config(get_current_vllm_config())


# ---- choices read from the environment that change the traced graph -------------------------------
# vLLM's compile-cache key hashes additional_config (VllmConfig.compute_hash) but not VLLM_SM121_*
# variables; such choices are copied into additional_config[TRACED_KEY] when the config is checked
# (the CUDA platform's check_and_update_config, compat shim 0006/0007), before anything hashes it.
TRACED_KEY = "sm121_traced"
# gpt-oss's router inside the post-attention norm kernel (vllm_sm121/moe/hook.py); 0 turns it off
ROUTER_IN_NORM_ENV = "VLLM_SM121_ROUTER_IN_NORM"
# gpt-oss's rotary embedding inside the FP8 qkv GEMV's epilogue (vllm_sm121/moe/hook.py) where the
# model allows it (FP8 dense weights, the plugin's MoE block); default on since stop 27 (120b batch 1,
# H200, 0f84732: 401.5 vs 386.0 tok/s); 0 turns it off
ROPE_IN_QKV_ENV = "VLLM_SM121_ROPE_IN_QKV"
# With the rotation there and an nvfp4 KV cache on SM121: the qkv GEMV also writes the k / v heads to
# the cache (no KV-write launch); opt-in (1): GPU-tested, no end-to-end gain measured (stop 28)
KV_IN_QKV_ENV = "VLLM_SM121_KV_IN_QKV"
# With the rotation there (and not the KV write), on one rank: the next layer's input add + RMSNorm is
# carried from FC2's combine into that GEMV at decode (vllm_sm121/moe/carry.py, kernels/next_norm.py);
# default on since stop 33 (120b batch 1, H200, e16211b: 2.258 vs 2.307 ms per step, median); 0 turns it off
NORM_IN_QKV_ENV = "VLLM_SM121_NORM_IN_QKV"
# L2 prefetches of the next GEMV's weights (kernels/l2_prefetch.py): the MoE op's prefetch key is traced
L2_PREFETCH_ENV = "VLLM_SM121_L2_PREFETCH"
# Under tensor / expert parallelism, the plugin's gpt-oss block all-reduces each rank's o_proj and MoE
# share in fp32 and rounds to bf16 once after it (vllm_sm121/moe/hook.py), so TP=2 reproduces TP=1's
# bf16 values up to fp32 summation order; default on since stop 34; 0: upstream's bf16 all-reduce
TP_FP32_REDUCE_ENV = "VLLM_SM121_TP_FP32_REDUCE"
# Under tensor parallelism each rank calibrates its layers' nvfp4 K/V global scales from the max over
# all ranks' KV heads (vLLM's all-gather, first batches only), i.e. TP=1's scales; 0: its own heads
KV_SCALE_TP_MAX_ENV = "VLLM_SM121_KV_SCALE_TP_MAX"
# The nvfp4 K/V global scales are first set from the first batch a layer writes, which is one of
# vLLM's dummy runs (profile / warm-up, every slot -1): so no captured graph carries calibration
# work. Opt-in (1, read at layer construction; stop 37, CPU-tested only): the first batch that
# writes real tokens, outside graph capture, sets them once more from those tokens alone (the
# cache holds nothing real yet), so the scales follow real data, the same on every engine that sees
# the same requests. Not where mixed batches replay FULL graphs (-cc.cudagraph_mode=FULL: a real
# prefill may run in a graph first) nor once the qkv GEMV writes the cache ($VLLM_SM121_KV_IN_QKV).
KV_SCALE_REAL_ENV = "VLLM_SM121_KV_SCALE_REAL"


# Reproducibility mode on a one-rank engine: "tp2" / "ep2" computes o_proj and the MoE as the two
# ranks of --tensor-parallel-size 2 (without / with --enable-expert-parallel) do -- each rank's
# shard of the weights, its fp32 share, the shares summed in fp32 as the all-reduce sums them --
# and the lm_head as the two vocabulary shards (vllm_sm121/tp_invariant.py), so TP=1 and TP=2 give
# the same bits (vllm_sm121/moe/hook.py; slower, opt-in; a traced choice)
TP_INVARIANT_ENV = "VLLM_SM121_TP_INVARIANT"
TP_INVARIANT_MODES = ("tp2", "ep2")


def tp_invariant_choice() -> str:
    """$VLLM_SM121_TP_INVARIANT: "" (off, default), "tp2" or "ep2" (read now)."""
    text = os.environ.get(TP_INVARIANT_ENV, "").strip().lower()
    if text in ("", "0", "off"):
        return ""
    if text not in TP_INVARIANT_MODES:
        raise ValueError(f"${TP_INVARIANT_ENV}={text!r} is not supported; supported: "
                         f"{', '.join(TP_INVARIANT_MODES)} or unset")
    return text


def kv_scale_tp_max() -> bool:
    """$VLLM_SM121_KV_SCALE_TP_MAX (default on; read now)."""
    return _env_flag(KV_SCALE_TP_MAX_ENV, True)


def kv_scale_real() -> bool:
    """$VLLM_SM121_KV_SCALE_REAL (default off; read now)."""
    return _env_flag(KV_SCALE_REAL_ENV, False)


def _env_flag(name: str, default: bool) -> bool:
    return env_int(name, int(default)) != 0


def traced_env_choices() -> dict[str, Any]:
    """The environment's choices that change the traced gpt-oss graph (read now)."""
    return {"router_in_norm": _env_flag(ROUTER_IN_NORM_ENV, True), "rope_in_qkv": _env_flag(ROPE_IN_QKV_ENV, True),
            "kv_in_qkv": _env_flag(KV_IN_QKV_ENV, False), "norm_in_qkv": _env_flag(NORM_IN_QKV_ENV, True),
            "l2_prefetch": _l2_prefetch_choice(), "tp_fp32_reduce": _env_flag(TP_FP32_REDUCE_ENV, True),
            "tp_invariant": tp_invariant_choice()}


def traced_choices(vllm_config: Any) -> dict[str, Any]:
    """The traced choices a model is built with: the config's record (``record_traced_choices``),
    or the environment's where the config cannot hold one."""
    return record_traced_choices(vllm_config) or traced_env_choices()


def _l2_prefetch_choice() -> str:
    from vllm_sm121.l2_plan import recorded_choice

    return recorded_choice(os.environ.get(L2_PREFETCH_ENV, ""))


def record_traced_choices(vllm_config: Any) -> dict[str, Any] | None:
    """Put ``traced_env_choices()`` into ``vllm_config.additional_config[TRACED_KEY]`` unless a
    record is there already (the first record wins: a later one would change the config's hash
    after vLLM may have used it). Returns the record, or None where additional_config is an object
    that hashes itself (then the compile cache cannot tell the choices apart)."""
    extra = getattr(vllm_config, "additional_config", None)
    if extra is None:
        try:
            vllm_config.additional_config = extra = {}
        except (AttributeError, TypeError):
            return None
    if not isinstance(extra, dict):
        return None
    return extra.setdefault(TRACED_KEY, traced_env_choices())
