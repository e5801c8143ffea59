"""KV-cache write kernel vs its torch reference: bit-exact for bf16 and fp8-e4m3."""

import pytest
import torch

from helpers import FP8
from vllm_sm121.kernels import write_kv_cache, write_kv_cache_torch


def _caches(num_blocks, num_kv_heads, block_size, head_size, dtype, device):
    shape = (num_blocks, 2, num_kv_heads, block_size, head_size)  # the SM121 backend's cache
    kv = torch.zeros(shape, dtype=torch.uint8 if dtype == FP8 else dtype, device=device)
    if dtype == FP8:
        kv = kv.view(FP8)
    return kv


@pytest.mark.interpreter
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("num_kv_heads,head_size,block_size", [(2, 64, 16), (1, 128, 32), (3, 80, 16)])
def test_write_kv_cache_matches_reference(device, kv_dtype, num_kv_heads, head_size, block_size):
    g = torch.Generator().manual_seed(1)
    num_tokens, num_blocks = 7, 5
    # Large values too: fp8 must saturate to +-448, not turn into NaN.
    key = (torch.randn(num_tokens, num_kv_heads, head_size, generator=g) * 30).bfloat16().to(device)
    value = (torch.randn(num_tokens, num_kv_heads, head_size, generator=g) * 0.01).bfloat16().to(device)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[2] = -1  # a padded token: must be skipped
    slots = slots.to(device)
    kv_k = _caches(num_blocks, num_kv_heads, block_size, head_size, kv_dtype, device)
    kv_r = kv_k.clone()
    scales = dict(k_scale=0.25, v_scale=1e-4) if kv_dtype == FP8 else {}
    write_kv_cache(key, value, kv_k[:, 0], kv_k[:, 1], slots, **scales)
    write_kv_cache_torch(key, value, kv_r[:, 0], kv_r[:, 1], slots, **scales)
    if kv_dtype == FP8:
        kv_k, kv_r = kv_k.view(torch.uint8), kv_r.view(torch.uint8)
        assert torch.isfinite(kv_r.view(FP8).float()).all()
    torch.testing.assert_close(kv_k, kv_r, rtol=0, atol=0)
    # The padded token wrote nothing anywhere; the others landed where slot_mapping says.
    assert kv_k.count_nonzero() > 0
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0].cpu()] = True
    untouched = kv_k.cpu().permute(0, 3, 1, 2, 4).reshape(num_blocks * block_size, -1)[~written]
    assert untouched.count_nonzero() == 0


@pytest.mark.interpreter
def test_write_kv_cache_scale_as_tensor(device):
    """Scales given as device tensors (as vLLM's layer._k_scale) give the same bytes as floats."""
    key = torch.randn(3, 2, 64).bfloat16().to(device)
    slots = torch.tensor([0, 5, 17], device=device)
    a = _caches(2, 2, 16, 64, FP8, device)
    b = a.clone()
    write_kv_cache(key, key, a[:, 0], a[:, 1], slots, k_scale=0.5, v_scale=2.0)
    write_kv_cache(key, key, b[:, 0], b[:, 1], slots,
                   k_scale=torch.tensor([0.5], device=device), v_scale=torch.tensor(2.0, device=device))
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(key_dtype=torch.float32), "key.dtype=float32"),
        (dict(head_size=72), "head_size=72"),
        (dict(block_size=24), "block_size=24"),
        (dict(cache_heads=3), "disagrees with key"),
        (dict(no_scale=True), "k_scale and v_scale are required"),
    ],
)
def test_write_kv_cache_bad_input(change, match):
    head_size = change.get("head_size", 64)
    block_size = change.get("block_size", 16)
    key = torch.randn(2, 2, head_size).to(change.get("key_dtype", torch.bfloat16))
    kv_dtype = FP8 if change.get("no_scale") else torch.bfloat16
    kv = _caches(2, change.get("cache_heads", 2), block_size, head_size, kv_dtype, "cpu")
    with pytest.raises(ValueError, match=match):
        write_kv_cache(key, key, kv[:, 0], kv[:, 1], torch.tensor([0, 1]))


def _e4m3_values_and_midpoints() -> torch.Tensor:
    """Every finite e4m3 value, every midpoint between neighbours (ties), and out-of-range values."""
    vals = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    pos = torch.unique(vals[torch.isfinite(vals) & (vals >= 0)])
    mids = (pos[1:] + pos[:-1]) / 2
    mb = mids.bfloat16()
    nudged = torch.cat([torch.nextafter(mb, mb + 1), torch.nextafter(mb, mb - 1)]).float()
    x = torch.cat([pos, mids, nudged, torch.tensor([456.0, 480.0, 8192.0, 2**-10, 2**-11, 3 * 2**-11])])
    return torch.cat([x, -x])


@pytest.mark.interpreter
@pytest.mark.parametrize("soft", [True, False], ids=["software", "hardware"])
def test_fp8_encode_every_code_and_tie(device, soft):
    """The write kernel's e4m3 rounding equals torch's on all codes, all ties, and saturates."""
    if not soft and device != "cuda":
        pytest.skip("Triton's CPU interpreter converts fp32->e4m3 wrongly; the hardware path needs a GPU")
    x = _e4m3_values_and_midpoints()
    n = x.numel()
    heads = 1
    head_size = 64
    tokens = (n + head_size - 1) // head_size
    key = torch.zeros(tokens * head_size)
    key[:n] = x
    key = key.view(tokens, heads, head_size).bfloat16()
    assert torch.equal(key.float().flatten()[:n], x), "test values must be exact in bf16"
    key = key.to(device)
    slots = torch.arange(tokens, device=device)
    blocks = (tokens + 15) // 16
    a = _caches(blocks, heads, 16, head_size, FP8, device)
    b = a.clone()
    write_kv_cache(key, key, a[:, 0], a[:, 1], slots, k_scale=1.0, v_scale=1.0, soft_fp8=soft)
    write_kv_cache_torch(key, key, b[:, 0], b[:, 1], slots, k_scale=1.0, v_scale=1.0)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
