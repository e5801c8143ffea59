"""kernels/decode_inputs.py (issue 7, stage B building block): advancing decode inputs on the
device equals the torch reference, step after step, across page boundaries, with padded rows,
one or two KV groups of different block sizes. On the GPU if present, else on the CPU under the
Triton interpreter (conftest's ``device`` fixture: without TRITON_INTERPRET, Triton cannot run on CPU
tensors)."""

from __future__ import annotations

import pytest
import torch

from vllm_sm121.kernels.decode_inputs import PAD_SLOT_ID, advance_decode_inputs, advance_decode_inputs_torch



def _state(device, rows, n, block_sizes, token_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    pages = 8
    positions = torch.tensor([15, 16, 31, 0, 47, 5, 62, 3][:rows], dtype=torch.int64)  # 15->16, 31->32 cross pages
    groups = []
    for bs in block_sizes:
        bt = torch.randperm(1000, generator=g)[: rows * pages].reshape(rows, pages).to(torch.int32)
        groups.append((bt, torch.full((rows,), 12345, dtype=torch.int64), bs))
    st = dict(tokens=torch.randint(0, 201088, (rows,), generator=g).to(token_dtype),
              num_reqs=torch.tensor([n], dtype=torch.int32), input_ids=torch.full((rows,), 7, dtype=torch.int32),
              positions=positions, seq_lens=(positions + 1).to(torch.int32))
    to = lambda t: t.to(device)  # noqa: E731
    return {k: to(v) for k, v in st.items()}, [(to(b), to(s), bs) for b, s, bs in groups]


@pytest.mark.interpreter
@pytest.mark.parametrize("block_sizes", [(16,), (16, 32)])
@pytest.mark.parametrize("n", [8, 5, 1])
@pytest.mark.parametrize("token_dtype", [torch.int64, torch.int32])
def test_matches_reference_over_steps(device, block_sizes, n, token_dtype):
    rows = 8
    st, groups = _state(device, rows, n, block_sizes, token_dtype)
    ref_st, ref_groups = _state("cpu", rows, n, block_sizes, token_dtype)
    for _ in range(3):  # three decode steps: positions 15 -> 18 cross a 16-token page
        advance_decode_inputs(st["tokens"], st["num_reqs"], st["input_ids"], st["positions"], st["seq_lens"], groups,
                              rows)
        advance_decode_inputs_torch(ref_st["tokens"], ref_st["num_reqs"], ref_st["input_ids"], ref_st["positions"],
                                    ref_st["seq_lens"], ref_groups, rows)
        for k in ("input_ids", "positions", "seq_lens"):
            assert torch.equal(st[k].cpu(), ref_st[k]), k
        for (_, s, _), (_, rs, _) in zip(groups, ref_groups):
            assert torch.equal(s.cpu(), rs)
    # hand-checked values: row 0 started at position 15 with 16-token pages
    pos0 = 15 + 3
    bt0 = ref_groups[0][0]
    assert int(ref_st["positions"][0]) == pos0 and int(ref_st["seq_lens"][0]) == pos0 + 1
    assert int(ref_groups[0][1][0]) == int(bt0[0, pos0 // 16]) * 16 + pos0 % 16
    assert (ref_groups[0][1][n:] == PAD_SLOT_ID).all() and (ref_st["seq_lens"][n:] == 0).all()


@pytest.mark.interpreter
def test_patches_write_new_pages_before_the_slots_are_read(device):
    rows, n = 8, 5
    st, groups = _state(device, rows, n, (16, 32), torch.int32)
    ref_st, ref_groups = _state("cpu", rows, n, (16, 32), torch.int32)
    # row 0 moves 15 -> 16 (a new 16-token page, column 1); row 2 31 -> 32 (new page in both groups)
    patches = torch.tensor([[0, 0, 1, 901], [0, 2, 2, 902], [1, 2, 1, 903], [1, 7, 0, 904]], dtype=torch.int32)
    advance_decode_inputs(st["tokens"], st["num_reqs"], st["input_ids"], st["positions"], st["seq_lens"], groups,
                          rows, patches=patches.to(device), num_patches=3)
    advance_decode_inputs_torch(ref_st["tokens"], ref_st["num_reqs"], ref_st["input_ids"], ref_st["positions"],
                                ref_st["seq_lens"], ref_groups, rows, patches=patches, num_patches=3)
    for (b, s, _), (rb, rs, _) in zip(groups, ref_groups):
        assert torch.equal(b.cpu(), rb) and torch.equal(s.cpu(), rs)
    assert int(ref_groups[0][1][0]) == 901 * 16 and int(ref_groups[0][1][2]) == 902 * 16
    assert int(ref_groups[1][1][2]) == 903 * 32 and int(ref_groups[1][0][7, 0]) != 904  # only num_patches rows
    with pytest.raises(ValueError, match="patches"):
        advance_decode_inputs(st["tokens"], st["num_reqs"], st["input_ids"], st["positions"], st["seq_lens"], groups,
                              rows, patches=patches.long(), num_patches=3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_patches_are_read_in_place_from_pinned_host_memory():
    """The runner's case: the patch list stays in pinned host memory and the kernel reads it there."""
    rows, n = 8, 5
    st, groups = _state("cuda", rows, n, (16, 32), torch.int32)
    ref_st, ref_groups = _state("cpu", rows, n, (16, 32), torch.int32)
    patches = torch.tensor([[0, 0, 1, 901], [0, 2, 2, 902], [1, 2, 1, 903]], dtype=torch.int32).pin_memory()
    advance_decode_inputs(st["tokens"], st["num_reqs"], st["input_ids"], st["positions"], st["seq_lens"], groups,
                          rows, patches=patches, num_patches=3)
    advance_decode_inputs_torch(ref_st["tokens"], ref_st["num_reqs"], ref_st["input_ids"], ref_st["positions"],
                                ref_st["seq_lens"], ref_groups, rows, patches=patches, num_patches=3)
    for (b, s, _), (rb, rs, _) in zip(groups, ref_groups):
        assert torch.equal(b.cpu(), rb) and torch.equal(s.cpu(), rs)


def test_bad_inputs_are_named():
    st, groups = _state("cpu", 8, 8, (16,), torch.int64)
    with pytest.raises(ValueError, match="positions"):
        advance_decode_inputs(st["tokens"], st["num_reqs"], st["input_ids"], st["positions"].int(), st["seq_lens"],
                              groups, 8)
    with pytest.raises(ValueError, match="num_reqs"):
        advance_decode_inputs(st["tokens"], st["num_reqs"].long(), st["input_ids"], st["positions"], st["seq_lens"],
                              groups, 8)
    with pytest.raises(ValueError, match="1 or 2 KV groups"):
        advance_decode_inputs(st["tokens"], st["num_reqs"], st["input_ids"], st["positions"], st["seq_lens"],
                              groups * 3, 8)
    with pytest.raises(ValueError, match="group 0: slot mapping"):
        advance_decode_inputs(st["tokens"], st["num_reqs"], st["input_ids"], st["positions"], st["seq_lens"],
                              [(groups[0][0], groups[0][1].int(), 16)], 8)
