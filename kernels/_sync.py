"""Triton helpers shared by kernels that finish a split computation without a second launch."""

import triton
import triton.language as tl


@triton.jit
def last_to_arrive(cnt_ptr, idx, total):
    """Counts this program in on counter ``idx`` after its stores; True for the one that makes it
    ``total``, which also resets it to 0 for the next launch (a CUDA graph replays the launch). A CTA
    barrier orders every thread's stores before one acq_rel atomic at GPU scope (the release
    publishes them, and the last arrival's acquire sees every other program's); the last program
    then reads the others' stores with ``.cg`` loads (L2: never a stale L1 line)."""
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + idx, 1, sem="acq_rel", scope="gpu")
    last = arrived == total - 1
    if last:
        tl.store(cnt_ptr + idx, 0)
    return last
