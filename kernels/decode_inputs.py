"""Advance steady-state decode inputs on the device (issue 7, stage B building block).

Stage B of the whole-model graph mode (``docs/design-whole-model-graph.md``) replays a decode
step with no per-step host input: when the batch is the previous step's, every row's inputs
follow from its last token on the device. ``advance_decode_inputs`` does that in one launch,
graph-capturable (the live row count is read from device memory, not passed as an argument):

    positions[r] += 1;  seq_lens[r] += 1;  input_ids[r] = tokens[r]
    slot_g[r] = block_table_g[r, positions[r] // bs_g] * bs_g + positions[r] % bs_g   (each KV group g)

for r < num_reqs, and for the padded rows num_reqs <= r < P: slot -1 (vLLM's PAD_SLOT_ID),
seq_len 0, input id 0, position unchanged (vLLM's padding). Up to two KV groups with their own
block sizes (gpt-oss: full and sliding-window layers). The block tables must already hold the
page of the new position (the host appends pages as vLLM's scheduler allocates them).

Called by the stage-B fast path of ``vllm_sm121.graph.runner`` as its own launch before the
graph replay (the graphs are shared with stock steps, which prepare their inputs themselves).
"""

from __future__ import annotations

import torch
import triton

from .decode_inputs_details._decode_inputs import _advance_decode_inputs_kernel

PAD_SLOT_ID = -1
BLOCK = 128
MAX_PATCHES = 128  # block-table entries one launch writes (the whole-model runner's budget per steady step)


def _check(tokens, num_reqs, input_ids, positions, seq_lens, groups, rows):
    if not 1 <= len(groups) <= 2:
        raise ValueError(f"1 or 2 KV groups (block_table, slot_mapping, block_size) are supported, got {len(groups)}")
    if num_reqs.numel() != 1 or num_reqs.dtype != torch.int32:
        raise ValueError(f"num_reqs must be a one-element int32 device tensor, got {num_reqs.dtype} {tuple(num_reqs.shape)}")
    if tokens.dtype not in (torch.int32, torch.int64) or tokens.dim() != 1 or tokens.stride(0) != 1:
        raise ValueError(f"tokens: expected a 1-D int32/int64 tensor of stride 1 (one per live row), got {tokens.dtype} "
                         f"{tuple(tokens.shape)} stride {tokens.stride()}")
    for name, t, dtypes in (("input_ids", input_ids, (torch.int32,)),
                            ("positions", positions, (torch.int64,)), ("seq_lens", seq_lens, (torch.int32,))):
        if t.dtype not in dtypes or t.dim() != 1 or t.shape[0] < rows:
            raise ValueError(f"{name}: expected 1-D {'/'.join(map(str, dtypes))} with >= {rows} rows, got "
                             f"{t.dtype} {tuple(t.shape)}")
    for i, (bt, slots, bs) in enumerate(groups):
        if bt.dtype != torch.int32 or bt.dim() != 2 or bt.stride(1) != 1:
            raise ValueError(f"group {i}: block table must be a row-major int32 [rows, pages] tensor, got {bt.dtype} "
                             f"{tuple(bt.shape)}")
        if slots.dtype != torch.int64 or slots.dim() != 1 or slots.shape[0] < rows:
            raise ValueError(f"group {i}: slot mapping must be 1-D int64 with >= {rows} rows")
        if bs <= 0:
            raise ValueError(f"group {i}: block_size must be positive, got {bs}")


def advance_decode_inputs(tokens: torch.Tensor, num_reqs: torch.Tensor, input_ids: torch.Tensor,
                          positions: torch.Tensor, seq_lens: torch.Tensor,
                          groups: list[tuple[torch.Tensor, torch.Tensor, int]], rows: int,
                          patches: torch.Tensor | None = None, num_patches: int = 0) -> None:
    """In place, for the first ``rows`` (P, the padded batch) entries; see the module docstring.
    ``tokens`` needs an entry per live row only. ``groups``: [(block_table int32 [R, pages], slot_mapping int64 [>= P], block_size)].
    ``patches``: int32 [>= num_patches, 4] rows (group, row, column, page) written into the block
    tables before the slots are read (new pages without a copy of the tables; a pinned host tensor
    is read by the kernel in place, so the caller keeps it unchanged until the launch has run)."""
    _check(tokens, num_reqs, input_ids, positions, seq_lens, groups, rows)
    grid = triton.cdiv(rows, BLOCK)
    if num_patches:
        if patches is None or patches.dtype != torch.int32 or patches.dim() != 2 or patches.shape[1] != 4 \
                or patches.shape[0] < num_patches or not patches.is_contiguous():
            raise ValueError(f"patches: expected a contiguous int32 [>= {num_patches}, 4] tensor")
        if grid != 1:
            raise ValueError(f"block-table patches need one program (rows <= {BLOCK}), got rows={rows}")
        if num_patches > MAX_PATCHES:
            raise ValueError(f"at most {MAX_PATCHES} block-table patches per launch, got {num_patches}")
    (bt0, s0, bs0), (bt1, s1, bs1) = groups[0], groups[-1]
    _advance_decode_inputs_kernel[(grid,)](
        tokens, num_reqs, input_ids, positions, seq_lens, bt0, s0, bt0.stride(0), bt1, s1, bt1.stride(0),
        patches if num_patches else num_reqs, num_patches,
        P=rows, BS0=bs0, BS1=bs1, NUM_GROUPS=len(groups), BLOCK=BLOCK, MAX_PATCHES=MAX_PATCHES)


def advance_decode_inputs_torch(tokens, num_reqs, input_ids, positions, seq_lens, groups, rows: int,
                                patches=None, num_patches: int = 0) -> None:
    """Reference (same contract), plain torch on any device."""
    for g, row, col, page in (patches[:num_patches].tolist() if num_patches else []):
        groups[g][0][row, col] = page
    n = int(num_reqs.item())
    positions[:n] += 1
    seq_lens[:n] += 1
    seq_lens[n:rows] = 0
    input_ids[:n] = tokens[:n].to(torch.int32)
    input_ids[n:rows] = 0
    for bt, slots, bs in groups:
        pos = positions[:n]
        pages = bt[torch.arange(n, device=bt.device), (pos // bs)].to(torch.int64)
        slots[:n] = pages * bs + pos % bs
        slots[n:rows] = PAD_SLOT_ID
