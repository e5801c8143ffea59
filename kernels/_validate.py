"""Argument checks shared by the launchers: each failure names the argument and what is supported."""

from __future__ import annotations


import torch

from vllm_sm121.envs import env_int  # noqa: F401 (the launchers read their switches with V.env_int)

ACT_DTYPES = (torch.bfloat16, torch.float16)
FP8_DTYPES = (torch.float8_e4m3fn,)
# Head sizes the kernels are built and tested for (padded to a power of two inside).
SUPPORTED_HEAD_SIZES = (32, 64, 80, 96, 128, 160, 192, 256)
# KV page sizes: any multiple of 16 (vLLM's default is 16; sliding-window layers may pick larger).
BLOCK_SIZE_MULTIPLE = 16
MAX_BLOCK_SIZE = 1024

# Programmatic dependent launch of the decode step's plugin kernels (opt-in, $VLLM_SM121_PDL=1, read
# at each launch, i.e. at CUDA-graph capture): each kernel is launched as a programmatic dependent of
# the one before it, issues only loads of weights (never written) before ``griddepcontrol.wait``, and
# lets the next kernel launch right after its wait (so a kernel's pre-wait loads overlap the tail of
# the one before, and at most two kernels' work is in flight). GPU only (sm_90+ and sm_12x).
PDL_ENV = "VLLM_SM121_PDL"


def parse_ints(env: str, text: str, lengths: tuple[int, ...], expected: str) -> list[int]:
    """A comma-separated integer list from ``$env`` (a tile format): its values, or an error naming
    the variable and the ``expected`` format when a value is not an integer or the count is not one
    of ``lengths``."""
    try:
        vals = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        vals = []
    if len(vals) not in lengths:
        raise ValueError(f"{env}={text!r}: expected {expected}")
    return vals


def pdl_launch(t: torch.Tensor) -> dict:
    """The kernels' ``PDL`` flag and Triton's ``launch_pdl`` for a launch on ``t``'s device: {} when
    $VLLM_SM121_PDL is unset / 0 or on the CPU (the interpreter)."""
    if t.device.type != "cuda" or env_int(PDL_ENV, 0) == 0:
        return {}
    return dict(PDL=True, launch_pdl=True)


def check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise ValueError(f"{name}.dtype={str(t.dtype).replace('torch.', '')} is not supported; supported: {names}")


def check_ndim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")


def check_head_size(head_size: int) -> None:
    if head_size not in SUPPORTED_HEAD_SIZES:
        raise ValueError(f"head_size={head_size} is not supported; supported: {SUPPORTED_HEAD_SIZES}")


def check_block_size(block_size: int) -> None:
    if block_size % BLOCK_SIZE_MULTIPLE != 0 or not 0 < block_size <= MAX_BLOCK_SIZE:
        raise ValueError(
            f"block_size={block_size} is not supported; supported: multiples of "
            f"{BLOCK_SIZE_MULTIPLE} up to {MAX_BLOCK_SIZE}"
        )


def check_same_device(**tensors: torch.Tensor | None) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")


def scale_tensor(name: str, scale, device: torch.device) -> torch.Tensor:
    """A per-tensor dequantization scale as a [1] fp32 tensor (graph-safe when given as a tensor)."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"{name} must hold one per-tensor scale, got shape {tuple(scale.shape)}")
        return scale.reshape(1).to(device=device, dtype=torch.float32)
    return torch.full((1,), float(scale), dtype=torch.float32, device=device)


# ---- launcher helpers (host path) ----------------------------------------------------------
def _next_pow2(n: int) -> int:
    """``triton.next_power_of_2`` without its JIT-wrapper call cost (~5 µs a call on the host path)."""
    return 1 << max(0, int(n) - 1).bit_length()


_DUMMY: dict = {}


def _dummy(device: torch.device) -> torch.Tensor:
    """A placeholder for pointer arguments a specialisation never reads (allocated once per device)."""
    t = _DUMMY.get(device)
    if t is None:
        t = _DUMMY[device] = torch.empty(1, dtype=torch.float32, device=device)
    return t


