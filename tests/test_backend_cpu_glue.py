"""Builder -> metadata -> impl -> kernels on the CPU (Triton interpreter): the backend's glue.

Two layers with different hyperparameters (a windowed layer with sinks, a full layer without)
share one builder and one metadata object; each must get its own result, written through the
backend's own KV-cache update, and the split-KV count is chosen per window.
"""

import os
import types

import pytest
import torch

from helpers import assert_close, make_paged_batch
from vllm_sm121.kernels import paged_attention_torch, write_kv_cache_torch

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                       reason="CPU glue test (Triton interpreter); on a GPU, tests/test_e2e_gpu.py covers this path"),
]

HQ, HKV, D, BS = 8, 2, 64, 16


@pytest.fixture
def backend_parts(monkeypatch):
    import vllm.config

    from vllm_sm121.attention.impl import SM121AttentionImpl
    from vllm_sm121.attention.metadata import SM121AttentionMetadataBuilder

    sinks = torch.randn(HQ)
    impls = {
        "model.layers.0.self_attn.attn": SM121AttentionImpl(HQ, D, 0.125, HKV, None, 16, "auto", None, "decoder",
                                                            None, sinks=sinks),
        "model.layers.1.self_attn.attn": SM121AttentionImpl(HQ, D, 1 / 11.3, HKV, None, None, "auto", 30.0,
                                                            "decoder", None),
    }
    for impl in impls.values():
        impl.process_weights_after_loading(torch.bfloat16)
    layers = {n: types.SimpleNamespace(num_heads=HQ, impl=i) for n, i in impls.items()}
    monkeypatch.setattr(vllm.config, "get_layers_from_vllm_config", lambda cfg, cls, names: layers)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: types.SimpleNamespace(multi_processor_count=4))
    cfg = types.SimpleNamespace(model_config=types.SimpleNamespace(max_model_len=4096), parallel_config=None)
    spec = types.SimpleNamespace(num_kv_heads=HKV, head_size=D, block_size=BS)
    builder = SM121AttentionMetadataBuilder(spec, list(impls), cfg, torch.device("cpu"))
    return builder, impls


def _common(b, slot_mapping):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    return CommonAttentionMetadata(
        query_start_loc=b.query_start_loc, query_start_loc_cpu=b.query_start_loc, seq_lens=b.seq_lens,
        num_reqs=b.seq_lens.shape[0], num_actual_tokens=int(b.query_start_loc[-1]), max_query_len=b.max_query_len,
        max_seq_len=b.max_seq_len, block_table_tensor=b.block_table, slot_mapping=slot_mapping,
    )


@pytest.mark.parametrize("q_lens,seq_lens", [([1], [200]), ([1, 5, 20], [70, 33, 20]), ([3, 40, 17], [300, 60, 17])],
                         ids=["decode-long", "mixed", "mixed-long-decodes"])
