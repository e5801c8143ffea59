"""Triton helper: warm the L2 with bytes that a later kernel of the same step reads
(``kernels/l2_prefetch.py`` says why and who prefetches what).

Instruction: ``prefetch.global.L2`` (PTX ISA 2.0; every architecture the plugin targets, no
sm_90-only instruction; sm_90a SASS ``CCTL.E.PF2``), one per LINE bytes per thread, fire and
forget: nothing waits for it and nothing it does changes a result. The interpreter cannot run
inline PTX: the launchers compile it out there (``l2_prefetch.launch_args``).
"""

import triton
import triton.language as tl


@triton.jit
def _prefetch_line(ptrs):
    tl.inline_asm_elementwise(asm="prefetch.global.L2 [$1]; mov.u32 $0, 0;", constraints="=r,l", args=[ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_l2(base_ptr, nbytes, part, nparts, LANES: tl.constexpr, LINE: tl.constexpr):
    """Program ``part`` of ``nparts`` prefetches its share of the ``nbytes`` bytes at ``base_ptr``
    (a uint8 pointer) into L2: lines part, part + nparts, ... in blocks of LANES lines of LINE bytes."""
    offs = tl.arange(0, LANES).to(tl.int64) * LINE
    step = nparts.to(tl.int64) * (LANES * LINE)
    last = nbytes.to(tl.int64) - 1
    for start in range(part.to(tl.int64) * (LANES * LINE), nbytes, step):
        # lines past the end are clamped onto the last byte (a repeated hint, never an address outside)
        _prefetch_line(base_ptr + tl.minimum(start + offs, last))


@triton.jit
def prefetch_l2_grid(base_ptr, nbytes, LANES: tl.constexpr, LINE: tl.constexpr):
    """``prefetch_l2`` with the bytes shared by every program of a 3-D grid."""
    n0 = tl.num_programs(0)
    n1 = tl.num_programs(1)
    part = (tl.program_id(2) * n1 + tl.program_id(1)) * n0 + tl.program_id(0)
    prefetch_l2(base_ptr, nbytes, part, n0 * n1 * tl.num_programs(2), LANES, LINE)
