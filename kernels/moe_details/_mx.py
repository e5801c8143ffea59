"""MX tile loaders shared by the MoE kernels (launchers and references: ``kernels/moe.py``).

Every loader returns fp32 values exactly as the MX formats define them, so the CUDA-core
(decode) and ``tl.dot`` (grouped) kernels see the same operands: an e4m3 or e2m1 code times a
power of two is exact in fp32 and in bf16. e8m0 byte 0 (2**-127) is read as 2**-126, as in
``_codecs.mx_row_dot`` (only all-zero blocks use it).
"""

import triton
import triton.language as tl

from ..kv_cache_details._codecs import _pow2, e2m1_decode, mxfp8_quantize_rows


@triton.jit
def load_mxfp4_tile(w_ptr, w_scale_ptr, w_rows, row_ok, k0, K: tl.constexpr, ROWS: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """Rows ``w_rows`` [ROWS] of a row-major MXFP4 matrix ([*, K/2] e2m1 pairs, low nibble first,
    + [*, K/32] e8m0), columns k0 .. k0+BLOCK_K -> fp32 [ROWS, BLOCK_K]."""
    offs_kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    wq = tl.load(w_ptr + w_rows[:, None] * (K // 2) + offs_kb[None, :],
                 mask=row_ok[:, None] & (offs_kb[None, :] < K // 2), other=0).to(tl.int32)
    w = tl.reshape(tl.join(e2m1_decode(wq), e2m1_decode(wq >> 4)), [ROWS, BLOCK_K // 32, 32])
    offs_kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    w_e = tl.load(w_scale_ptr + w_rows[:, None] * (K // 32) + offs_kg[None, :],
                  mask=row_ok[:, None] & (offs_kg[None, :] < K // 32), other=127).to(tl.int32) - 127
    return tl.reshape(w * _pow2(tl.maximum(w_e, -126))[:, :, None], [ROWS, BLOCK_K])


@triton.jit
def mxfp8_roundtrip(x, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 [ROWS, BLOCK_K] -> the fp32 values its MXFP8 encoding (e4m3 + e8m0 per 32) decodes to.

    This is the FC1 prologue when the MoE is handed bf16 activations: the same numbers the fused
    norm's MXFP8 output would give, with no quantized copy written to memory.
    """
    codes, scales = mxfp8_quantize_rows(x, ROWS, BLOCK_K // 32)
    vals = tl.reshape(codes.to(tl.float8e4nv, bitcast=True).to(tl.float32), [ROWS, BLOCK_K // 32, 32])
    e = tl.maximum(scales.to(tl.int32) - 127, -126)
    return tl.reshape(vals * _pow2(e)[:, :, None], [ROWS, BLOCK_K])


@triton.jit
def load_act_tile(a_ptr, a_scale_ptr, rows, row_ok, k0, K: tl.constexpr, ROWS: tl.constexpr,
                  BLOCK_K: tl.constexpr, A_MXFP8: tl.constexpr):
    """Rows ``rows`` of contiguous activations [*, K], columns k0 .. k0+BLOCK_K -> fp32 [ROWS, BLOCK_K].

    A_MXFP8: e4m3 bytes + [*, K/32] e8m0 scales, dequantized. Else bf16, quantized to MXFP8 and
    back in registers (``mxfp8_roundtrip``), so both inputs give MXFP8-valued operands.
    """
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = row_ok[:, None] & (offs_k[None, :] < K)
    if A_MXFP8:
        a = tl.load(a_ptr + rows[:, None] * K + offs_k[None, :], mask=mask, other=0)
        a = tl.reshape(a.to(tl.float8e4nv, bitcast=True).to(tl.float32), [ROWS, BLOCK_K // 32, 32])
        offs_kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        a_e = tl.load(a_scale_ptr + rows[:, None] * (K // 32) + offs_kg[None, :],
                      mask=row_ok[:, None] & (offs_kg[None, :] < K // 32), other=127).to(tl.int32) - 127
        return tl.reshape(a * _pow2(tl.maximum(a_e, -126))[:, :, None], [ROWS, BLOCK_K])
    else:
        a = tl.load(a_ptr + rows[:, None] * K + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        return mxfp8_roundtrip(a, ROWS, BLOCK_K)


@triton.jit
def bf16_row_dot(x_ptr, w_ptr, w_scale_ptr, w_rows, row_ok, K: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """``_codecs.mx_row_dot`` for a bf16 activation row: sum_k mxfp8(x)[k] * W[row, k] with x
    quantized to MXFP8 in registers (``mxfp8_roundtrip``), on CUDA cores (decode). fp32 [ROWS]."""
    acc = tl.zeros([ROWS], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        a = mxfp8_roundtrip(x[None, :], 1, BLOCK_K)  # [1, BLOCK_K]
        w = load_mxfp4_tile(w_ptr, w_scale_ptr, w_rows, row_ok, k0, K, ROWS, BLOCK_K)
        acc += tl.sum(w * a, axis=1)
    return acc
