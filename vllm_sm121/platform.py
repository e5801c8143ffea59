"""Capability -> architecture family, and the per-architecture tile tables (data only).

Architecture
    Every kernel in ``vllm_sm121.kernels`` is Triton, so one source runs on sm_90 (H100/H200,
    where it is tested and measured) and on sm_121 (GB10, the target). What differs between
    the two is data: tile shapes, warps and pipeline stages, chosen here per family.

Constraints
    * sm_12x has ~100 KB of shared memory per block (sm_90: 227 KB), so its prefill tiles use
      fewer pipeline stages.
    * Nothing here may select an sm_90-only instruction (wgmma, TMA) for sm_12x: the tables only
      hold tile sizes; the AOT test (tests/test_aot_compile.py) checks the sm_121a PTX.

Limitations
    sm_12x numbers are not measured (no GB10 here); they are the sm_90 choices cut to fit the
    smaller shared memory.
"""

from __future__ import annotations

import dataclasses
import functools
import os

# Families the plugin runs on, by compute-capability major version.
SM90 = "sm_90"
SM12X = "sm_12x"
# Under TRITON_INTERPRET=1 on the CPU: small tiles keep the interpreter fast.
INTERPRETER = "interpreter"

SUPPORTED_CAPABILITIES = "9.x (Hopper: H100/H200) and 12.x (Blackwell GeForce/GB10: sm_120, sm_121)"


def arch_family(major: int, minor: int = 0) -> str | None:
    """Map a compute capability to a family name, or None when unsupported."""
    if major == 9:
        return SM90
    if major == 12:
        return SM12X
    return None


def is_supported_capability(major: int, minor: int = 0) -> bool:
    return arch_family(major, minor) is not None


@functools.lru_cache(maxsize=None)
def device_family(device_index: int) -> str:
    """The family of a CUDA device; raises a clear error for unsupported GPUs."""
    import torch

    major, minor = torch.cuda.get_device_capability(device_index)
    fam = arch_family(major, minor)
    if fam is None:
        raise ValueError(
            f"vllm-sm121 kernels do not support compute capability {major}.{minor} "
            f"({torch.cuda.get_device_name(device_index)}); supported: {SUPPORTED_CAPABILITIES}"
        )
    return fam


def family_of(tensor) -> str:
    """Family for the device a tensor lives on (INTERPRETER for CPU tensors)."""
    if tensor.device.type != "cuda":
        return INTERPRETER
    return device_family(tensor.device.index if tensor.device.index is not None else 0)


@dataclasses.dataclass(frozen=True)
class AttnTile:
    block_m: int  # query rows per program: (query tokens) x (q heads of one kv head)
    tile_n: int  # KV tokens per inner iteration
    num_warps: int
    num_stages: int


