"""Triton code for the tile map of the grouped MoE GEMMs (launcher and torch reference:
``moe_align`` / ``moe_align_torch`` in ``kernels/moe.py``; consumer: ``_moe_grouped.py``).

What: from the routed expert ids of P (token, slot) pairs it writes ``sorted_pair`` [P] (pair ids
sorted by expert, stable) and, for NUM_TILES = cdiv(P, BLOCK_M) + min(E, P) tiles,
``tile_expert`` / ``tile_start`` / ``tile_end`` (tile t covers ``sorted_pair[start:end]``, at
most BLOCK_M pairs of one expert; tiles past the used ones are empty).

Why: the torch version takes ~10 small launches (sort, scatter_add, cumsum, searchsorted,
gathers), ~60 us per MoE call on an H100 at small M; this is one launch of one program, still
graph-capturable (static shapes, no host sync).

How (one program, loops over chunks of CHUNK pairs / TILE_CHUNK tiles, everything per expert in
[E_PAD] registers; a gather of such a vector at per-element indices is a one-hot
``where(...).sum``):
  1. counts[e]: sum over the chunks of the one-hot [CHUNK, E_PAD] of the clamped ids.
  2. ends = cumsum(counts), starts = ends - counts (the experts' segments of sorted_pair);
     tiles = cdiv(counts, BLOCK_M), tile_ends = cumsum(tiles), tile_begins = tile_ends - tiles.
  3. Counting sort, chunk by chunk in pair order: a pair's slot is starts[e] + (pairs of e in
     earlier chunks: ``base``) + (pairs of e before it in its chunk: the inclusive cumsum of the
     one-hot along the chunk, minus 1). Pairs of an expert therefore keep their index order --
     exactly torch.sort(stable=True) by expert.
  4. Tile t: expert = #{e < E: tile_ends[e] <= t} (= torch.searchsorted(tile_ends, t,
     right=True)), ec = min(expert, E - 1), start = starts[ec] + (t - tile_begins[ec]) * BLOCK_M,
     end = min(start + BLOCK_M, ends[ec]) if expert < E else start (empty; tile_expert E - 1),
     the torch reference's formulas term by term (start/end in int64, then truncated to int32
     as its ``.int()``).

Identical to ``moe_align_torch``: ids are clamped to [0, E - 1] in their own integer type before
the int32 cast (as ``.long().clamp``), every quantity is an integer count or sum (no rounding, no
order-dependent result), and P < 2**31 keeps the pair positions in int32.
"""

import triton
import triton.language as tl


@triton.jit
def _one_hot(ids_ptr, offs, ok, experts, E: tl.constexpr):
    """int32 [CHUNK, E_PAD]: 1 where pair ``offs`` (clamped to [0, E-1] in its own type, as the
    reference's ``.long().clamp``) routes to expert column; rows past P all zero."""
    ids = tl.load(ids_ptr + offs, mask=ok, other=0)
    ids = tl.minimum(tl.maximum(ids, 0), E - 1).to(tl.int32)
    return ((ids[:, None] == experts[None, :]) & ok[:, None]).to(tl.int32)


@triton.jit
def _moe_align_kernel(
    ids_ptr,  # [P] expert ids (int32 or int64), any values: clamped to [0, E - 1]
    sorted_pair_ptr,  # [P] int32 out: pair ids sorted by expert (stable)
    tile_expert_ptr,  # [NUM_TILES] int32 out
    tile_start_ptr,  # [NUM_TILES] int32 out
    tile_end_ptr,  # [NUM_TILES] int32 out
    P,  # pairs (> 0)
    NUM_TILES,  # cdiv(P, BLOCK_M) + min(E, P)
    E: tl.constexpr,
    E_PAD: tl.constexpr,  # power of two >= E
    BLOCK_M: tl.constexpr,  # pairs per tile
    CHUNK: tl.constexpr,  # pairs per step of the two pair loops (power of two)
    TILE_CHUNK: tl.constexpr,  # tiles per step of the tile loop (power of two)
):
    experts = tl.arange(0, E_PAD)
    lanes = tl.arange(0, CHUNK)

    # 1. pairs per expert
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(0, P, CHUNK):
        offs = c0 + lanes
        ok = offs < P
        hit = _one_hot(ids_ptr, offs, ok, experts, E)
        counts += tl.sum(hit, axis=0)

    # 2. segments and tiles per expert (padding experts: count 0, never counted as tile ends)
    ends = tl.cumsum(counts, axis=0)
    starts = ends - counts
    tiles = (counts + (BLOCK_M - 1)) // BLOCK_M
    tile_ends = tl.cumsum(tiles, axis=0)
    tile_begins = tile_ends - tiles

    # 3. stable counting sort: slot = starts[e] + earlier chunks' pairs of e + rank in the chunk
    base = starts
    for c0 in range(0, P, CHUNK):
        offs = c0 + lanes
        ok = offs < P
        hit = _one_hot(ids_ptr, offs, ok, experts, E)
        rank = tl.cumsum(hit, axis=0)  # inclusive: 1 for the chunk's first pair of its expert
        pos = tl.sum(tl.where(hit != 0, base[None, :] + rank - 1, 0), axis=1)
        tl.store(sorted_pair_ptr + pos, offs, mask=ok)
        base += tl.sum(hit, axis=0)

    # 4. the tile map
    real = experts < E
    t_lanes = tl.arange(0, TILE_CHUNK)
    for t0 in range(0, NUM_TILES, TILE_CHUNK):
        t = t0 + t_lanes
        ok = t < NUM_TILES
        expert = tl.sum(((tile_ends[None, :] <= t[:, None]) & real[None, :]).to(tl.int32), axis=1)
        ec = tl.minimum(expert, E - 1)
        sel = experts[None, :] == ec[:, None]
        e_start = tl.sum(tl.where(sel, starts[None, :], 0), axis=1)
        e_end = tl.sum(tl.where(sel, ends[None, :], 0), axis=1)
        e_tile0 = tl.sum(tl.where(sel, tile_begins[None, :], 0), axis=1)
        start = e_start.to(tl.int64) + (t - e_tile0).to(tl.int64) * BLOCK_M
        end = tl.where(expert < E, tl.minimum(start + BLOCK_M, e_end.to(tl.int64)), start)
        tl.store(tile_expert_ptr + t, ec, mask=ok)
        tl.store(tile_start_ptr + t, start.to(tl.int32), mask=ok)
        tl.store(tile_end_ptr + t, end.to(tl.int32), mask=ok)
