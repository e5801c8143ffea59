"""NVFP4 codec: Triton kernels vs torch references bit-exactly, every code, every tie, and guards."""

import pytest
import torch

from vllm_sm121.kernels.nvfp4 import (
    E2M1_VALUES,
    nvfp4_dequantize,
    nvfp4_dequantize_torch,
    nvfp4_quantize,
    nvfp4_quantize_torch,
)

pytestmark = pytest.mark.interpreter


def test_dequantize_every_byte_and_scale(device):
    """All 256 packed bytes under a spread of e4m3 block scales (incl. 0 and subnormals)."""
    packed = torch.arange(256, dtype=torch.uint8).view(8, 32)  # rows of 64 elements
    scale_bytes = torch.tensor([0, 1, 7, 8, 56, 64, 100, 126], dtype=torch.uint8)  # 0, subnormals, 1.0, 448
    scales = scale_bytes[torch.arange(8 * 4) % 8].view(8, 4).view(torch.float8_e4m3fn)
    g = torch.tensor([0.375])
    ref = nvfp4_dequantize_torch(packed, scales, g)
    out = nvfp4_dequantize(packed.to(device), scales.to(device), g.to(device)).cpu()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_dequantize_oracle_lookup_table():
    """The reference decoder against a hand-written table (low nibble = even element)."""
    packed = torch.tensor([[0x10, 0x7F, 0x9A, 0x00, 0x00, 0x00, 0x00, 0x00]], dtype=torch.uint8)
    scales = torch.tensor([[1.0]]).to(torch.float8_e4m3fn)
    out = nvfp4_dequantize_torch(packed, scales, 1.0)[0, :6].tolist()
    assert out == [0.0, 0.5, -6.0, 6.0, -1.0, -0.5]


def test_quantize_ties_go_to_even_codes(device):
    """A block whose amax is 6*g has scale exactly 1.0: elements land on e2m1 ties directly."""
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 6.0, 7.0]
    expect = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0, 6.0, 6.0]
    x = torch.tensor([ties], dtype=torch.float32)
    x[0, -1] = 6.0  # keep amax = 6 -> scale 1.0 (7.0 would raise the scale)
    expect[-1] = 6.0
    for quant in (nvfp4_quantize_torch, lambda a, g: nvfp4_quantize(a.to(device), g.to(device))):
        packed, scales = quant(x, torch.tensor([1.0]))
        assert scales.float().item() == 1.0
        back = nvfp4_dequantize_torch(packed.cpu(), scales.cpu(), 1.0)[0].tolist()
        assert back == expect


# g = 6 * 448 / (expected amax): block scales in e4m3's range; (300, 1/2688) saturates on purpose.
@pytest.mark.parametrize("magnitude,g,scales_in_range", [
    (1.0, 6.5 / 2688, True), (1e-3, 6.5e-3 / 2688, True), (300.0, 1.0, True),
    (1e-3, 1.0, False),  # underflow: gpt-oss dummy activations with no global scale
    (300.0, 1 / 2688, False),  # saturation
])
def test_quantize_matches_reference_bit_exactly(device, magnitude, g, scales_in_range):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(12, 64, generator=gen) * magnitude).bfloat16()
    x[3] = 0.0  # an all-zero row: scales 0, codes 0, no NaN
    x[5, :16] = torch.tensor(E2M1_VALUES * 2).bfloat16() * magnitude  # exact grid points
    gt = torch.tensor([g])
    packed_ref, scales_ref = nvfp4_quantize_torch(x, gt)
    packed, scales = nvfp4_quantize(x.to(device), gt.to(device))
    torch.testing.assert_close(packed.cpu(), packed_ref, rtol=0, atol=0)
    torch.testing.assert_close(scales.cpu().view(torch.uint8), scales_ref.view(torch.uint8), rtol=0, atol=0)
    back = nvfp4_dequantize_torch(packed_ref, scales_ref, g)
    assert torch.isfinite(back).all()
    # Where the block scale neither saturates (448) nor underflows, each element is within half an
    # e2m1 step (<= amax/6 after the e4m3 scale's own rounding, < 1/16): bound amax/4.
    in_range = ((scales_ref.float() < 448) & (scales_ref.float() > 0.02)).view(12, 4, 1)
    in_range[3] = True  # the zero row: exact
    err = (back - x.float()).abs().view(12, 4, 16)
    amax = x.float().abs().view(12, 4, 16).amax(-1, keepdim=True)
    assert bool(in_range.all()) == scales_in_range
    assert ((err <= amax / 4) | ~in_range).all()


def test_tiny_activations_with_unit_global_scale_underflow_to_zero_not_nan(device):
    """gpt-oss dummy-weight activations (~1e-3) with g = 1: block scales underflow -> zeros, finite."""
    x = torch.full((2, 32), 1e-4).bfloat16()
    packed, scales = nvfp4_quantize(x.to(device), torch.tensor([1.0], device=device))
    assert (scales.cpu().float() == 0).all() and (packed.cpu() == 0).all()
    assert torch.isfinite(nvfp4_dequantize(packed, scales, torch.tensor([1.0], device=device))).all()


def test_bad_input():
    with pytest.raises(ValueError, match="row length 48 is not supported"):
        nvfp4_quantize(torch.zeros(2, 48).bfloat16(), torch.tensor([1.0]))
    with pytest.raises(ValueError, match=r"x.dtype=int32 is not supported"):
        nvfp4_quantize(torch.zeros(2, 32, dtype=torch.int32), torch.tensor([1.0]))
