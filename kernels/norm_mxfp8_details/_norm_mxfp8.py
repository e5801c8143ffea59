"""Triton code for the fused residual-add + RMSNorm -> MXFP8 producer (launcher: ``kernels/norm_mxfp8.py``)."""

import triton
import triton.language as tl

from ..kv_cache_details._codecs import mxfp8_quantize_rows, to_bf16_rne
from ..moe_details._mx import pdl_wait_then_release


@triton.jit
def _add_rmsnorm_row(x_ptr, res_ptr, w_ptr, row, stride_x, stride_r, eps, H: tl.constexpr, BLOCK_H: tl.constexpr):
    """Row ``row``: (offs, mask, r = bf16(x + residual), y = rmsnorm(r) * w in fp32). The norm weight
    is loaded with the row, before the sum of squares (a reduction through shared memory, whose
    barriers no load crosses): one memory round trip, not two."""
    offs = tl.arange(0, BLOCK_H)
    m = offs < H
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    r = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0).to(tl.float32) + tl.load(
        res_ptr + row * stride_r + offs, mask=m, other=0.0).to(tl.float32)
    r = to_bf16_rne(r)
    rf = r.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(rf * rf, axis=0) / H + eps)
    return offs, m, r, rf * rstd * w, rstd


@triton.jit
def _store_mxfp8_row(y, offs, m, q_ptr, s_ptr, row, stride_q, stride_s, H: tl.constexpr, BLOCK_H: tl.constexpr):
    """MXFP8 of fp32 row ``y`` [BLOCK_H] (e4m3 values, e8m0 scale per 32) stored at ``row``."""
    codes, scales = mxfp8_quantize_rows(y[None, :], 1, BLOCK_H // 32)
    tl.store(q_ptr + row * stride_q + offs[None, :], codes, mask=m[None, :])
    offs_b = tl.arange(0, BLOCK_H // 32)
    tl.store(s_ptr + row * stride_s + offs_b[None, :], scales, mask=offs_b[None, :] < H // 32)


@triton.jit
def _add_rmsnorm_mxfp8_kernel(
    x_ptr,  # [T, H] bf16 (only bf16: outputs are rounded with to_bf16_rne)
    res_ptr,  # [T, H] bf16: residual
    res_out_ptr,  # [T, H] bf16: x + residual (res_ptr itself for the in-place update)
    w_ptr,  # [H] norm weight
    y_ptr,  # [T, H] bf16: normalized (for the bf16 router)
    q_ptr,  # [T, H] uint8 e4m3: MXFP8 values (for the experts)
    s_ptr,  # [T, H / 32] uint8 e8m0 scales
    eps,
    stride_x: tl.int64,
    stride_r: tl.int64,
    stride_ro: tl.int64,
    stride_y: tl.int64,
    stride_q: tl.int64,
    stride_s: tl.int64,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,  # power of two >= H
    PDL: tl.constexpr = False,  # launched as a programmatic dependent ($VLLM_SM121_PDL): wait first thing
    MX: tl.constexpr = True,  # False: bf16 y and the residual only (q_ptr / s_ptr unused)
):
    if PDL:
        pdl_wait_then_release()
    row = tl.program_id(0).to(tl.int64)
    offs, m, r, y, _ = _add_rmsnorm_row(x_ptr, res_ptr, w_ptr, row, stride_x, stride_r, eps, H, BLOCK_H)
    tl.store(res_out_ptr + row * stride_ro + offs, r, mask=m)  # one program per row: reads came first
    tl.store(y_ptr + row * stride_y + offs, to_bf16_rne(y), mask=m)
    if MX:
        _store_mxfp8_row(y, offs, m, q_ptr, s_ptr, row, stride_q, stride_s, H, BLOCK_H)


@triton.jit
def _add_rmsnorm_mxfp8_router_kernel(
    x_ptr,  # [T, H] bf16
    res_ptr,  # [T, H] bf16 residual (read only: several programs read each row)
    w_ptr,  # [H] norm weight
    rw_ptr,  # [E, H] bf16 router weight
    rb_ptr,  # [E] router bias
    res_out_ptr,  # [T, H] bf16: x + residual
    q_ptr,  # [T, H] uint8 e4m3: MXFP8 values (for the experts)
    s_ptr,  # [T, H / 32] uint8 e8m0 scales
    g_ptr,  # [T, E] bf16 router logits
    eps,
    stride_x: tl.int64,
    stride_r: tl.int64,
    stride_rw: tl.int64,
    stride_ro: tl.int64,
    stride_q: tl.int64,
    stride_s: tl.int64,
    stride_g: tl.int64,
    H: tl.constexpr,
    E: tl.constexpr,
    BLOCK_H: tl.constexpr,  # power of two >= H
    BLOCK_E: tl.constexpr,  # router outputs per program (divides E)
    QBLOCKS: tl.constexpr,  # MXFP8 blocks (32 values) per program, power of two; (E / BLOCK_E) * QBLOCKS * 32 >= H
    PDL: tl.constexpr = False,  # launched as a programmatic dependent ($VLLM_SM121_PDL): wait first thing
):
    """Program (t, j): token t's add + RMSNorm (recomputed by every j: 2 x H bf16 reads), router
    logits E[j*BLOCK_E : (j+1)*BLOCK_E] = bf16(y) . W + b (fp32 sums, bf16 out as upstream's bf16
    linear), and the residual and MXFP8 activations of MXFP8 blocks [j*QBLOCKS, (j+1)*QBLOCKS): the
    quantization (software e4m3 rounding) is spread over the row's programs instead of lengthening
    one. The residual goes to its own output: updating it in place would race with the other
    programs of the row."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    # The router rows and bias first: issued with the row's loads, not after the norm's reduction.
    offs_e = j * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_h = tl.arange(0, BLOCK_H)
    wt = tl.load(rw_ptr + offs_e[:, None].to(tl.int64) * stride_rw + offs_h[None, :], mask=(offs_h < H)[None, :],
                 other=0.0)
    rb = tl.load(rb_ptr + offs_e).to(tl.float32)
    # This program's slice of the row for the MXFP8 blocks, loaded with the rest (cache hits).
    offs_q = j * (QBLOCKS * 32) + tl.arange(0, QBLOCKS * 32)
    mq = offs_q < H
    wq = tl.load(w_ptr + offs_q, mask=mq, other=0.0).to(tl.float32)
    if PDL:  # the router and norm weights are in flight; the activations come from the previous kernel
        pdl_wait_then_release()
    rq = to_bf16_rne(tl.load(x_ptr + row * stride_x + offs_q, mask=mq, other=0.0).to(tl.float32) + tl.load(
        res_ptr + row * stride_r + offs_q, mask=mq, other=0.0).to(tl.float32))
    offs, m, r, y, rstd = _add_rmsnorm_row(x_ptr, res_ptr, w_ptr, row, stride_x, stride_r, eps, H, BLOCK_H)
    yb = to_bf16_rne(y).to(tl.float32)  # the router reads bf16 y, as upstream's
    g = tl.sum(wt.to(tl.float32) * yb[None, :], axis=1) + rb
    tl.store(g_ptr + row * stride_g + offs_e, to_bf16_rne(g))
    if j * (QBLOCKS * 32) < H:
        tl.store(res_out_ptr + row * stride_ro + offs_q, rq, mask=mq)
        yq = rq.to(tl.float32) * rstd * wq  # = y at these offsets, bit for bit (same operations)
        codes, scales = mxfp8_quantize_rows(yq[None, :], 1, QBLOCKS)
        tl.store(q_ptr + row * stride_q + offs_q[None, :], codes, mask=mq[None, :])
        offs_b = j * QBLOCKS + tl.arange(0, QBLOCKS)
        tl.store(s_ptr + row * stride_s + offs_b[None, :], scales, mask=offs_b[None, :] < H // 32)
