"""Triton code of ``kernels/decode_inputs.py`` (launcher and torch reference there)."""

import triton
import triton.language as tl


@triton.jit
def _slots(bt_ptr, stride_bt, rows, pos, live, BS: tl.constexpr):
    """Slot of position ``pos`` in each row's block table (PAD_SLOT_ID -1 where not ``live``)."""
    page = tl.load(bt_ptr + rows.to(tl.int64) * stride_bt + pos // BS, mask=live, other=0)
    return tl.where(live, page.to(tl.int64) * BS + pos % BS, -1)


@triton.jit(do_not_specialize=["num_patches"])
def _advance_decode_inputs_kernel(
    tokens_ptr,  # [>= P] int64 or int32: the token each row sampled last step (its next input)
    num_reqs_ptr,  # [1] int32: rows in use (read on the device: a graph replays this launch as is)
    input_ids_ptr,  # [>= P] int32
    positions_ptr,  # [>= P] int64: advanced by one in place
    seq_lens_ptr,  # [>= P] int32: advanced by one in place (0 on padded rows, as vLLM pads)
    bt0_ptr, slot0_ptr, stride_bt0,  # KV group 0: block table [rows, pages] int32, slot mapping [>= P] int64
    bt1_ptr, slot1_ptr, stride_bt1,  # KV group 1 (NUM_GROUPS == 2; e.g. gpt-oss's sliding-window layers)
    patches_ptr,  # [num_patches, 4] int32 (group, row, column, page): block-table entries to write first
    num_patches,  # 0: none (then one program may not be enough to order them: the launcher checks)
    P: tl.constexpr,  # padded rows (the graph's batch size)
    BS0: tl.constexpr,
    BS1: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    BLOCK: tl.constexpr,
    MAX_PATCHES: tl.constexpr,  # num_patches <= MAX_PATCHES (the launcher checks)
):
    # new pages first, all entries in one vector load and one scatter store (a pinned host list is
    # read over the bus: one round trip, not one per entry); a single program, so the barrier
    # orders these stores before the table loads below
    p = tl.arange(0, MAX_PATCHES)
    pm = p < num_patches
    pg = tl.load(patches_ptr + 4 * p, mask=pm, other=0)
    prow = tl.load(patches_ptr + 4 * p + 1, mask=pm, other=0).to(tl.int64)
    pcol = tl.load(patches_ptr + 4 * p + 2, mask=pm, other=0)
    page = tl.load(patches_ptr + 4 * p + 3, mask=pm, other=0)
    tl.store(bt0_ptr + prow * stride_bt0 + pcol, page, mask=pm & (pg == 0))
    if NUM_GROUPS > 1:
        tl.store(bt1_ptr + prow * stride_bt1 + pcol, page, mask=pm & (pg != 0))
    tl.debug_barrier()
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_p = rows < P
    live = rows < tl.load(num_reqs_ptr)
    pos = tl.load(positions_ptr + rows, mask=live, other=0) + 1
    tl.store(positions_ptr + rows, pos, mask=live)
    seq = tl.load(seq_lens_ptr + rows, mask=live, other=0) + 1
    tl.store(seq_lens_ptr + rows, tl.where(live, seq, 0), mask=in_p)
    tok = tl.load(tokens_ptr + rows, mask=live, other=0)
    tl.store(input_ids_ptr + rows, tok.to(tl.int32), mask=in_p)
    tl.store(slot0_ptr + rows, _slots(bt0_ptr, stride_bt0, rows, pos, live, BS0), mask=in_p)
    if NUM_GROUPS > 1:
        tl.store(slot1_ptr + rows, _slots(bt1_ptr, stride_bt1, rows, pos, live, BS1), mask=in_p)
