"""NVFP4 KV-cache write: page views match vLLM's page size; the kernel writes the reference's bytes."""

import pytest
import torch

from vllm_sm121 import platform as _platform
from vllm_sm121.kernels.fp4_kv import Nvfp4Pages, fp4_kv_write, fp4_kv_write_torch, nvfp4_full_dim

pytestmark = pytest.mark.interpreter


def test_full_dim_matches_vllm_formula():
    from vllm.utils.torch_utils import nvfp4_kv_cache_full_dim

    for hs in (64, 128, 256):
        assert nvfp4_full_dim(hs) == nvfp4_kv_cache_full_dim(hs)


@pytest.mark.parametrize("num_kv_heads,head_size,block_size", [(2, 64, 16), (1, 128, 32)])
def test_write_matches_reference(device, num_kv_heads, head_size, block_size):
    g = torch.Generator().manual_seed(0)
    nb, T = 4, 6
    cache = torch.zeros(nb, 2, num_kv_heads * block_size * nvfp4_full_dim(head_size), dtype=torch.uint8)
    gk, gv = torch.tensor([5.0 / 2688]), torch.tensor([5e-3 / 2688])  # amax / (6 * 448), with margin
    key = (torch.randn(T, num_kv_heads, head_size, generator=g)).bfloat16()
    value = (torch.randn(T, num_kv_heads, head_size, generator=g) * 1e-3).bfloat16()  # gpt-oss-like tiny
    slots = torch.randperm(nb * block_size, generator=g)[:T]
    slots[1] = -1
    ref = cache.clone()
    pages = lambda c, d: (Nvfp4Pages.view(c[:, 0], num_kv_heads, block_size, head_size, gk.to(d)),  # noqa: E731
                          Nvfp4Pages.view(c[:, 1], num_kv_heads, block_size, head_size, gv.to(d)))
    fp4_kv_write_torch(key, value, *pages(ref, "cpu"), slots)
    dev_cache = cache.to(device)
    fp4_kv_write(key.to(device), value.to(device), *pages(dev_cache, device), slots.to(device))
    torch.testing.assert_close(dev_cache.cpu(), ref, rtol=0, atol=0)
    # The written tokens decode close to what was written (K: unit scale, V: 1e-3 scale, both in range).
    kp, vp = pages(ref, "cpu")
    for t in range(T):
        s = int(slots[t])
        if s < 0:
            continue
        k_back = kp.dequantize()[s // block_size, :, s % block_size]
        v_back = vp.dequantize()[s // block_size, :, s % block_size]
        assert (k_back - key[t].float()).abs().max() <= key[t].float().abs().max() / 4
        assert (v_back - value[t].float()).abs().max() <= value[t].float().abs().max() / 4
    assert ref.count_nonzero() > 0


def test_page_view_rejects_wrong_size():
    side = torch.zeros(3, 100, dtype=torch.uint8)
    with pytest.raises(ValueError, match="holds 100 bytes"):
        Nvfp4Pages.view(side, 2, 16, 64, torch.tensor([1.0]))


@pytest.mark.parametrize("kind,q_lens,seq_lens,window,splits", [
    ("decode", [1, 1], [40, 17], None, None),
    ("prefill", [24, 9], [60, 9], None, None),
    ("mixed", [1, 6, 20], [50, 30, 20], 16, None),
    ("decode-split", [1], [70], None, 2),
    ("decode-split-short", [1, 1], [20, 70], None, 4),  # one live split finishing its rows, and a merge
])
@pytest.mark.parametrize("variant", ["gather", "vec", "asm", "fp16-q", "words", "words-fp16-q", "words-triton",
                                     "scale-words", "scale-words-fp16-q"])
def test_attention_reads_nvfp4_pages(device, kind, q_lens, seq_lens, window, splits, variant, monkeypatch):
    """The attention kernel dequantizes NVFP4 pages in registers: it matches the reference on the
    same pages (dequantized by torch), so the tolerance measures the kernel only. Both page-load
    variants (strided gathers, contiguous rows) are checked, and the inline-PTX decode (NVFP4_ASM,
    GPU only: the interpreter cannot run inline PTX). "fp16-q": an fp16 model, which also runs the
    fp16-operand MMA path under the interpreter (bf16 q takes fp32 dots there). "words": 32-bit
    page words decoded through e4m3 bytes (NVFP4_WORDS; inline PTX on an sm_90 GPU, its Triton
    form under the interpreter; "words-triton" runs that Triton form on the GPU). "scale-words": the
    gathers (with the inline-PTX decode on an sm_90 GPU) loading each token's block scales as one
    int32 (NVFP4_SCALE_WORDS)."""
    import sys

    if variant == "asm" and device == "cpu":
        pytest.skip("inline PTX: GPU only")
    if variant == "words-triton" and device == "cpu":
        pytest.skip("the interpreter runs the Triton form for \"words\" already")
    module = sys.modules["vllm_sm121.kernels.paged_attention"]
    monkeypatch.setattr(module, "NVFP4_VEC", variant == "vec")
    monkeypatch.setattr(module, "NVFP4_ASM", variant in ("asm", "words", "words-fp16-q"))  # "words-triton": off
    monkeypatch.setattr(module, "NVFP4_WORDS", variant.startswith("words"))
    # scale-words variants: the int32 scale loads in every launch (prefill too); the others: byte loads
    monkeypatch.setenv(module.ATTN_SCALE_WORDS_ENV, "1" if variant.startswith("scale-words") else "0")
    if variant.startswith("scale-words"):
        monkeypatch.setattr(module, "NVFP4_ASM", True)
    from helpers import assert_close
    from vllm_sm121.kernels import paged_attention, paged_attention_torch

    g = torch.Generator().manual_seed(1)
    hq, hkv, d, bs = 8, 2, 64, 16
    pages_needed = sum((s + bs - 1) // bs for s in seq_lens)
    nb = pages_needed + 2
    cache = torch.zeros(nb, 2, hkv * bs * nvfp4_full_dim(d), dtype=torch.uint8)
    gk, gv = torch.tensor([5.0 / 2688]), torch.tensor([5.0 / 2688])
    kp = Nvfp4Pages.view(cache[:, 0], hkv, bs, d, gk)
    vp = Nvfp4Pages.view(cache[:, 1], hkv, bs, d, gv)
    # Fill every token of every sequence through the reference writer.
    block_table = torch.zeros(len(seq_lens), max((s + bs - 1) // bs for s in seq_lens), dtype=torch.int32)
    nxt = 1
    slots = []
    for i, s in enumerate(seq_lens):
        for p in range((s + bs - 1) // bs):
            block_table[i, p] = nxt
            nxt += 1
        slots += [int(block_table[i, t // bs]) * bs + t % bs for t in range(s)]
    kv = torch.randn(len(slots), 2, hkv, d, generator=g).bfloat16()
    fp4_kv_write_torch(kv[:, 0], kv[:, 1], kp, vp, torch.tensor(slots))
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(torch.float16 if variant.endswith("fp16-q") else torch.bfloat16)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    sinks = torch.randn(hq, generator=g)
    ref = paged_attention_torch(q, kp, vp, block_table, qsl, sl, scale=0.125, sliding_window=window, sinks=sinks)
    dev = lambda t: t.to(device)  # noqa: E731
    dcache = dev(cache)
    kpd = Nvfp4Pages.view(dcache[:, 0], hkv, bs, d, dev(gk))
    vpd = Nvfp4Pages.view(dcache[:, 1], hkv, bs, d, dev(gv))
    out = paged_attention(dev(q), kpd, vpd, dev(block_table), dev(qsl), dev(sl), max_query_len=max(q_lens),
                          max_seq_len=max(seq_lens), scale=0.125, sliding_window=window, sinks=dev(sinks),
                          num_splits=splits)
    # the variant under test is the one that ran (its launcher check passes on these pages)
    for launch_kind in ("decode_nvfp4", "prefill_nvfp4"):
        assert module.nvfp4_scale_words(d, kpd.scales.view(torch.uint8), vpd.scales.view(torch.uint8),
                                        kind=launch_kind) == variant.startswith("scale-words")
    assert_close(out.cpu(), ref, what=kind)


def test_global_scale_calibration_is_set_once_and_never_zero():
    from vllm_sm121.kernels.fp4_kv import HEADROOM, calibrate_global_scales, default_global_scale

    pow2 = lambda x: torch.exp2(torch.ceil(torch.log2(x)))  # noqa: E731

    g = torch.full((2,), default_global_scale())
    done = torch.zeros(2, dtype=torch.bool)
    zeros = torch.zeros(4, 2, 64)
    calibrate_global_scales(zeros, zeros, g, done)  # an all-zero (padding) batch sets nothing
    assert not done.any() and torch.equal(g, torch.full((2,), default_global_scale()))
    k = torch.randn(4, 2, 64, generator=torch.Generator().manual_seed(0)) * 1e-3
    want = lambda x: pow2(x.abs().amax() * (HEADROOM / (6 * 448))).reshape(())  # noqa: E731
    v = torch.full((4, 2, 64), float("nan"))
    calibrate_global_scales(k, v, g, done)  # V non-finite: K set, V left for a later batch
    assert done.tolist() == [True, False]
    torch.testing.assert_close(g[0], want(k), rtol=1e-6, atol=0)
    assert g[0] > 0
    calibrate_global_scales(k * 100, k * 2, g, done)
    assert done.all()
    torch.testing.assert_close(g[0], want(k), rtol=1e-6, atol=0)  # K not moved
    torch.testing.assert_close(g[1], want(k * 2), rtol=1e-6, atol=0)


def test_tp_ranks_calibrate_as_the_unsharded_layer():
    """Under TP each rank holds half the KV heads; with ``reduce_amax`` (the impl passes a max over
    vLLM's TP group) both ranks set the scales TP=1 sets, and agree on ``done``, where their own
    heads alone would give other scales (the second rank's heads here are 8x larger)."""
    from vllm_sm121.kernels.fp4_kv import calibrate_global_scales, default_global_scale

    gen = torch.Generator().manual_seed(3)
    k = torch.randn(5, 4, 64, generator=gen) * torch.tensor([1.0, 1.0, 8.0, 8.0])[None, :, None]
    v = torch.randn(5, 4, 64, generator=gen) * torch.tensor([3.0, 3.0, 0.5, 0.5])[None, :, None]

    def calibrated(key, value, reduce_amax=None):
        g, done = torch.full((2,), default_global_scale()), torch.zeros(2, dtype=torch.bool)
        calibrate_global_scales(key, value, g, done, reduce_amax=reduce_amax)
        return g, done

    whole, _ = calibrated(k, v)
    halves = [(k[:, :2], v[:, :2]), (k[:, 2:], v[:, 2:])]
    amaxes = [torch.stack([a.abs().amax(), b.abs().amax()]) for a, b in halves]
    group_max = lambda a: torch.stack(amaxes).amax(0)  # noqa: E731  (what the all-gather + max returns)
    for a, b in halves:
        g, done = calibrated(a, b, group_max)
        assert torch.equal(g, whole) and done.all()
    own = [calibrated(a, b)[0] for a, b in halves]
    assert not torch.equal(own[0], whole) and not torch.equal(own[1], whole)  # the test can fail


def test_impl_reduces_the_calibration_amax_over_the_tp_group(monkeypatch):
    """``impl._tp_amax``: None on one rank, without vLLM's groups or with the variable off; under TP
    the max of vLLM's all-gather (the stand-in returns this rank's [1, 2] and another rank's)."""
    import vllm.distributed
    import vllm.distributed.parallel_state as ps

    from vllm_sm121.attention.impl import _tp_amax

    assert _tp_amax() is None  # no model-parallel groups (CPU tests)
    other = torch.tensor([[5.0, 0.25]])
    gathered = []

    def all_gather(t, dim=-1):
        gathered.append((tuple(t.shape), dim))
        return torch.cat([t, other], dim=dim)

    monkeypatch.setattr(ps, "model_parallel_is_initialized", lambda: True)
    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(vllm.distributed, "tensor_model_parallel_all_gather", all_gather)
    monkeypatch.delenv("VLLM_SM121_KV_SCALE_TP_MAX", raising=False)
    assert torch.equal(_tp_amax()(torch.tensor([2.0, 1.0])), torch.tensor([5.0, 1.0]))
    assert gathered == [((1, 2), 0)]
    monkeypatch.setenv("VLLM_SM121_KV_SCALE_TP_MAX", "0")
    assert _tp_amax() is None
    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.delenv("VLLM_SM121_KV_SCALE_TP_MAX")
    assert _tp_amax() is None


def test_power_of_two_global_scales_store_the_same_values():
    """Two calibrations (other batch, other tensor-parallel head split) give scales 2**k apart:
    the dequantized cache is bit-identical for blocks whose e4m3 scale stays normal."""
    from vllm_sm121.kernels.fp4_kv import global_scale_for
    from vllm_sm121.kernels.nvfp4 import nvfp4_dequantize_torch, nvfp4_quantize_torch

    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 64, generator=g) * torch.logspace(-1, 1, 64)[:, None]  # rows 100x apart
    g1 = global_scale_for(x.abs().amax())
    g2 = global_scale_for(x[:40].abs().amax())  # "rank 0's heads": a smaller amax, within HEADROOM
    assert g1 != g2 and torch.log2(g1 / g2) == torch.round(torch.log2(g1 / g2))
    out = [nvfp4_dequantize_torch(*nvfp4_quantize_torch(x, s), s) for s in (g1, g2)]
    assert torch.equal(out[0], out[1])
    arbitrary = float(g1) * 0.77  # a non-power-of-two scale stores different values
    assert not torch.equal(out[0], nvfp4_dequantize_torch(*nvfp4_quantize_torch(x, arbitrary), arbitrary))


def test_scale_words_switch(monkeypatch):
    """The int32 scale loads: on for decode launches by default, $VLLM_SM121_ATTN_SCALE_WORDS=1 for
    every launch and 0 for none, only for 64-wide heads and 4-byte aligned scale rows; other values
    are rejected by name."""
    import sys

    module = sys.modules["vllm_sm121.kernels.paged_attention"]
    cache = torch.zeros(3, 2 * 16 * nvfp4_full_dim(64), dtype=torch.uint8)
    sc = Nvfp4Pages.view(cache, 2, 16, 64, torch.tensor([1.0])).scales.view(torch.uint8)
    monkeypatch.delenv(module.ATTN_SCALE_WORDS_ENV, raising=False)
    assert module.NVFP4_SCALE_WORDS  # the default: decode launches only
    assert module.nvfp4_scale_words(64, sc, sc, kind="decode_nvfp4")
    assert not module.nvfp4_scale_words(64, sc, sc, kind="prefill_nvfp4")
    assert not module.nvfp4_scale_words(64, sc, sc, kind="prefill_sw_nvfp4")
    monkeypatch.setenv(module.ATTN_SCALE_WORDS_ENV, "1")
    assert module.nvfp4_scale_words(64, sc, sc)
    assert module.nvfp4_scale_words(64, sc, sc, kind="prefill_nvfp4")
    assert not module.nvfp4_scale_words(128, sc, sc)
    assert not module.nvfp4_scale_words(64, sc[:, :, :, 1:], sc)  # rows no longer 4-byte aligned
    monkeypatch.setenv(module.ATTN_SCALE_WORDS_ENV, "0")
    assert not module.nvfp4_scale_words(64, sc, sc)
    monkeypatch.setenv(module.ATTN_SCALE_WORDS_ENV, "2")
    with pytest.raises(ValueError, match=module.ATTN_SCALE_WORDS_ENV):
        module.nvfp4_scale_words(64, sc, sc)


def test_nvfp4_refuses_kv_sharing_layers():
    """A KV-sharing layer would read another layer's nvfp4 cache with global scales it never
    calibrated: refused at construction, naming the flag and what works with sharing."""
    from vllm_sm121.attention.impl import SM121AttentionImpl

    with pytest.raises(ValueError, match="--kv-cache-dtype nvfp4: KV-cache sharing .*model.layers.0.attn"):
        SM121AttentionImpl(8, 64, 0.125, 2, None, None, "nvfp4", None, "decoder", "model.layers.0.attn")
    SM121AttentionImpl(8, 64, 0.125, 2, None, None, "auto", None, "decoder", "model.layers.0.attn")  # bf16: fine


@pytest.mark.parametrize("seq_lens,window,splits,fused,hq", [
    ([40, 17, 1], None, None, False, 8),  # one split: every program writes its sequence's token
    ([70, 33], 16, None, False, 8),  # sliding window
    ([20, 70], None, 4, True, 8),  # split KV, in-kernel merge: only the split reading the last tile writes
    ([70, 5], None, 4, False, 8),  # split KV, merge launch; the short sequence's splits past its end stay idle
    ([150, 40], None, 2, True, 16),  # gpt-oss's 8 query heads per KV head (2 query tokens per program), 2 tiles
])
def test_attention_writes_the_new_decode_tokens(device, seq_lens, window, splits, fused, hq):
    """``paged_attention(..., kv_write=...)`` (decode: one query token per sequence): the kernel writes each
    sequence's new token into its nvfp4 slot before reading it. The cache bytes and the output equal those
    of ``fp4_kv_write`` followed by the attention (graph padding included: a padding query row whose slot
    is -1, and a padding sequence with no query token, write nothing); refused for longer queries and for
    bf16 pages."""
    from vllm_sm121.kernels import paged_attention
    from vllm_sm121.kernels.paged_attention import SplitWorkspace

    g = torch.Generator().manual_seed(11)
    hkv, d, bs = 2, 64, 16
    lens = seq_lens + [0]  # a padding sequence (no query token)
    pages = [(s + bs - 1) // bs for s in lens]
    block_table = torch.zeros(len(lens), max(max(pages), 1), dtype=torch.int32)
    nxt = 1
    for i, n in enumerate(pages):
        for p in range(n):
            block_table[i, p] = nxt
            nxt += 1
    slot = lambda i, t: int(block_table[i, t // bs]) * bs + t % bs  # noqa: E731
    cache = torch.zeros(nxt + 1, 2, hkv * bs * nvfp4_full_dim(d), dtype=torch.uint8)
    gk, gv = torch.tensor([5.0 / 2688]), torch.tensor([3.0 / 2688])
    kp, vp = (Nvfp4Pages.view(cache[:, i], hkv, bs, d, s) for i, s in ((0, gk), (1, gv)))
    ctx = [slot(i, t) for i, s in enumerate(seq_lens) for t in range(s - 1)]
    kv = torch.randn(len(ctx), 2, hkv, d, generator=g).bfloat16()
    fp4_kv_write_torch(kv[:, 0], kv[:, 1], kp, vp, torch.tensor(ctx))
    n_q = len(seq_lens) + 1  # one query token per sequence, then a padding row
    new_slots = torch.tensor([slot(i, s - 1) for i, s in enumerate(seq_lens)] + [-1], dtype=torch.int64)
    # k and v as vLLM hands them over: strided views of the qkv GEMM's output rows
    qkv = torch.randn(n_q, (hq + 2 * hkv) * d, generator=g).bfloat16()
    q, key, value = (t.view(n_q, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    qsl = torch.tensor(list(range(len(seq_lens) + 1)) + [len(seq_lens)], dtype=torch.int32)
    sl = torch.tensor(lens, dtype=torch.int32)
    sinks = torch.randn(hq, generator=g)
    dev = lambda t: t if t.device.type == device else t.to(device)  # noqa: E731
    if device != "cpu":  # the strided views on the device, as vLLM's
        qkv = qkv.to(device)
        q, key, value = (t.view(n_q, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    tile = _platform.AttnTile(16, 64, 4, 1) if len(seq_lens) == 2 and hq == 16 else None  # (several tiles per split)

    def run(in_kernel: bool):
        c = dev(cache.clone())
        kpd, vpd = (Nvfp4Pages.view(c[:, i], hkv, bs, d, dev(s)) for i, s in ((0, gk), (1, gv)))
        ws = SplitWorkspace.allocate(n_q, hq, splits, d, c.device) if splits else None
        if not fused and ws is not None:
            ws.cnt = None
        out = torch.full((n_q, hq, d), 7.0, dtype=torch.bfloat16, device=c.device)
        if not in_kernel:
            fp4_kv_write(dev(key), dev(value), kpd, vpd, dev(new_slots))
        paged_attention(dev(q), kpd, vpd, dev(block_table), dev(qsl), dev(sl), max_query_len=1,
                        max_seq_len=max(lens), scale=0.125, sliding_window=window, sinks=dev(sinks),
                        num_splits=splits, workspace=ws, out=out, tile=tile,
                        kv_write=(dev(key), dev(value), dev(new_slots)) if in_kernel else None)
        return c.cpu(), out.cpu()

    (c_ref, o_ref), (c_got, o_got) = run(False), run(True)
    assert torch.equal(c_got, c_ref)
    assert torch.equal(o_got, o_ref) and (o_ref[-1] == 7.0).all() and o_ref[:-1].float().abs().max() > 0
    assert not torch.equal(c_ref, cache)  # the new tokens were written at all
    kpd, vpd = (Nvfp4Pages.view(dev(cache)[:, i], hkv, bs, d, dev(gk)) for i in (0, 1))
    args = (dev(q), kpd, vpd, dev(block_table), dev(qsl), dev(sl))
    with pytest.raises(ValueError, match="max_query_len=1"):
        paged_attention(*args, max_query_len=2, max_seq_len=max(lens), scale=0.125,
                        kv_write=(dev(key), dev(value), dev(new_slots)))
    with pytest.raises(ValueError, match="nvfp4 pages"):
        bf16 = dev(torch.zeros(nxt + 1, hkv, bs, d, dtype=torch.bfloat16))
        paged_attention(dev(q), bf16, bf16, *args[3:], max_query_len=1, max_seq_len=max(lens), scale=0.125,
                        kv_write=(dev(key), dev(value), dev(new_slots)))


@pytest.mark.gpu
@pytest.mark.parametrize("window,splits,fused", [(None, 16, True), (None, 16, False), (128, 4, True),
                                                 (None, None, False)])
def test_attention_kv_write_on_the_gpu_at_gpt_oss_shapes(window, splits, fused):
    """The in-kernel decode KV write on a GPU, where programs run concurrently (the interpreter runs them one
    after another): gpt-oss-120b's attention shape (64 query heads, 8 KV heads, head size 64, 16-token pages in a
    shuffled order), contexts from 1 to 3000 tokens over several 128-token tiles and splits; each new token's slot
    holds stale bytes first. 20 launches must each give the cache bytes and outputs of write kernel +
    attention."""
    from vllm_sm121.kernels import paged_attention
    from vllm_sm121.kernels.paged_attention import SplitWorkspace

    dev = "cuda"
    torch.manual_seed(0)
    hq, hkv, d, bs = 64, 8, 64, 16
    lens = [3000, 700, 129, 1, 33, 1500]
    n = len(lens)
    pages = [(s + bs - 1) // bs for s in lens]
    order = torch.randperm(sum(pages)) + 1
    block_table = torch.zeros(n + 1, max(pages), dtype=torch.int32)  # (+ a padding sequence's row)
    at = 0
    for i, p in enumerate(pages):
        block_table[i, :p] = order[at:at + p]
        at += p
    slot = lambda i, t: int(block_table[i, t // bs]) * bs + t % bs  # noqa: E731
    cache0 = torch.randint(0, 256, (sum(pages) + 1, 2, hkv * bs * nvfp4_full_dim(d)), dtype=torch.uint8, device=dev)
    g = torch.tensor([2.0 ** -7], device=dev)
    views = lambda c: [Nvfp4Pages.view(c[:, j], hkv, bs, d, g) for j in (0, 1)]  # noqa: E731
    ctx = torch.tensor([slot(i, t) for i, s in enumerate(lens) for t in range(s - 1)], device=dev)
    rnd = lambda *shape: torch.randn(*shape, device=dev).bfloat16()  # noqa: E731
    fp4_kv_write(rnd(len(ctx), hkv, d), rnd(len(ctx), hkv, d), *views(cache0), ctx)  # (new slots keep stale bytes)
    new = torch.tensor([slot(i, s - 1) for i, s in enumerate(lens)] + [-1], device=dev)
    qkv = rnd(n + 1, (hq + 2 * hkv) * d)
    q, key, value = (t.view(n + 1, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    qsl = torch.tensor(list(range(n + 1)) + [n], dtype=torch.int32, device=dev)
    seq_lens = torch.tensor(lens + [0], dtype=torch.int32, device=dev)
    sinks = torch.randn(hq, device=dev)

    def run(in_kernel: bool):
        c = cache0.clone()
        ws = SplitWorkspace.allocate(n + 1, hq, splits, d, c.device) if splits else None
        if ws is not None and not fused:
            ws.cnt = None
        out = torch.full((n + 1, hq, d), 7.0, dtype=torch.bfloat16, device=dev)
        if not in_kernel:
            fp4_kv_write(key, value, *views(c), new)
        paged_attention(q, *views(c), block_table.to(dev), qsl, seq_lens, max_query_len=1, max_seq_len=max(lens),
                        scale=0.125, sliding_window=window, sinks=sinks, num_splits=splits, workspace=ws, out=out,
                        kv_write=(key, value, new) if in_kernel else None)
        return c, out

    c_ref, o_ref = run(False)
    assert torch.isfinite(o_ref[:n].float()).all()
    bad = sum(int(not (torch.equal(c, c_ref) and torch.equal(o, o_ref))) for c, o in (run(True) for _ in range(20)))
    assert bad == 0, f"{bad} of 20 in-kernel writes differ from write kernel + attention"