def test_layers_with_different_hyperparameters_share_one_builder(backend_parts, q_lens, seq_lens, monkeypatch):
    builder, impls = backend_parts
    b = make_paged_batch(q_lens, seq_lens, num_q_heads=HQ, num_kv_heads=HKV, head_size=D, block_size=BS)
    # The new tokens' K/V go through the backend's own cache update (slots of the last q_len positions).
    slots = []
    for i, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
        for pos in range(sl - ql, sl):
            slots.append(int(b.block_table[i, pos // BS]) * BS + pos % BS)
    slot_mapping = torch.tensor(slots + [-1] * 3, dtype=torch.int64)  # 3 padded tokens
    md = builder.build(0, _common(b, slot_mapping))
    assert set(md.num_splits) == {16, None}
    if q_lens == [1]:  # long decode: the full layer splits, the 16-token window does not
        assert md.num_splits[None] > 1 and md.num_splits[16] == 1
    # a mixed batch's leading short queries with long contexts get their own split launch
    assert builder.reorder_batch_threshold == 16  # 64 rows / 4 q heads per KV head
    if seq_lens[0] >= 300:
        monkeypatch.setenv("VLLM_SM121_MIXED_SPLIT", "0")  # the knob: one launch, no decode part
        from vllm_sm121.attention.metadata import SM121AttentionMetadataBuilder

        off = SM121AttentionMetadataBuilder(builder.kv_cache_spec, builder.layer_names, builder.vllm_config,
                                            torch.device("cpu"))
        assert off.build(0, _common(b, slot_mapping)).decode_part is None
        dp = md.decode_part
        assert (dp.num_reqs, dp.num_tokens, dp.max_query_len) == (1, 3, 3)
        assert dp.num_splits[None] > 1 and dp.num_splits[16] == 1
        assert dp.prefill_query_start_loc.tolist() == [0, 40, 57]  # the rest's own offsets
    else:
        assert md.decode_part is None
    g = torch.Generator().manual_seed(3)
    T = b.q.shape[0]
    for name, impl in impls.items():
        kv_cache = torch.stack([b.key_cache, b.value_cache], dim=1).clone()  # [NB, 2, Hkv, BS, D]
        key = torch.randn(T, HKV, D, generator=g).bfloat16()
        value = torch.randn(T, HKV, D, generator=g).bfloat16()
        layer = types.SimpleNamespace(_k_scale=torch.tensor(1.0), _v_scale=torch.tensor(1.0))
        kv_before = kv_cache.clone()
        impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        output = torch.full((T, HQ * D), 7.0, dtype=torch.bfloat16)
        impl.forward(layer, b.q.view(T, HQ * D), key, value, kv_cache, md, output)
        ref_k, ref_v = b.key_cache.clone(), b.value_cache.clone()
        write_kv_cache_torch(key, value, ref_k, ref_v, slot_mapping)
        ref = paged_attention_torch(b.q, ref_k, ref_v, b.block_table, b.query_start_loc, b.seq_lens, scale=impl.scale,
                                    sliding_window=impl.sliding_window, softcap=impl.logits_soft_cap,
                                    sinks=impl._sinks_f32)
        n = int(b.query_start_loc[-1])
        assert_close(output[:n].view(n, HQ, D), ref[:n], what=name)
        # Later calls skip argument validation (check=False): same result.
        assert impl._checked and impl._write_checked
        kv_again = kv_before  # the unchecked write from the same starting cache gives the same bytes
        impl.do_kv_cache_update(layer, key, value, kv_again, slot_mapping)
        torch.testing.assert_close(kv_again, kv_cache, rtol=0, atol=0, equal_nan=True)
        again = torch.full_like(output, 7.0)
        impl.forward(layer, b.q.view(T, HQ * D), key, value, kv_cache, md, again)
        assert torch.equal(again, output)
        torch.testing.assert_close(kv_cache[:, 0], ref_k, rtol=0, atol=0, equal_nan=True)  # null block 0 is NaN
        torch.testing.assert_close(kv_cache[:, 1], ref_v, rtol=0, atol=0, equal_nan=True)
        assert (output[n:] == 7.0).all(), "graph-padding rows were written"


def test_profile_run_without_metadata_returns_output(backend_parts):
    _, impls = backend_parts
    impl = next(iter(impls.values()))
    out = torch.zeros(4, HQ * D, dtype=torch.bfloat16)
    assert impl.forward(None, out, None, None, None, None, out) is out


def test_cudagraph_capture_metadata(backend_parts):
    """Capture builds splits for long contexts (max_model_len) and warms up on 1-token contexts;
    the split workspace views sit at the start of the builder's persistent buffers (stable addresses)."""
    builder, impls = backend_parts
    b = make_paged_batch([1] * 2, [300, 40], num_q_heads=HQ, num_kv_heads=HKV, head_size=D, block_size=BS)
    md = builder.build_for_cudagraph_capture(_common(b, torch.arange(2, dtype=torch.int64)))
    assert md.seq_lens.tolist() == [1, 1]
    assert md.num_splits[None] > 1 and md.num_splits[16] == 1  # long-context splits for the full layer
    splits, ws = md.splits_and_workspace(HQ, D, None)
    assert splits == md.num_splits[None]
    assert ws.acc.data_ptr() == builder._acc.data_ptr() and ws.ml.data_ptr() == builder._ml.data_ptr()
    assert md.splits_and_workspace(HQ, D, 16) == (1, None)


def _slots(b, starts, ends):
    return [int(b.block_table[i, p // BS]) * BS + p % BS for i, (s, e) in enumerate(zip(starts, ends)) for p in range(s, e)]


@pytest.mark.parametrize("layer", ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"])
def test_nvfp4_cache_through_the_backend(backend_parts, layer):
    """--kv-cache-dtype nvfp4: the backend's cache shape, its write (calibrating the layer's global
    scales from the first batch, tiny dummy-weight magnitudes included), and attention on the pages
    match the reference computed on the dequantized cache; the null block is NaN bytes."""
    from vllm_sm121.attention.backend import SM121AttentionBackend
    from vllm_sm121.attention.impl import SM121AttentionImpl
    from vllm_sm121.kernels.fp4_kv import HEADROOM, Nvfp4Pages, fp4_kv_write_torch

    builder, impls = backend_parts
    old = impls[layer]
    impl = SM121AttentionImpl(HQ, D, old.scale, HKV, None, old.sliding_window, "nvfp4", old.logits_soft_cap,
                              "decoder", None, sinks=old.sinks)
    impl.process_weights_after_loading(torch.bfloat16)
    q_lens, seq_lens = [1, 5, 20], [70, 33, 20]
    b = make_paged_batch(q_lens, seq_lens, num_q_heads=HQ, num_kv_heads=HKV, head_size=D, block_size=BS)
    nb = b.key_cache.shape[0]
    kv_cache = torch.zeros(SM121AttentionBackend.get_kv_cache_shape(nb, BS, HKV, D, "nvfp4"), dtype=torch.uint8)
    kv_cache[0] = 0x7F  # null block: e4m3 NaN scales
    layer_ns = types.SimpleNamespace(_k_scale=torch.tensor(1.0), _v_scale=torch.tensor(1.0))
    g = torch.Generator().manual_seed(5)
    # Step 1: the context before the new tokens, at dummy-weight magnitude (~1e-3).
    ctx = _slots(b, [0] * 3, [s - q for s, q in zip(seq_lens, q_lens)])
    k1 = (torch.randn(len(ctx), HKV, D, generator=g) * 1e-3).bfloat16()
    v1 = (torch.randn(len(ctx), HKV, D, generator=g) * 1e-3).bfloat16()
    impl.do_kv_cache_update(layer_ns, k1, v1, kv_cache, torch.tensor(ctx, dtype=torch.int64))
    expect_g = torch.exp2(torch.ceil(torch.log2(torch.stack([k1.abs().amax(), v1.abs().amax()]).float()
                                                 * HEADROOM / (6 * 448))))
    torch.testing.assert_close(impl._g, expect_g)
    assert bool(impl._g_done.all()) and not impl._calibrating
    assert impl._calib_log == [(len(ctx), 0, kv_cache.numel())]  # the batch the scales came from (diagnosis)
    # Step 2: the new tokens (3 graph-padding slots), written and attended in one step.
    new = _slots(b, [s - q for s, q in zip(seq_lens, q_lens)], seq_lens)
    slot_mapping = torch.tensor(new + [-1] * 3, dtype=torch.int64)
    T = len(new) + 3
    k2 = (torch.randn(T, HKV, D, generator=g) * 1e-3).bfloat16()
    v2 = (torch.randn(T, HKV, D, generator=g) * 1e-3).bfloat16()
    md = builder.build(0, _common(b, slot_mapping))
    impl.do_kv_cache_update(layer_ns, k2, v2, kv_cache, slot_mapping)
    torch.testing.assert_close(impl._g, expect_g)  # set once: later batches do not move it
    assert len(impl._calib_log) == 1  # ... nor reach the calibration
    q = (torch.randn(T, HQ, D, generator=g)).bfloat16()
    output = torch.full((T, HQ * D), 7.0, dtype=torch.bfloat16)
    impl.forward(layer_ns, q.view(T, HQ * D), k2, v2, kv_cache, md, output)
    # Reference bytes: the torch writer with the same global scales, on the same cache.
    ref_cache = torch.zeros_like(kv_cache)
    ref_cache[0] = 0x7F
    pk, pv = (Nvfp4Pages.view(ref_cache[:, i], HKV, BS, D, impl._g[i:i + 1]) for i in (0, 1))
    fp4_kv_write_torch(k1, v1, pk, pv, torch.tensor(ctx, dtype=torch.int64))
    fp4_kv_write_torch(k2, v2, pk, pv, slot_mapping)
    assert torch.equal(kv_cache, ref_cache)
    ref = paged_attention_torch(q, pk.dequantize(), pv.dequantize(), b.block_table, b.query_start_loc, b.seq_lens,
                                scale=impl.scale, sliding_window=impl.sliding_window, softcap=impl.logits_soft_cap,
                                sinks=impl._sinks_f32)
    n = int(b.query_start_loc[-1])
    assert_close(output[:n].view(n, HQ, D), ref[:n], what=f"nvfp4 {layer}")
    assert (output[n:] == 7.0).all()
    assert pk.dequantize()[1:].abs().max() > 0  # tiny magnitudes did not underflow to zero


def test_mixed_split_env_values(monkeypatch):
    from vllm_sm121.attention.metadata import MIXED_SPLIT_ENV, mixed_split_enabled

    monkeypatch.delenv(MIXED_SPLIT_ENV, raising=False)
    assert mixed_split_enabled()
    monkeypatch.setenv(MIXED_SPLIT_ENV, "0")
    assert not mixed_split_enabled()
    monkeypatch.setenv(MIXED_SPLIT_ENV, "off")
    with pytest.raises(ValueError, match="VLLM_SM121_MIXED_SPLIT='off' is not supported"):
        mixed_split_enabled()


@pytest.mark.parametrize("opt_in", [False, True])
def test_nvfp4_scales_from_the_first_real_tokens(backend_parts, monkeypatch, opt_in):
    """$VLLM_SM121_KV_SCALE_REAL=1: the warm-up's dummy batch (every slot -1) sets the nvfp4 scales
    first, as without it; the first batch with real slots sets them again from its real rows alone
    (padding rows of any size ignored), once; later batches leave them. Off: the dummy batch's
    scales stay. Refused where mixed batches replay FULL graphs."""
    from vllm.config import CUDAGraphMode

    from vllm_sm121.attention.backend import SM121AttentionBackend
    from vllm_sm121.attention.impl import SM121AttentionImpl
    from vllm_sm121.kernels.fp4_kv import global_scale_for

    monkeypatch.setenv("VLLM_SM121_KV_SCALE_REAL", "1" if opt_in else "0")
    builder, impls = backend_parts
    old = impls["model.layers.0.self_attn.attn"]

    def make():
        impl = SM121AttentionImpl(HQ, D, old.scale, HKV, None, old.sliding_window, "nvfp4", old.logits_soft_cap,
                                  "decoder", None, sinks=old.sinks)
        impl.process_weights_after_loading(torch.bfloat16)
        return impl

    impl = make()
    assert impl._real_scale_pending == opt_in
    kv_cache = torch.zeros(SM121AttentionBackend.get_kv_cache_shape(4, BS, HKV, D, "nvfp4"), dtype=torch.uint8)
    layer_ns = types.SimpleNamespace(_k_scale=torch.tensor(1.0), _v_scale=torch.tensor(1.0))
    g = torch.Generator().manual_seed(11)

    def batch(n, scale):
        return [(torch.randn(n, HKV, D, generator=g) * scale).bfloat16() for _ in range(2)]

    def scales_of(k, v):
        return global_scale_for(torch.stack([k.abs().amax(), v.abs().amax()]).float())

    k0, v0 = batch(6, 10.0)  # a dummy run: large values, no real slot
    impl.do_kv_cache_update(layer_ns, k0, v0, kv_cache, torch.full((6,), -1, dtype=torch.int64))
    torch.testing.assert_close(impl._g, scales_of(k0, v0))
    assert impl._real_scale_pending == opt_in  # (a batch without real slots does not close it)
    k1, v1 = batch(8, 1e-3)  # the first real batch: 5 real tokens, 3 padding rows of large values
    k1[5:], v1[5:] = 1e3, -1e3
    impl.do_kv_cache_update(layer_ns, k1, v1, kv_cache, torch.tensor([16, 17, 18, 33, 34, -1, -1, -1]))
    want = scales_of(k1[:5], v1[:5]) if opt_in else scales_of(k0, v0)
    torch.testing.assert_close(impl._g, want)
    assert not impl._real_scale_pending
    assert impl._calib_log == [(6, 0, kv_cache.numel())] + ([(5, 0, -2)] if opt_in else [])
    k2, v2 = batch(4, 5.0)
    impl.do_kv_cache_update(layer_ns, k2, v2, kv_cache, torch.tensor([19, 20, 35, 36]))
    torch.testing.assert_close(impl._g, want)  # set once
    if opt_in:  # (a stand-in for the engine's config: VllmConfig needs a device platform)
        import vllm.config.vllm as vllm_config_module

        for mode, pending in ((CUDAGraphMode.FULL, False), (CUDAGraphMode.FULL_AND_PIECEWISE, True),
                              (CUDAGraphMode.FULL_DECODE_ONLY, True), (CUDAGraphMode.NONE, True)):
            cfg = types.SimpleNamespace(compilation_config=types.SimpleNamespace(cudagraph_mode=mode))
            monkeypatch.setattr(vllm_config_module, "get_current_vllm_config_or_none", lambda: cfg)
            assert make()._real_scale_pending == pending, mode


@pytest.mark.parametrize("layer", ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"])
def test_nvfp4_decode_write_inside_the_attention_kernel(backend_parts, layer, monkeypatch):
    """$VLLM_SM121_KV_IN_ATTN=1: for a decode batch (one query token per sequence, graph padding after it)
    vLLM's update op leaves the new tokens to the attention launch, which writes them: the cache bytes and
    the output equal the default order (write kernel, then attention). A batch with a longer query still
    takes the write kernel in the update op."""
    import vllm.forward_context as fc

    from vllm_sm121.attention.backend import SM121AttentionBackend
    from vllm_sm121.attention.impl import KV_IN_ATTN_ENV, SM121AttentionImpl

    builder, impls = backend_parts
    old = impls[layer]
    q_lens, seq_lens = [1, 1, 1], [70, 33, 20]
    b = make_paged_batch(q_lens, seq_lens, num_q_heads=HQ, num_kv_heads=HKV, head_size=D, block_size=BS)
    nb = b.key_cache.shape[0]
    g = torch.Generator().manual_seed(9)
    ctx = _slots(b, [0] * 3, [s - 1 for s in seq_lens])
    new = _slots(b, [s - 1 for s in seq_lens], seq_lens)
    slot_mapping = torch.tensor(new + [-1] * 2, dtype=torch.int64)  # 2 graph-padding rows
    k1, v1 = ((torch.randn(len(ctx), HKV, D, generator=g) * 1e-3).bfloat16() for _ in range(2))
    k2, v2 = ((torch.randn(5, HKV, D, generator=g) * 1e-3).bfloat16() for _ in range(2))
    q = torch.randn(5, HQ, D, generator=g).bfloat16()
    layer_ns = types.SimpleNamespace(_k_scale=torch.tensor(1.0), _v_scale=torch.tensor(1.0), layer_name=layer,
                                     kv_cache=None)

    def context(attn_metadata, mode=None):
        """vLLM's forward context as the update op sees it (read through vLLM's get_attention_context)."""
        import vllm.model_executor.layers.attention.attention as va

        ctx = types.SimpleNamespace(attn_metadata=attn_metadata, no_compile_layers={layer: layer_ns},
                                    slot_mapping={}, cudagraph_runtime_mode=mode)
        monkeypatch.setattr(fc, "get_forward_context", lambda: ctx)
        monkeypatch.setattr(va, "get_forward_context", lambda: ctx)

    def step(in_attn: bool):
        monkeypatch.setenv(KV_IN_ATTN_ENV, "1" if in_attn else "0")
        impl = SM121AttentionImpl(HQ, D, old.scale, HKV, None, old.sliding_window, "nvfp4", old.logits_soft_cap,
                                  "decoder", None, sinks=old.sinks)
        impl.process_weights_after_loading(torch.bfloat16)
        assert impl._kv_in_attn == in_attn
        kv_cache = torch.zeros(SM121AttentionBackend.get_kv_cache_shape(nb, BS, HKV, D, "nvfp4"), dtype=torch.uint8)
        monkeypatch.setattr(fc, "is_forward_context_available", lambda: False)
        impl.do_kv_cache_update(layer_ns, k1, v1, kv_cache, torch.tensor(ctx, dtype=torch.int64))  # the context
        md = builder.build(0, _common(b, slot_mapping))
        monkeypatch.setattr(fc, "is_forward_context_available", lambda: True)
        context({layer: md})
        before = kv_cache.clone()
        impl.do_kv_cache_update(layer_ns, k2, v2, kv_cache, slot_mapping)
        assert torch.equal(kv_cache, before) == in_attn  # the update op wrote nothing when the kernel writes
        assert (impl._kv_for_attn is not None) == in_attn
        output = torch.full((5, HQ * D), 7.0, dtype=torch.bfloat16)
        impl.forward(layer_ns, q.view(5, HQ * D), k2, v2, kv_cache, md, output)
        assert impl._kv_for_attn is None
        return kv_cache, output, impl

    c_off, o_off, _ = step(False)
    c_on, o_on, impl = step(True)
    assert torch.equal(c_on, c_off) and torch.equal(o_on, o_off) and (o_on[3:] == 7.0).all()
    # a prefill chunk in the same configuration: the update op writes (the kernel writes decode launches only)
    p = make_paged_batch([4], [20], num_q_heads=HQ, num_kv_heads=HKV, head_size=D, block_size=BS)
    md_p = builder.build(0, _common(p, torch.arange(16, 20, dtype=torch.int64)))
    context({layer: md_p})
    kv_cache = torch.zeros_like(c_on)
    impl.do_kv_cache_update(layer_ns, k2[:4], v2[:4], kv_cache, torch.arange(16, 20, dtype=torch.int64))
    assert impl._kv_for_attn is None and kv_cache.any()
    # graph capture: only a FULL capture (both ops in one graph) hands the write over; a piecewise one may hold
    # the update op in its graph while the attention runs outside it, so the update op writes
    from vllm.config import CUDAGraphMode

    md = builder.build(0, _common(b, slot_mapping))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    for mode, handed in ((CUDAGraphMode.PIECEWISE, False), (CUDAGraphMode.FULL, True)):
        context([{layer: md}], mode)  # (speculative decoding's list form)
        kv_cache = torch.zeros_like(c_on)
        impl.do_kv_cache_update(layer_ns, k2, v2, kv_cache, slot_mapping)
        assert (impl._kv_for_attn is not None) == handed and bool(kv_cache.any()) != handed
        impl._kv_for_attn = None
    # a handover that another step's attention finds (never in vLLM's order) is dropped, not written late
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    context({layer: md})
    kv_cache = torch.zeros_like(c_on)
    impl.do_kv_cache_update(layer_ns, k2, v2, kv_cache, slot_mapping)
    other = builder.build(0, _common(b, slot_mapping))
    impl.forward(layer_ns, q.view(5, HQ * D), k2, v2, kv_cache, other, torch.zeros(5, HQ * D, dtype=torch.bfloat16))
    assert impl._kv_for_attn is None and not kv_cache.any()