# performance hyper-parameters
# Keyed by (family, kind, head-size bucket). kind: "decode" (<= 16 GQA-packed query rows per KV
# head: decode, short spec-verify), "prefill", and "prefill_sw" (prefill of sliding-window
# layers: few keys per query, so narrower KV tiles). sm_90 rows: measured with
# benchmarks/tune_attention.py on an H200 (2026-11-26, gpt-oss shape, bf16 KV, cold L2):
#   decode  (16, 128, 4, 3): b32 ctx8k 142.7 us vs 187.6 us for (16, 64, 4, 2); b8 ctx32k 141 vs 260
#   prefill (64, 64, 4, 2):  2k prompt 175.8 us vs 183.4 us for (128, 64, 8, 3)
#   prefill_sw (64, 32, 4, 2): 2k prompt, window 128: 40.8 us vs 66.6 us
ATTN_TILES: dict[tuple[str, str, int], AttnTile] = {
    # sm_90
    (SM90, "decode", 64): AttnTile(16, 128, 4, 3),
    (SM90, "decode", 128): AttnTile(16, 64, 4, 3),
    (SM90, "decode", 256): AttnTile(16, 32, 4, 2),
    (SM90, "prefill", 64): AttnTile(64, 64, 4, 2),
    (SM90, "prefill", 128): AttnTile(128, 64, 8, 2),
    (SM90, "prefill", 256): AttnTile(64, 32, 4, 2),
    (SM90, "prefill_sw", 64): AttnTile(64, 32, 4, 2),
    (SM90, "prefill_sw", 128): AttnTile(64, 32, 4, 2),
    (SM90, "prefill_sw", 256): AttnTile(64, 32, 4, 2),
    # nvfp4 pages, decode (benchmarks/tune_kv.py on an H100, 2026-11-27, fp16 operands and the
    # inline-PTX decode): (16, 128, 4, 3) b32 ctx32k 631 us vs 1088 us at (16, 256, 8, 2), the
    # tile of the earlier bf16-operand decode; b8 168 vs 297; b1 ctx128k 92 vs 162.
    (SM90, "decode_nvfp4", 64): AttnTile(16, 128, 4, 3),
    # nvfp4 pages, prefill (benchmarks/tune_kv.py --prefill, H200, 2026-11-27, commit 8d4ba0d, the
    # last 4096-token chunk of a 32k prompt): window None 11819 us vs 13974 us at (64, 64, 4, 2),
    # window 128 181.5 us vs 203.0 at (64, 32, 4, 2); tests/test_fp4_kv.py passed on an H200 with
    # it (commit 09758ed, 154 passed).
    (SM90, "prefill_nvfp4", 64): AttnTile(128, 64, 4, 2),
    (SM90, "prefill_sw_nvfp4", 64): AttnTile(128, 64, 4, 2),
    # sm_12x (not measured: no GB10 here): the sm_90 shapes cut to ~99 KB of shared memory per
    # block (K+V tile bytes x stages), tests/test_aot_compile.py checks the compiled sizes.
    (SM12X, "decode", 64): AttnTile(16, 128, 4, 2),
    (SM12X, "decode", 128): AttnTile(16, 64, 4, 2),
    (SM12X, "decode", 256): AttnTile(16, 32, 4, 2),
    (SM12X, "prefill", 64): AttnTile(64, 64, 4, 2),
    (SM12X, "prefill", 128): AttnTile(64, 64, 4, 2),
    (SM12X, "prefill", 256): AttnTile(32, 32, 4, 1),
    (SM12X, "prefill_sw", 64): AttnTile(64, 32, 4, 2),
    (SM12X, "prefill_sw", 128): AttnTile(64, 32, 4, 2),
    (SM12X, "prefill_sw", 256): AttnTile(32, 32, 4, 1),
    # CPU interpreter: tiny tiles (its cost grows with tile area); TILE_N 32 > page 16 so a
    # tile spans pages, as on the GPU, and null-block masking is exercised.
    (INTERPRETER, "decode", 64): AttnTile(16, 32, 4, 1),
    (INTERPRETER, "decode", 128): AttnTile(16, 16, 4, 1),
    (INTERPRETER, "decode", 256): AttnTile(16, 16, 4, 1),
    (INTERPRETER, "prefill", 64): AttnTile(16, 32, 4, 1),
    (INTERPRETER, "prefill", 128): AttnTile(16, 16, 4, 1),
    (INTERPRETER, "prefill", 256): AttnTile(16, 16, 4, 1),
    (INTERPRETER, "prefill_sw", 64): AttnTile(16, 32, 4, 1),
    (INTERPRETER, "prefill_sw", 128): AttnTile(16, 16, 4, 1),
    (INTERPRETER, "prefill_sw", 256): AttnTile(16, 16, 4, 1),
}

