"""Ahead-of-time compilation of every kernel for sm_121a and sm_90a, without a GPU.

``python -m vllm_sm121.kernels.aot [--arch 121 90]`` compiles each kernel specialisation the
launchers use (tile tables from ``vllm_sm121.platform``) with Triton's own compiler and ptxas,
and prints which MMA and load instructions the PTX uses. ``tests/test_aot_compile.py`` runs the
same and fails if an sm_121a build contains an sm_90-only instruction (wgmma, TMA, setmaxnreg).

Pointer and stride arguments are compiled as 16-divisible, as Triton specialises them at run
time for the shapes vLLM passes (head sizes and page sizes are multiples of 16).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from vllm_sm121 import platform as _platform

from . import decode_sample as DS
from .decode_inputs_details._decode_inputs import _advance_decode_inputs_kernel
from .decode_sample_details._decode_sample import (_decode_sample_final_kernel, _decode_sample_partial_kernel,
                                                   _decode_sample_topk_pass_kernel, _decode_sample_topp_pass_kernel)
from .dense_details._dense import _dense_fp8_kernel
from .dense_details._dense_fma import _dense_fp8_fma_kernel
from .dense_details._dense_mmav import _dense_fp8_mmav_kernel
from .fp4_kv_details._fp4_kv import _fp4_kv_write_kernel
from .kv_cache_details._kv_cache import _write_kv_cache_kernel
from .moe_details._moe_align import _moe_align_kernel
from .moe_details._moe_fc1 import _moe_fc1_swiglu_kernel
from .moe_details._moe_fc2 import _moe_combine_kernel, _moe_fc2_kernel
from .moe_details._moe_fma import _moe_fc1_swiglu_fma_kernel, _moe_fc2_fma_kernel
from .moe_details._moe_grouped import _moe_fc1_grouped_kernel, _moe_fc2_grouped_kernel
from .moe_details._moe_route import _moe_route_kernel
from .norm_mxfp8 import router_tiles
from .norm_mxfp8_details._norm_mxfp8 import _add_rmsnorm_mxfp8_kernel, _add_rmsnorm_mxfp8_router_kernel
from .nvfp4_details._nvfp4 import _nvfp4_dequantize_kernel, _nvfp4_quantize_kernel
from .paged_attention_details._paged_attention import _combine_splits_kernel, _paged_attention_kernel

# Instructions that exist on sm_90 but not on sm_12x (consumer/GB10 Blackwell).
SM90_ONLY = ("wgmma", "cp.async.bulk.tensor", "setmaxnreg", "multimem", "cp.reduce.async.bulk")
_INSTR = re.compile(r"\b((?:mma\.sync|wgmma\.mma_async|mma)\.[\w.]+|cp\.async[\w.]*|ld\.global[\w.]*|"
                    r"ldmatrix[\w.]*|cvt\.rn\.satfinite[\w.]*|st\.global[\w.]*|setmaxnreg[\w.]*)")

ARCHS = {121: _platform.SM12X, 90: _platform.SM90}


@dataclasses.dataclass
class Spec:
    name: str
    fn: object
    constexprs: dict
    ptr_types: dict  # pointer argument -> Triton type string ("*bf16", ...)
    num_warps: int
    num_stages: int = 1


@dataclasses.dataclass
class Result:
    spec: str
    arch: int
    instructions: list[str]
    shared_bytes: int
    num_regs: int | None
    ptx: str = dataclasses.field(repr=False, default="")

    @property
    def sm90_only(self) -> list[str]:
        return [i for i in self.instructions if i.startswith(SM90_ONLY)]


def _constexprs(spec: Spec) -> dict:
    """The spec's constexprs, plus the defaults of the kernel's constexpr parameters it leaves out
    (as the launchers get them); without these such a parameter would compile as a runtime i32."""
    import inspect

    out = {}
    for name, p in inspect.signature(spec.fn.fn).parameters.items():
        if "constexpr" in str(p.annotation) and p.default is not inspect.Parameter.empty:
            out[name] = p.default
    return {**out, **spec.constexprs}


def _signature(spec: Spec) -> tuple[dict, dict]:
    sig, attrs = {}, {}
    constexprs = _constexprs(spec)
    for i, name in enumerate(spec.fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        if name in spec.ptr_types:  # pointers, and tensor descriptors ("tensordesc<i32[64, 64]>")
            sig[name] = spec.ptr_types[name]
        elif name.endswith("_ptr"):
            sig[name] = "*fp32"
        elif name.startswith("stride"):
            sig[name] = "i64"
        elif name in ("sm_scale", "softcap", "eps", "norm_eps"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
        if name.endswith("_ptr") or name.startswith("stride"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def attention_specs(family: str) -> list[Spec]:
    specs = []
    for head, kind, fp8, features in (
        (64, "decode", False, False), (64, "decode", True, True), (64, "prefill", False, True),
        (64, "prefill", True, False), (64, "prefill_sw", False, True), (128, "decode", False, True),
        (128, "prefill", False, False),
    ):
        tile = _platform.attn_tile(family, kind, head)
        gqa = 8
        kv = "*fp8e4nv" if fp8 else "*bf16"
        specs.append(Spec(
            name=f"paged_attention[{kind},d{head},{'fp8' if fp8 else 'bf16'},{'all-features' if features else 'plain'}]",
            fn=_paged_attention_kernel,
            constexprs=dict(
                NUM_Q_PER_KV=gqa, HEAD_SIZE=head, HEAD_PAD=head, BLOCK_SIZE=16, BLOCK_M=tile.block_m,
                BLOCK_Q=tile.block_m // gqa, TILE_N=tile.tile_n, SLIDING_WINDOW=128 if features else 0,
                USE_SOFTCAP=features, USE_SINKS=features, KV_FP8=fp8, KV_NVFP4=False,
                NUM_SPLITS=8 if (features and kind == "decode") else 1, DOT_FP32=False, E2M1_HW=False, NVFP4_VEC=False,
                NVFP4_ASM=False, NVFP4_WORDS=False,
                SEQ_CHUNK=16 if kind == "decode" else 0,  # the launcher's: decode up to 256 sequences
            ),
            ptr_types=dict(out_ptr="*bf16", q_ptr="*bf16", k_cache_ptr=kv, v_cache_ptr=kv, block_table_ptr="*i32",
                           seq_lens_ptr="*i32", query_start_loc_ptr="*i32"),
            num_warps=tile.num_warps, num_stages=tile.num_stages,
        ))
    tile = _platform.attn_tile(family, "decode_nvfp4", 64)
    # The hardware e2m1 conversion exists only on the sm_12x (and sm_100+) targets.
    # (hw, vec, asm, words); "-asm" is the sm_90 default (launcher NVFP4_ASM); "-words-asm" the
    # off-by-default NVFP4_WORDS variant, compiled for sm_121a too so its inline PTX stays valid.
    variants = [(False, False, False, False), (False, True, False, False), (False, False, True, False),
                (False, False, True, True)]
    if family == _platform.SM12X:
        variants += [(True, False, False, False), (True, True, False, False)]
    for hw, vec, asm, words in variants:
        specs.append(Spec(
            name=(f"paged_attention[decode,d64,nvfp4{'-hw-e2m1' if hw else ''}{'-vec' if vec else ''}"
                  f"{'-words' if words else ''}{'-asm' if asm else ''},all-features]"),
            fn=_paged_attention_kernel,
            constexprs=dict(NUM_Q_PER_KV=8, HEAD_SIZE=64, HEAD_PAD=64, BLOCK_SIZE=16, BLOCK_M=tile.block_m,
                            BLOCK_Q=tile.block_m // 8, TILE_N=tile.tile_n, SLIDING_WINDOW=128, USE_SOFTCAP=True,
                            USE_SINKS=True, KV_FP8=False, KV_NVFP4=True, NUM_SPLITS=8, DOT_FP32=False,
                            E2M1_HW=hw, NVFP4_VEC=vec, NVFP4_ASM=asm, NVFP4_WORDS=words, SEQ_CHUNK=16),
            ptr_types=dict(out_ptr="*bf16", q_ptr="*bf16", k_cache_ptr="*u8", v_cache_ptr="*u8", k_bscale_ptr="*u8",
                           v_bscale_ptr="*u8", block_table_ptr="*i32", seq_lens_ptr="*i32",
                           query_start_loc_ptr="*i32"),
            num_warps=tile.num_warps, num_stages=tile.num_stages,
        ))
    # The default decode launch of gpt-oss-120b's full layers in a graph captured at 4k: 64 splits
    # merged by the last split program of each tile (FUSED_COMBINE); bf16 and nvfp4 pages (the
    # family's default decode, inline PTX on sm_90 only).
    # nvfp4: ",scale-words" is the decode default since stop 32 (each token's block scales as one int32
    # load, NVFP4_SCALE_WORDS); the unsuffixed nvfp4 spec is the byte-load form (before stop 32, and
    # $VLLM_SM121_ATTN_SCALE_WORDS=0).
    for nvfp4, scale_words in ((False, False), (True, False), (True, True)):
        tile = _platform.attn_tile(family, "decode_nvfp4" if nvfp4 else "decode", 64)
        kv = "*u8" if nvfp4 else "*bf16"
        specs.append(Spec(
            name=(f"paged_attention[decode,d64,{'nvfp4' if nvfp4 else 'bf16'},all-features,fused-merge-64"
                  f"{',scale-words' if scale_words else ''}]"),
            fn=_paged_attention_kernel,
            constexprs=dict(NUM_Q_PER_KV=8, HEAD_SIZE=64, HEAD_PAD=64, BLOCK_SIZE=16, BLOCK_M=tile.block_m,
                            BLOCK_Q=tile.block_m // 8, TILE_N=tile.tile_n, SLIDING_WINDOW=0, USE_SOFTCAP=False,
                            USE_SINKS=True, KV_FP8=False, KV_NVFP4=nvfp4, NUM_SPLITS=64, DOT_FP32=False,
                            E2M1_HW=False, NVFP4_VEC=False, NVFP4_ASM=nvfp4 and family == _platform.SM90,
                            NVFP4_WORDS=False, NVFP4_SCALE_WORDS=scale_words, SEQ_CHUNK=16, FUSED_COMBINE=True),
            ptr_types=dict(out_ptr="*bf16", cnt_ptr="*i32", q_ptr="*bf16", k_cache_ptr=kv, v_cache_ptr=kv,
                           k_bscale_ptr="*u8", v_bscale_ptr="*u8", block_table_ptr="*i32", seq_lens_ptr="*i32",
                           query_start_loc_ptr="*i32"),
            num_warps=tile.num_warps, num_stages=tile.num_stages,
        ))
    # the 120b default decode with the o_proj weight prefetched into L2 (VLLM_SM121_L2_PREFETCH=o)
    base = specs[-1]  # (the nvfp4 default: its scale-words spec)
    specs.append(dataclasses.replace(base, name=base.name[:-1] + ",l2-prefetch]",
                                     constexprs=dict(base.constexprs, PF=True, PF_LANES=128, PF_LINE=128),
                                     ptr_types=dict(base.ptr_types, pf_ptr="*u8")))
    # ... and writing the step's new tokens itself ($VLLM_SM121_KV_IN_ATTN=1: no write launch before it)
    specs.append(dataclasses.replace(base, name=base.name[:-1] + ",kv-write]",
                                     constexprs=dict(base.constexprs, KV_WRITE=True),
                                     ptr_types=dict(base.ptr_types, kw_key_ptr="*bf16", kw_value_ptr="*bf16",
                                                    kw_slot_ptr="*i64")))
    specs.append(Spec(
        name="combine_splits[d64,sinks]", fn=_combine_splits_kernel,
        constexprs=dict(HEAD_SIZE=64, HEAD_PAD=64, NUM_SPLITS=8, USE_SINKS=True, KV_FP8=True),
        ptr_types=dict(out_ptr="*bf16", query_start_loc_ptr="*i32"), num_warps=1,
    ))
    return specs


def kv_cache_specs(family: str) -> list[Spec]:
    specs = []
    for kv, soft in (("bf16", False), ("fp8", False), ("fp8", True)):
        ty = "*fp8e4nv" if kv == "fp8" else "*bf16"
        specs.append(Spec(
            name=f"write_kv_cache[{kv}{',soft-e4m3' if soft else ''}]", fn=_write_kv_cache_kernel,
            constexprs=dict(NUM_KV_HEADS=8, HEADS_PAD=8, HEAD_SIZE=64, HEAD_PAD=64, BLOCK_SIZE=16,
                            KV_FP8=kv == "fp8", SOFT_FP8=soft),
            ptr_types=dict(key_ptr="*bf16", value_ptr="*bf16", k_cache_ptr=ty, v_cache_ptr=ty, slot_mapping_ptr="*i64"),
            num_warps=2,
        ))
    return specs


def nvfp4_specs(family: str) -> list[Spec]:
    return [
        Spec(name="fp4_kv_write[d64,8 heads]", fn=_fp4_kv_write_kernel,
             constexprs=dict(NUM_KV_HEADS=8, BLOCK_SIZE=16, HEAD=64),
             ptr_types=dict(key_ptr="*bf16", value_ptr="*bf16", k_data_ptr="*u8", k_scale_ptr="*u8",
                            v_data_ptr="*u8", v_scale_ptr="*u8", slot_mapping_ptr="*i64"), num_warps=1),
        Spec(name="nvfp4_quantize[d64]", fn=_nvfp4_quantize_kernel, constexprs=dict(NUM_BLOCKS=4),
             ptr_types=dict(x_ptr="*bf16", packed_ptr="*u8", scales_ptr="*u8"), num_warps=1),
        Spec(name="nvfp4_dequantize[d64]", fn=_nvfp4_dequantize_kernel, constexprs=dict(NUM_BLOCKS=4),
             ptr_types=dict(packed_ptr="*u8", scales_ptr="*u8"), num_warps=1),
    ]


def norm_specs(family: str) -> list[Spec]:
    return [Spec(name="add_rmsnorm_mxfp8[H2880]", fn=_add_rmsnorm_mxfp8_kernel, constexprs=dict(H=2880, BLOCK_H=4096),
                 ptr_types=dict(x_ptr="*bf16", res_ptr="*bf16", res_out_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16",
                                q_ptr="*u8", s_ptr="*u8"), num_warps=4),
            Spec(name="add_rmsnorm_mxfp8_router[H2880,E128]", fn=_add_rmsnorm_mxfp8_router_kernel,
                 constexprs=dict(H=2880, E=128, BLOCK_H=4096,
                                 **dict(zip(("BLOCK_E", "QBLOCKS"), router_tiles(2880, 128)[::2]))),
                 ptr_types=dict(x_ptr="*bf16", res_ptr="*bf16", w_ptr="*bf16", rw_ptr="*bf16", rb_ptr="*bf16",
                                res_out_ptr="*bf16", q_ptr="*u8", s_ptr="*u8", g_ptr="*bf16"), num_warps=4)]


def _stop31_variants(spec: Spec) -> list[Spec]:
    """An FMA GEMV spec with the scale bytes as int32 loads ($VLLM_SM121_MOE_SCALE_LDG, opt-in) and with
    fp16 word products ($VLLM_SM121_MOE_FMA_F16X2=1; the specs' base is the default since stop 34,
    fp16 group chains, F16X2=2)."""
    return [dataclasses.replace(spec, name=spec.name[:-1] + f", {tag}]", constexprs=dict(spec.constexprs, **extra))
            for tag, extra in (("scale ldg", dict(SCALE_LDG=True)), ("fp16 word products", dict(F16X2=1)))]


def moe_specs(family: str) -> list[Spec]:
    """Routing, the decode GEMVs and the grouped (prefill) GEMMs at gpt-oss-120b shapes, with the
    launchers' tiles (``kernels/moe.py``: DECODE_*, FMA_TILES, GROUPED_TILES; GPU flags on)."""
    from . import moe as M

    grouped = dict(sorted_pair_ptr="*i32", tile_expert_ptr="*i32", tile_start_ptr="*i32", tile_end_ptr="*i32",
                   w_ptr="*u8", w_scale_ptr="*u8", bias_ptr="*bf16")
    route = dict(E=128, E_PAD=128, TOPK=4, TOPK_PAD=4, K=2880, BLOCK_K=512, ROUTE=True, HW_FP8=True)
    route_ptrs = dict(logits_ptr="*bf16", topk_w_ptr="*fp32", topk_ids_ptr="*i32", x_ptr="*bf16", xq_ptr="*u8",
                      xs_ptr="*u8", expert_map_ptr="*i32")
    decode = dict(E=128, TOPK=4, TOPK_PAD=4, BLOCK_M=M.DECODE_BLOCK_M, BLOCK_K=M.DECODE_BLOCK_K, DOT_SCALED=True)
    mx = dict(w_ptr="*u8", w_scale_ptr="*u8", bias_ptr="*bf16", topk_ids_ptr="*i32")
    specs = [
        Spec(name="moe_route[E128 top4]", fn=_moe_route_kernel, constexprs=dict(route, QUANT=False),
             ptr_types=route_ptrs, num_warps=1),
        Spec(name="moe_route[E128 top4, + MXFP8 quantize H2880]", fn=_moe_route_kernel,
             constexprs=dict(route, QUANT=True), ptr_types=route_ptrs, num_warps=4),
        Spec(name="moe_route[E128 top4, + MXFP8 quantize H2880, EP expert_map]", fn=_moe_route_kernel,
             constexprs=dict(route, QUANT=True, HAS_MAP=True), ptr_types=route_ptrs, num_warps=4),
        Spec(name="moe_fc1_swiglu[gpt-oss K2880 I2880 top4, decode]", fn=_moe_fc1_swiglu_kernel,
             constexprs=dict(decode, K=2880, I=2880, BLOCK_N=M.DECODE_FC1_BLOCK_N, ALPHA=1.702, LIMIT=7.0,
                             HW_FP8=True),
             ptr_types=dict(mx, a_ptr="*u8", a_scale_ptr="*u8", out_ptr="*u8", out_scale_ptr="*u8"),
             num_warps=M.DECODE_NUM_WARPS, num_stages=M.DECODE_NUM_STAGES),
        Spec(name="moe_fc2[gpt-oss H2880 I2880 top4, decode]", fn=_moe_fc2_kernel,
             constexprs=dict(decode, H=2880, I=2880, BLOCK_N=M.DECODE_FC2_BLOCK_N),
             ptr_types=dict(mx, h_ptr="*u8", h_scale_ptr="*u8", topk_w_ptr="*fp32", part_ptr="*fp32"),
             num_warps=M.DECODE_NUM_WARPS, num_stages=M.DECODE_NUM_STAGES),
        Spec(name="moe_combine[H2880 top4]", fn=_moe_combine_kernel, constexprs=dict(H=2880, TOPK=4, BLOCK=1024),
             ptr_types=dict(part_ptr="*fp32", out_ptr="*bf16"), num_warps=4),
    ]
    for nt in (1, 4):  # the FMA decode GEMVs (M <= 4): one and four token accumulators, with their tiles
        fma = M.FMA_TILES_F16X2[(family, min(nt, 2))]  # fp16 group chains (F16X2=2, the default) and the others below
        fc2_warps, fc2_stages = fma.fc2_launch()
        split, gps = M.fc2_split_k(2880, fma.fc2_kb // 16, fma.fc2_split)
        split1, gps1 = M.fc2_split_k(2880, fma.fc1_kb // 16, fma.fc1_split)
        common = dict(E=128, TOPK=4, TOPK_PAD=4, NT=nt, BLOCK_T=triton.next_power_of_2(nt))
        specs.append(Spec(
            name=f"moe_fc1_swiglu_fma[gpt-oss K2880 I2880 top4, M{nt}]", fn=_moe_fc1_swiglu_fma_kernel,
            constexprs=dict(common, K=2880, I=2880, BLOCK_R=fma.fc1_rows, BLOCK_G=fma.fc1_kb // 16,
                            PREFETCH=fma.num_stages > 1, F16X2=2, ALPHA=1.702, LIMIT=7.0, HW_FP8=True,
                            SPLIT=split1, GPS=gps1, w_desc=None),
            ptr_types=dict(mx, a_ptr="*i32", a_scale_ptr="*u8", w_ptr="*i32", out_ptr="*u8", out_scale_ptr="*u8",
                           cnt_ptr="*i32"),
            num_warps=fma.num_warps))
        specs.append(Spec(
            name=f"moe_fc2_fma[gpt-oss H2880 I2880 top4, M{nt}]", fn=_moe_fc2_fma_kernel,
            constexprs=dict(common, H=2880, I=2880, BLOCK_R=fma.fc2_rows, BLOCK_G=fma.fc2_kb // 16,
                            SPLIT=split, GPS=gps, PREFETCH=fc2_stages > 1, F16X2=2, w_desc=None),
            ptr_types=dict(mx, h_ptr="*i32", h_scale_ptr="*u8", w_ptr="*i32", topk_w_ptr="*fp32", part_ptr="*fp32"),
            num_warps=fc2_warps))
        fc1_spec, fc2_spec = specs[-2:]
        if nt == 4:  # the windowed launches (M = 5..64: 4 of an expert's tokens per program; sm_90's default <= 32)
            specs.extend(dataclasses.replace(sp, name=sp.name[:-2] + f"{bt} windowed]",
                                             constexprs=dict(sp.constexprs, BLOCK_T=bt, WINDOW=4))
                         for bt in (16, 32, 64) for sp in (fc1_spec, fc2_spec))
        # the exact fp32 products (VLLM_SM121_MOE_FMA_F16X2=0), with their own tiles (FMA_TILES; no split-K there)
        exact = M.FMA_TILES[(family, min(nt, 2))]
        exact_fc2_warps, exact_fc2_stages = exact.fc2_launch()
        assert exact.fc1_split == exact.fc2_split == 1, exact
        for spec, rows, kb, warps, stages in ((fc1_spec, exact.fc1_rows, exact.fc1_kb, exact.num_warps, exact.num_stages),
                                              (fc2_spec, exact.fc2_rows, exact.fc2_kb, exact_fc2_warps, exact_fc2_stages)):
            specs.append(dataclasses.replace(
                spec, name=spec.name[:-1] + ", exact products]", num_warps=warps,
                constexprs=dict(spec.constexprs, BLOCK_R=rows, BLOCK_G=kb // 16, PREFETCH=stages > 1, F16X2=False,
                                SPLIT=1, GPS=M.fc2_split_k(2880, kb // 16, 1)[1])))
        specs.append(dataclasses.replace(  # FC2 with the combine inside (VLLM_SM121_MOE_FUSED_COMBINE=1)
            fc2_spec, name=fc2_spec.name[:-1] + ", fused combine]", constexprs=dict(fc2_spec.constexprs, COMBINE=True),
            ptr_types=dict(fc2_spec.ptr_types, out_ptr="*bf16", cnt_ptr="*i32")))
        # the next layer's input norm carried from the combine (VLLM_SM121_NORM_IN_QKV=1), fused combine and kernel
        nn_ptrs = dict(nn_res_ptr="*bf16", nn_w_ptr="*bf16", nn_s_ptr="*bf16", nn_u_ptr="*bf16", nn_ps_ptr="*fp32")
        specs.append(dataclasses.replace(
            specs[-1], name=fc2_spec.name[:-1] + ", fused combine, carried norm]",
            constexprs=dict(specs[-1].constexprs, NEXT_NORM=True), ptr_types=dict(specs[-1].ptr_types, **nn_ptrs)))
        if nt == 1:
            specs.append(Spec(name="moe_combine[H2880 top4, carried norm]", fn=_moe_combine_kernel,
                              constexprs=dict(H=2880, TOPK=4, BLOCK=1024, NEXT_NORM=True),
                              ptr_types=dict(nn_ptrs, part_ptr="*fp32", out_ptr="*bf16"), num_warps=4))
        if nt == 1:  # the L2 prefetches (VLLM_SM121_L2_PREFETCH=w2_late / qkv_late): FC2's rows, the next qkv
            for spec, ptrs in ((fc1_spec, dict(pf_ptr="*u8", pfs_ptr="*u8")), (fc2_spec, dict(pf_ptr="*u8"))):
                specs.append(dataclasses.replace(
                    spec, name=spec.name[:-1] + ", l2 prefetch]", ptr_types=dict(spec.ptr_types, **ptrs),
                    constexprs=dict(spec.constexprs, PF=True, PF_LATE=True, PF_LANES=128, PF_LINE=128)))
        if nt == 1:  # FC1 routing the tokens itself (VLLM_SM121_MOE_FUSED_ROUTE=1)
            specs.append(dataclasses.replace(
                fc1_spec, name=fc1_spec.name[:-1] + ", fused routing]",
                constexprs=dict(fc1_spec.constexprs, ROUTE=True, E_ROUTE=128, E_PAD=128, HAS_MAP=False),
                ptr_types=dict(fc1_spec.ptr_types, logits_ptr="*bf16", topk_w_ptr="*fp32", topk_ids_ptr="*i32")))
        if nt == 1:  # the opt-in programmatic-dependent-launch variants (VLLM_SM121_MOE_PDL=1)
            for spec in (fc1_spec, fc2_spec):
                specs.append(dataclasses.replace(spec, name=spec.name[:-1] + ", PDL]",
                                                 constexprs=dict(spec.constexprs, PDL=True)))
            # the step-wide PDL switch (VLLM_SM121_PDL=1): FC2 waiting first thing; the activations by
            # plain loads (VLLM_SM121_MOE_ACT_LDG=1, inline PTX)
            specs.append(dataclasses.replace(fc2_spec, name=fc2_spec.name[:-1] + ", PDL first]",
                                             constexprs=dict(fc2_spec.constexprs, PDL_TOP=True)))
            for spec in (fc1_spec, fc2_spec):
                specs.append(dataclasses.replace(spec, name=spec.name[:-1] + ", activations ldg]",
                                                 constexprs=dict(spec.constexprs, ACT_LDG=True)))
                specs += _stop31_variants(spec)
            specs.append(Spec(name="moe_combine[H2880 top4, PDL]", fn=_moe_combine_kernel,
                              constexprs=dict(H=2880, TOPK=4, BLOCK=1024, PDL=True),
                              ptr_types=dict(part_ptr="*fp32", out_ptr="*bf16"), num_warps=4))
        if family == _platform.SM90:  # the TMA-pipelined GEMVs (tile stages >= 3; sm_90 only): the packed
            # products' default tiles' stage count where it is >= 3 (FMA_TILES_F16X2), else the opt-in 4
            st = fma.num_stages if fma.num_stages >= 3 else 4
            for spec, rows, kb in ((fc1_spec, fma.fc1_rows, fma.fc1_kb), (fc2_spec, fma.fc2_rows, fma.fc2_kb)):
                c = {k: v for k, v in spec.constexprs.items() if k != "w_desc"}
                specs.append(dataclasses.replace(
                    spec, name=spec.name[:-1] + f", TMA {st} stages]", constexprs=dict(c, TMA=st),
                    ptr_types=dict(spec.ptr_types, w_desc=f"tensordesc<i32[{rows}, {kb // 4}]>")))
                if nt == 1:
                    specs += _stop31_variants(specs[-1])
    # The grouped (prefill) GEMMs with every tile of the family's table (BLOCK_M 16 .. 128); FC1
    # with bf16 input (MXFP8 round trip in registers) at the largest.
    tiles = [t for _, t in M.GROUPED_TILES[family]]
    # Their tile map (moe_align, E = 128): M = 8 (32 pairs, 34 tiles) with the first tile's
    # BLOCK_M and prefill (chunks of 16384 / E_PAD = 128 pairs and tiles) with every BLOCK_M;
    # chunks and warps as moe_align picks them.
    align_ptrs = dict(ids_ptr="*i32", sorted_pair_ptr="*i32", tile_expert_ptr="*i32", tile_start_ptr="*i32",
                      tile_end_ptr="*i32")
    for bm, chunk, tile_chunk, what in [(tiles[0].block_m, 32, 64, "M8")] + [
            (bm, 128, 128, "prefill") for bm in sorted({t.block_m for t in tiles})]:
        specs.append(Spec(
            name=f"moe_align[E128, BLOCK_M {bm}, {what}]", fn=_moe_align_kernel,
            constexprs=dict(E=128, E_PAD=128, BLOCK_M=bm, CHUNK=chunk, TILE_CHUNK=tile_chunk), ptr_types=align_ptrs,
            num_warps=4 if max(chunk, tile_chunk) * 128 <= 4096 else 8))
    halves = dict(BLOCK_K=M.HALVES_BLOCK_K, HALVES=True) if M.GROUPED_HALVES.get(family, False) else {}
    for t in tiles:
        for a_mxfp8 in (True, False) if t is tiles[-1] else (True,):
            specs.append(Spec(
                name=f"moe_fc1_grouped[gpt-oss K2880 I2880 top4, {'mxfp8' if a_mxfp8 else 'bf16'} in, tile {t.spec()}]",
                fn=_moe_fc1_grouped_kernel,
                constexprs=dict(K=2880, I=2880, TOPK=4, BLOCK_M=t.block_m, BLOCK_N=t.block_n // 2, BLOCK_K=t.block_k,
                                ALPHA=1.702, LIMIT=7.0, A_MXFP8=a_mxfp8, DOT_FP32=False, HW_FP8=True,
                                W_F2=False) | halves,
                ptr_types=dict(a_ptr="*u8" if a_mxfp8 else "*bf16", a_scale_ptr="*u8", out_ptr="*u8",
                               out_scale_ptr="*u8", **grouped), num_warps=t.num_warps, num_stages=t.num_stages))
        specs.append(Spec(
            name=f"moe_fc2_grouped[gpt-oss H2880 I2880, tile {t.spec()}]", fn=_moe_fc2_grouped_kernel,
            constexprs=dict(H=2880, I=2880, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
                            DOT_FP32=False, W_F2=False, NAN_SCALES=True) | halves,
            ptr_types=dict(h_ptr="*u8", h_scale_ptr="*u8", topk_w_ptr="*fp32", out_ptr="*fp32", **grouped),
            num_warps=t.num_warps, num_stages=t.num_stages))
    # The table's tiles as the plugin launches them for registered checkpoint scales (kernels.moe.
    # register_weight_scales: no F2 multiply, guarded); with F2 (unregistered scales), first tile
    first = [sp for sp in specs if sp.name.startswith(("moe_fc1_grouped", "moe_fc2_grouped"))][:2]
    specs += [dataclasses.replace(sp, name=sp.name[:-1] + ", F2]", constexprs=dict(sp.constexprs, W_F2=True))
              for sp in first]
    if halves:  # the checkpoint-order decoder ($VLLM_SM121_MOE_GROUPED_HALVES=0), first tile
        specs += [dataclasses.replace(sp, name=sp.name[:-1] + ", bytes]",
                                      constexprs=dict(sp.constexprs, BLOCK_K=tiles[0].block_k, HALVES=False))
                  for sp in first]
        # FC1 / FC2 with bf16 halves-order activations ($VLLM_SM121_MOE_GROUPED_ACT_BF16, opt-in), every tile,
        # where the launchers take them (M.GROUPED_ACT_BF16_UNSAFE: not on sm_90)
        act_tiles = [] if family in M.GROUPED_ACT_BF16_UNSAFE else tiles
        specs += [_bf16_act_variant(sp) for sp in specs
                  if sp.name.startswith(("moe_fc1_grouped[gpt-oss K2880 I2880 top4, mxfp8 in", "moe_fc2_grouped"))
                  and any(sp.name.endswith(f"tile {t.spec()}]") for t in act_tiles)]
    return specs


def _bf16_act_variant(sp: Spec) -> Spec:
    """A grouped FC1 (MXFP8 input) or FC2 spec with bf16 halves-order activations (A_HALVES)."""
    fc1 = sp.name.startswith("moe_fc1")
    return dataclasses.replace(sp, name=sp.name[:-1] + ", bf16 halves act]",
                               constexprs=dict(sp.constexprs, A_HALVES=True, **({"A_MXFP8": False} if fc1 else {})),
                               ptr_types=dict(sp.ptr_types, **{"a_ptr" if fc1 else "h_ptr": "*bf16"}))


def dense_specs(family: str) -> list[Spec]:
    """FP8-weight dense linears at gpt-oss-120b shapes (qkv K2880, o K4096, lm_head K2880), decode
    and prefill tiles of ``kernels/dense.py`` (GPU path: bf16 tl.dot, DOT_FP32 off)."""
    from . import dense as D

    ptrs = dict(x_ptr="*bf16", w_ptr="*u8", scale_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16")
    decode = dict(BLOCK_M=D.DECODE_BLOCK_M, BLOCK_N=D.DECODE_BLOCK_N, BLOCK_K=D.DECODE_BLOCK_K, DOT_FP32=False)
    prefill = dict(BLOCK_M=D.PREFILL_BLOCK_M, BLOCK_N=D.PREFILL_BLOCK_N, BLOCK_K=D.PREFILL_BLOCK_K, DOT_FP32=False)
    specs = []
    for what, k, bias in (("qkv", 2880, True), ("o", 4096, True), ("lm_head", 2880, False)):
        specs.append(Spec(name=f"dense_fp8[{what} K{k}, decode]", fn=_dense_fp8_kernel,
                          constexprs=dict(decode, K=k, HAS_BIAS=bias), ptr_types=ptrs,
                          num_warps=D.DECODE_NUM_WARPS, num_stages=D.DECODE_NUM_STAGES))
    specs.append(Spec(name="dense_fp8[qkv K2880, prefill]", fn=_dense_fp8_kernel,
                      constexprs=dict(prefill, K=2880, HAS_BIAS=True), ptr_types=ptrs,
                      num_warps=D.PREFILL_NUM_WARPS, num_stages=D.PREFILL_NUM_STAGES))
    # gpt-oss's rotation in the MMA kernel's epilogue (stop 41): decode tiles (pairs of runs) and prefill
    # tiles (BLOCK_N 128: whole heads of 64)
    for sp in (specs[0], specs[-1]):
        specs.append(dataclasses.replace(sp, name=sp.name[:-1] + ", rope]", ptr_types=dict(ptrs, pos_ptr="*i64",
                                                                                           cs_ptr="*fp32"),
                                         constexprs=dict(sp.constexprs, ROPE=True, ROPE_ROWS=72 * 64, HEAD=64)))
    # The FMA decode GEMV (M <= 4: one and four token accumulators, and two where the family has its own
    # two-token tile) with the family's tiles.
    fma_ptrs = dict(ptrs, x_ptr="*i64", w_ptr="*i32")
    for what, k, bias in (("qkv", 2880, True), ("o", 4096, True), ("lm_head", 2880, False)):
        wide = what == "lm_head"
        for nt in (1, 2, 4):
            if nt == 2 and (family, wide) not in D.DENSE_FMA_TILES_M2:
                continue
            fma = D.family_fma_tiles(family, nt, wide)
            kw = min(fma.kw, triton.next_power_of_2(k // 4))
            specs.append(Spec(name=f"dense_fp8_fma[{what} K{k}, M{nt}]", fn=_dense_fp8_fma_kernel,
                              constexprs=dict(K=k, NT=nt, BLOCK_R=fma.rows, BLOCK_KW=kw, HAS_BIAS=bias,
                                              X_ROWS=D.fma_x_rows(fma, kw)),
                              ptr_types=fma_ptrs, num_warps=fma.num_warps))
            if what == "qkv":  # gpt-oss's rotary embedding in the epilogue (q + k rows: 72 heads of 64)
                specs.append(Spec(name=f"dense_fp8_fma[qkv K{k}, M{nt}, rope]", fn=_dense_fp8_fma_kernel,
                                  constexprs=dict(specs[-1].constexprs, ROPE=True, ROPE_ROWS=72 * 64, HEAD=64),
                                  ptr_types=dict(fma_ptrs, pos_ptr="*i64", cs_ptr="*fp32"),
                                  num_warps=fma.num_warps))
                rope_spec = specs[-1]
                # + the input norm carried from the previous FC2 (opt-in VLLM_SM121_NORM_IN_QKV=1)
                specs.append(dataclasses.replace(
                    rope_spec, name=f"dense_fp8_fma[qkv K{k}, M{nt}, rope, carried norm]",
                    constexprs=dict(rope_spec.constexprs, NORM=True, NP_PAD=256, COPY_BLOCK=16),
                    ptr_types=dict(rope_spec.ptr_types, ps_ptr="*fp32", s_src_ptr="*bf16", res_out_ptr="*bf16")))
                # + the k / v heads written to nvfp4 KV pages by each head's last program (opt-in kv_write)
                specs.append(Spec(name=f"dense_fp8_fma[qkv K{k}, M{nt}, rope, nvfp4 kv write]", fn=_dense_fp8_fma_kernel,
                                  constexprs=dict(rope_spec.constexprs, KV_WRITE=True, Q_ROWS=64 * 64, KV_HEADS=8,
                                                  KV_BLOCK=16),
                                  ptr_types=dict(rope_spec.ptr_types, slot_ptr="*i64", k_data_ptr="*u8",
                                                 k_scale_ptr="*u8", v_data_ptr="*u8", v_scale_ptr="*u8",
                                                 cnt_ptr="*i32"),
                                  num_warps=fma.num_warps))
    # The tensor-core decode GEMV (M <= 16) with the family's tiles and the split the launcher picks
    # on a 132-SM card (qkv with the rotation in its epilogue, as gpt-oss calls it).
    mmav = D.DENSE_MMAV_TILES[family]
    mmav_ptrs = dict(ptrs, part_ptr="*fp32", cnt_ptr="*i32")
    for what, n, k, bias in (("qkv", 5120, 2880, True), ("o", 2880, 4096, True), ("lm_head", 201088, 2880, False)):
        rope = dict(ROPE=True, ROPE_ROWS=72 * 64, HEAD=64) if what == "qkv" else {}
        specs.append(Spec(name=f"dense_fp8_mmav[{what} K{k}{', rope' if rope else ''}]", fn=_dense_fp8_mmav_kernel,
                          constexprs=dict(K=k, BLOCK_N=mmav.rows, BLOCK_K=mmav.kb, SPLIT=mmav.splits(n, k, 132),
                                          HAS_BIAS=bias, X_SHIFT=D.DENSE_MMAV_X_SHIFT, DOT_FP32=False, **rope),
                          ptr_types=dict(mmav_ptrs, pos_ptr="*i64") if rope else mmav_ptrs,
                          num_warps=mmav.num_warps, num_stages=mmav.num_stages))
        if what != "lm_head":  # 17-32 tokens: the 32-wide token tile (stop 40)
            specs.append(dataclasses.replace(specs[-1], name=specs[-1].name[:-1] + ", 32 tokens]",
                                             constexprs=dict(specs[-1].constexprs, BLOCK_T=32),
                                             num_warps=D.mmav_num_warps(mmav, 32)))
    return specs


def decode_sample_specs(vocab: int = 201088) -> list[Spec]:
    """The in-graph sampler's launches (gpt-oss's vocabulary): the sampling kernel without and with
    top-k / top-p, and the threshold passes, for bf16 logits (16-bit keys) and fp32 (32-bit)."""
    nb = DS.num_blocks(vocab)
    opts = dict(temp_ptr="*fp32", topk_ptr="*i32", topp_ptr="*fp32", cmax_ptr="*i32", cnt_ptr="*i32",
                mass_ptr="*fp32", state_ptr="*i32")
    specs = []
    for name, kb in (("bf16", 16), ("fp32", 32)):  # decode_sample.key_bits
        tri = f"*{name}"
        c = dict(EPS=DS.SAMPLING_EPS, BLOCK=DS.BLOCK, KB=kb, FAN=DS.THRESHOLD_FAN, NB_P2=triton.next_power_of_2(nb),
                 NSTATE=DS.THRESHOLD_STATE)
        for thr in (False, True):
            specs.append(Spec(name=f"decode_sample[partial, V{vocab}, {name}{', top-k/top-p' if thr else ''}]",
                              fn=_decode_sample_partial_kernel, constexprs=dict(c, HAS_THR=thr),
                              ptr_types=dict(opts, logits_ptr=tri, seed_ptr="*i64", step_ptr="*i64", thr_ptr="*i32",
                                             part_val_ptr="*fp32", part_idx_ptr="*i32"),
                              num_warps=DS.NUM_WARPS))
        for what, fn in (("top-k", _decode_sample_topk_pass_kernel), ("top-p", _decode_sample_topp_pass_kernel)):
            specs.append(Spec(name=f"decode_sample[{what} pass, V{vocab}, {name}]", fn=fn,
                              constexprs=dict(c, SUB=DS.THRESHOLD_SUB), ptr_types=dict(opts, logits_ptr=tri),
                              num_warps=DS.NUM_WARPS))
    return specs


def graph_specs(family: str) -> list[Spec]:
    """The whole-model graph mode's device-side input advance (two KV groups, 32 padded rows) and
    its in-graph sampler (gpt-oss's vocabulary)."""
    del family
    return [Spec(name="advance_decode_inputs[2 groups, P32]", fn=_advance_decode_inputs_kernel,
                 constexprs=dict(P=32, BS0=16, BS1=16, NUM_GROUPS=2, BLOCK=128, MAX_PATCHES=128),
                 ptr_types=dict(tokens_ptr="*i64", num_reqs_ptr="*i32", input_ids_ptr="*i32", positions_ptr="*i64",
                                seq_lens_ptr="*i32", bt0_ptr="*i32", slot0_ptr="*i64", bt1_ptr="*i32",
                                slot1_ptr="*i64", patches_ptr="*i32"),
                 num_warps=4),
            *decode_sample_specs(),
            Spec(name="decode_sample[final]", fn=_decode_sample_final_kernel,
                 constexprs=dict(NB_P2=triton.next_power_of_2(DS.num_blocks(201088))),
                 ptr_types=dict(part_val_ptr="*fp32", part_idx_ptr="*i32", out_ptr="*i32", step_ptr="*i64"),
                 num_warps=1)]


def pdl_specs(specs: list[Spec]) -> list[Spec]:
    """$VLLM_SM121_PDL=1's variants (``griddepcontrol.wait`` / ``launch_dependents``) of the small
    decode-step kernels and the one-token qkv GEMV (its first weights loaded before the wait); the
    MoE's are in ``moe_specs``, the attention kernel's compile the same two instructions."""
    wanted = ("add_rmsnorm_mxfp8[", "add_rmsnorm_mxfp8_router[", "fp4_kv_write[", "combine_splits[",
              "dense_fp8_fma[qkv K2880, M1, rope]")
    picked = {}
    for spec in specs:
        for w in wanted:
            if spec.name.startswith(w) and w not in picked:
                picked[w] = dataclasses.replace(spec, name=spec.name[:-1] + ", PDL]",
                                                constexprs=dict(spec.constexprs, PDL=True))
    return list(picked.values())


def all_specs(family: str) -> list[Spec]:
    specs = (attention_specs(family) + kv_cache_specs(family) + nvfp4_specs(family) + norm_specs(family)
             + moe_specs(family) + dense_specs(family) + graph_specs(family))
    return specs + pdl_specs(specs)


def compile_spec(spec: Spec, arch: int) -> Result:
    sig, attrs = _signature(spec)
    src = ASTSource(spec.fn, sig, _constexprs(spec), attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                            options=dict(num_warps=spec.num_warps, num_stages=spec.num_stages))
    ptx = kernel.asm["ptx"]
    target = re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1)
    if target != f"sm_{arch}a":
        raise RuntimeError(f"{spec.name}: PTX targets {target}, expected sm_{arch}a")
    return Result(spec.name, arch, sorted(set(_INSTR.findall(ptx))), kernel.metadata.shared,
                  getattr(kernel, "n_regs", None), ptx)


def _cubin_sass(cubin: bytes) -> str:
    import os
    import subprocess
    import tempfile

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        proc = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"cuobjdump -sass failed ({proc.stderr.strip() or proc.returncode})")
    return proc.stdout


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")
_SASS_BACK_BRA = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)")


def _spec_sass(spec: Spec, arch: int) -> str:
    sig, attrs = _signature(spec)
    kernel = triton.compile(ASTSource(spec.fn, sig, _constexprs(spec), attrs), target=GPUTarget("cuda", arch, 32),
                            options=dict(num_warps=spec.num_warps, num_stages=spec.num_stages))
    return _cubin_sass(kernel.asm["cubin"])


_SASS_OP = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)")
# What the memory order of a decode kernel is read from: global loads (LDG, cp.async LDGSTS, TMA
# UTMALDG), barriers, waits, branches, stores, exits.
_ORDER_OPS = ("LDG", "LDGSTS", "UTMALDG", "BAR", "SYNCS.PHASECHK", "BRA", "EXIT", "STG")


def sass_order(spec: Spec, arch: int = 90) -> list[str]:
    """The kernel's global loads, barriers, pipeline waits, branches, stores and exits in code order
    (full opcodes, e.g. ``LDG.E.128``, ``BAR.SYNC.DEFER_BLOCKING``): where no GPU can time a small
    decode kernel, this says how many memory round trips it makes before its stores (a load placed
    after a barrier or a loop waits for everything before it)."""
    ops = [m.group(2) for m in map(_SASS_OP.search, _spec_sass(spec, arch).splitlines()) if m]
    return [op for op in ops if op.startswith(_ORDER_OPS)]


def sass_loop(spec: Spec, arch: int) -> tuple[int, dict[str, int]]:
    """Instructions of the largest loop with an MMA (else the largest loop) in ``spec``'s SASS
    (Triton's bundled cuobjdump), and their opcode counts: a static proxy for the per-iteration
    cost where no GPU can time it (a loop = the span of a backward branch)."""
    sass = _spec_sass(spec, arch)
    lines = [(int(m.group(1), 16), m.group(2)) for m in map(_SASS_LINE.search, sass.splitlines()) if m]
    loops = []
    for m in _SASS_BACK_BRA.finditer(sass):
        end, start = int(m.group(1), 16), int(m.group(2), 16)
        if start < end:
            loops.append([op for a, op in lines if start <= a <= end])
    with_mma = [b for b in loops if any(op.startswith(("HMMA", "HGMMA")) for op in b)]
    best = max(with_mma or loops, key=len, default=[])
    counts: dict[str, int] = {}
    for op in best:
        counts[op] = counts.get(op, 0) + 1
    return len(best), dict(sorted(counts.items(), key=lambda kv: -kv[1]))


_SASS_INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_SASS_DEST = re.compile(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s+(R\d+)\b")
_HGMMA_A = re.compile(r"HGMMA\.\S+\s+R\d+,\s+R(\d+),")


def wgmma_register_hazards(sass: str) -> list[str]:
    """Loops of sm_90a SASS that leave a wgmma group with register A operands in flight at their back-edge
    (no ``WARPGROUP.DEPBAR`` between the group and the backward branch) and rewrite one of those registers in
    the next iteration before its first wait: undefined behaviour per the PTX ISA (wgmma reads its register
    operands asynchronously), seen as wrong products on an H200 (stop 43: the grouped MoE GEMMs with bf16
    activations streamed by cp.async, where Triton 3.6 pipelines the wgmma). One line per such loop."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in map(_SASS_INS.search, sass.splitlines()) if m]
    found = []
    for m in _SASS_BACK_BRA.finditer(sass):  # a loop = the span of a backward branch (as sass_loop)
        end, start = int(m.group(1), 16), int(m.group(2), 16)
        if start >= end:
            continue
        body = [t for a, t in ins if start <= a <= end]
        mma = [j for j, t in enumerate(body) if "HGMMA" in t]
        if not mma or any("WARPGROUP.DEPBAR" in t for t in body[mma[-1]:]):
            continue
        arrive = max((j for j, t in enumerate(body[:mma[-1]]) if "WARPGROUP.ARRIVE" in t), default=-1)
        regs = {f"R{int(a.group(1)) + k}" for j in mma if j > arrive for a in [_HGMMA_A.search(body[j])] if a
                for k in range(4)}
        first_wait = next((j for j, t in enumerate(body) if "WARPGROUP.DEPBAR" in t), len(body))
        writes = [t for t in body[:first_wait] if (d := _SASS_DEST.match(t)) and d.group(2) in regs
                  and not d.group(1).startswith(("ST", "HGMMA"))]
        if writes:
            found.append(f"loop at {start:#x}: {len(writes)} writes of in-flight wgmma A registers "
                         f"before the first wait (e.g. {writes[0]})")
    return found


def wgmma_hazard_report() -> dict:
    """``wgmma_register_hazards`` of every sm_90a kernel whose SASS has wgmma, and of the negative control: the
    grouped FC1 with bf16 halves-order activations (stop 43; no longer launched on sm_90), which has one."""
    kernels, hazards = 0, {}
    for spec in all_specs(ARCHS[90]):
        sass = _spec_sass(spec, 90)
        if "HGMMA" in sass:
            kernels += 1
            if found := wgmma_register_hazards(sass):
                hazards[spec.name] = found
    fc1 = next(s for s in moe_specs(ARCHS[90]) if s.name.startswith("moe_fc1_grouped[gpt-oss K2880 I2880 top4, mxfp8 in")
               and s.name.endswith("tile 16,128,64,4,4]"))
    return dict(kernels=kernels, hazards=hazards,
                control=wgmma_register_hazards(_spec_sass(_bf16_act_variant(fc1), 90)))


def compile_all(arch: int) -> list[Result]:
    return [compile_spec(s, arch) for s in all_specs(ARCHS[arch])]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[121, 90], choices=sorted(ARCHS))
    ap.add_argument("--json", help="also write {arch: {kernel: {instructions, shared_bytes, sm90_only}}} here")
    ap.add_argument("--sass-loop", metavar="SUBSTRING",
                    help="instead: SASS instructions of the MMA loop of every kernel whose name contains SUBSTRING")
    ap.add_argument("--sass-order", metavar="NAME", nargs="+",
                    help="instead: {kernel: sass_order} as JSON for these kernel names (sm_90a: the bundled "
                         "cuobjdump cannot disassemble sm_121a)")
    ap.add_argument("--wgmma-hazards", action="store_true",
                    help="instead: JSON {kernels, hazards, control} of wgmma_register_hazards over every sm_90a "
                         "kernel with wgmma, and over a build known to have one (the negative control)")
    args = ap.parse_args(argv)
    if triton.knobs.runtime.interpret:
        raise SystemExit("unset TRITON_INTERPRET: ahead-of-time compilation needs the real compiler")
    if args.wgmma_hazards:
        print(json.dumps(wgmma_hazard_report()))
        return 0
    if args.sass_order:
        specs = {s.name: s for s in all_specs(ARCHS[90])}
        missing = [n for n in args.sass_order if n not in specs]
        if missing:
            raise SystemExit(f"--sass-order: no kernel named {missing}; names: {sorted(specs)}")
        print(json.dumps({n: sass_order(specs[n], 90) for n in args.sass_order}))
        return 0
    if args.sass_loop:
        for arch in args.arch:
            for spec in all_specs(ARCHS[arch]):
                if args.sass_loop in spec.name:
                    try:
                        n, ops = sass_loop(spec, arch)
                    except RuntimeError as e:  # e.g. a cuobjdump without this architecture
                        print(f"sm_{arch}a {spec.name}: no SASS ({e})")
                        continue
                    top = ", ".join(f"{k} {v}" for k, v in list(ops.items())[:16])
                    print(f"sm_{arch}a {spec.name}: {n} instructions per iteration ({spec.num_warps} warps); {top}")
        return 0
    bad = 0
    record = {}
    for arch in args.arch:
        print(f"## sm_{arch}a ({ARCHS[arch]} tiles)\n")
        print("| kernel | shared mem (B) | MMA / load / convert instructions in the PTX |")
        print("| --- | --- | --- |")
        for r in compile_all(arch):
            record.setdefault(f"sm_{arch}a", {})[r.spec] = dict(
                instructions=r.instructions, shared_bytes=r.shared_bytes, sm90_only=r.sm90_only)
            print(f"| {r.spec} | {r.shared_bytes} | {', '.join(r.instructions)} |")
            if arch >= 100 and r.sm90_only:
                bad += 1
                print(f"ERROR: {r.spec} uses sm_90-only instructions on sm_{arch}a: {r.sm90_only}")
        print()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
