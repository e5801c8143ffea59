"""L2 prefetch of the next GEMV's weights during kernels that leave the DRAM bus idle.

Why: at one token gpt-oss's dense GEMVs are too short to reach the DRAM bandwidth (H200,
stop-28 profile: qkv 14.7 MB and o 11.8 MB of e4m3 in ~7 us each, ~45% of copy bandwidth; the
same shapes near 4 TB/s only at lm_head size), while the kernel before each of them barely uses
the bus: decode attention at a short context reads a few kB of KV in ~7 us, and the MoE FC2 runs
at ~33% of the bandwidth, bound by instruction issue on an H200. The kernel before a GEMV is given
the GEMV's weight and spreads ``prefetch.global.L2`` hints for it over its programs
(``_prefetch.prefetch_l2``); the GEMV then reads L2. The FC1 of the MoE can likewise warm FC2's
expert rows (it knows the routing).

Targets ($VLLM_SM121_L2_PREFETCH, a comma list, read when the model is built; "none" for none;
parsed, with the per-family defaults, in ``vllm_sm121/l2_plan.py``, which start-up code imports
without loading Triton):

    o        the attention kernel prefetches the layer's o_proj weight, from the splits that see no
             KV (a decode graph's 64 splits at a short context; other launches prefetch nothing)
    qkv      the MoE FC2 (one-token FMA path) prefetches the next layer's qkv_proj weight, as its
             programs start
    qkv_late the same, as its programs finish (after their own weight stream)
    w2       the MoE FC1 (FMA path) prefetches the FC2 weight rows of the experts it routes to, as
             its programs start
    w2_late  the same, as its programs finish

Only hints: an evicted line costs bandwidth, never correctness; outputs are bit-identical with
and without (GPU tests, H100: ``tests/test_l2_prefetch.py``, 5 passed at 0f14146, the attention
ones again at 1f369e5). The interpreter never prefetches (no inline PTX there).

Measured (H100, stop 29), hence off by default on every family:

* ``benchmarks/l2_probe.py`` (0f14146, in graphs, per call): the qkv GEMV takes 8.08 us cold
  and 6.22 us with its weight in L2; o 7.23 / 4.80 us. So at most ~2-2.4 us per GEMV is there
  to win: the GEMVs are limited by their own structure, not only by DRAM. A standalone kernel
  issuing the hints for 14.7 MB ran 4.9 us (11.8 MB: 4.1 us), about the DRAM time of those
  bytes at the card's 2.9 TB/s, whether one hint per 32 or per 128 bytes: a program that issues
  hints is held until the memory system has taken them. After such a prefetch and a 7 us idle
  kernel the GEMVs took 6.89 / 5.65 us.
* gpt-oss-120b batch 1, tg128, one run (d508e2c, ``docs/e2e-120b-l2-h100-d508e2c.json``):
  no prefetch 378.7 tok/s; "o" with every attention program issuing hints before its work
  364.5; "o,qkv_late,w2_late" 354.1. Issuing programs with work of their own wait for the
  hints, which costs more than the GEMV gains. The "o" target was then moved to the idle
  splits only (1f369e5, GPU-tested); that version is not measured end to end.
"""

from __future__ import annotations

import torch

from vllm_sm121 import platform as _platform

LINE = 128  # bytes per prefetch hint (an L2 line; one hint per 32 bytes measured the same, stop 29)
LANES = 128  # hints per program per loop step


def launch_args(t: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, int, dict]:
    """(uint8 pointer tensor, bytes, constexprs) for a kernel with ``pf_ptr, pf_bytes`` arguments
    and PF / PF_LANES / PF_LINE constexprs: off (a dummy pointer) without ``t``, on the interpreter,
    or for an empty tensor. ``t`` must be contiguous (its bytes are prefetched as one range)."""
    if t is None or t.numel() == 0 or _platform.family_of(like) == _platform.INTERPRETER:
        return like, 0, dict(PF=False)
    if not t.is_contiguous() or t.device != like.device:
        raise ValueError(f"L2 prefetch: the tensor must be contiguous on {like.device}, got "
                         f"{'non-contiguous ' if not t.is_contiguous() else ''}{t.dtype} on {t.device}")
    return t.view(-1).view(torch.uint8), t.numel() * t.element_size(), dict(PF=True, PF_LANES=LANES,
                                                                           PF_LINE=LINE)