# nvfp4 KV decode: use the hardware e2m1x2 -> f16x2 conversion (cvt.rn.f16x2.e2m1x2, accepted by
# ptxas for sm_121a, rejected for sm_90a) instead of the integer bit trick. It compiles for
# sm_121a (tests/test_aot_compile.py) but has never executed (no sm_12x GPU here), so it stays
# off until a GB10 run checks it against the reference (pytest -m gpu tests/test_fp4_kv.py).
NVFP4_HW_E2M1: dict[str, bool] = {SM12X: False}

# Streaming multiprocessors, for the split-KV heuristic (the launcher reads the real count
# from the device when it has one).
DEFAULT_SM_COUNT = {SM90: 132, SM12X: 48, INTERPRETER: 4}


def sm_count(tensor) -> int:
    """SMs of the GPU ``tensor`` lives on; the family's default on the CPU (the interpreter)."""
    if tensor.device.type == "cuda":
        import torch

        return torch.cuda.get_device_properties(tensor.device).multi_processor_count
    return DEFAULT_SM_COUNT[family_of(tensor)]


ATTN_TILE_ENV = "VLLM_SM121_ATTN_TILE"
ATTN_TILE_KINDS = ("decode", "decode_nvfp4", "prefill", "prefill_sw", "prefill_nvfp4", "prefill_sw_nvfp4")


@functools.lru_cache(maxsize=8)
def parse_attn_tile_env(text: str) -> dict[str, AttnTile]:
    """$VLLM_SM121_ATTN_TILE = "kind=block_m,tile_n,num_warps,num_stages[;kind=...]" -> {kind: tile}
    (every head size; kinds: decode, prefill, prefill_sw and their _nvfp4 variants). For sweeps, and for a
    second, equally correct configuration whose numerics differ only in reduction order (the
    tests' spread measure)."""
    out: dict[str, AttnTile] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        kind, _, vals = part.partition("=")
        kind = kind.strip()
        try:
            nums = [int(v) for v in vals.split(",")]
        except ValueError:
            nums = []
        if kind not in ATTN_TILE_KINDS or len(nums) != 4:
            raise ValueError(f"{ATTN_TILE_ENV}={text!r}: expected kind=block_m,tile_n,num_warps,num_stages[;...] "
                             f"with kind one of {', '.join(ATTN_TILE_KINDS)}; got {part!r}")
        block_m, tile_n, warps, stages = nums
        if not all(v > 0 and v & (v - 1) == 0 for v in (block_m, tile_n, warps)) or block_m < 16 or tile_n < 16 \
                or not 1 <= stages <= 4:
            raise ValueError(f"{ATTN_TILE_ENV}: {part!r}: block_m and tile_n must be powers of two >= 16, "
                             "num_warps a power of two, num_stages 1..4")
        out[kind] = AttnTile(block_m, tile_n, warps, stages)
    return out


def _base_kind(kind: str) -> str:
    """decode_nvfp4 -> decode, prefill_sw_nvfp4 -> prefill_sw; other kinds are their own base."""
    return kind[: -len("_nvfp4")] if kind.endswith("_nvfp4") else kind


def attn_tile(family: str, kind: str, head_size_padded: int) -> AttnTile:
    """The tile of (family, kind, head bucket). A variant kind ("decode_nvfp4", "prefill_nvfp4",
    "prefill_sw_nvfp4") without its own entry uses its base kind's tile. $VLLM_SM121_ATTN_TILE
    overrides the kinds it names; naming a base kind also overrides its variants unless the
    variant is named too (``parse_attn_tile_env``)."""
    base = _base_kind(kind)
    env = os.environ.get(ATTN_TILE_ENV, "").strip()
    if env:
        tiles = parse_attn_tile_env(env)
        tile = tiles.get(kind) or tiles.get(base)
        if tile is not None:
            return tile
    bucket = 64 if head_size_padded <= 64 else (128 if head_size_padded <= 128 else 256)
    key = (family, kind, bucket)
    if key not in ATTN_TILES:
        key = (family, base, bucket)
    return ATTN_TILES[key]
