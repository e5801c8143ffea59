"""Every kernel compiles for sm_121a and sm_90a without a GPU; the sm_121a PTX has no sm_90-only code.

Runs ``python -m vllm_sm121.kernels.aot`` in a subprocess (the CPU tests set TRITON_INTERPRET=1,
which replaces every @triton.jit function by an interpreted one). The instructions each build
uses are recorded in ``results/ptx_instructions.json`` and printed with ``pytest -s``.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.aot

RESULTS = pathlib.Path(os.environ.get("VLLM_SM121_RESULTS", "results"))


@pytest.fixture(scope="module")
def record():
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "ptx_instructions.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "vllm_sm121.kernels.aot", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=900)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_compiles_for_both_archs(record):
    from vllm_sm121.kernels import aot
    from vllm_sm121 import platform

    assert set(record) == {"sm_121a", "sm_90a"}
    assert set(record["sm_121a"]) == {s.name for s in aot.all_specs(platform.SM12X)}


def test_sm121_has_no_sm90_only_instructions(record):
    for name, info in record["sm_121a"].items():
        assert not info["sm90_only"], f"{name}: {info['sm90_only']}"
        assert not any(i.startswith("wgmma") for i in info["instructions"]), name


def test_sm121_attention_uses_mma_sync_and_fits_shared_memory(record):
    """GB10: the dots become bf16 mma.sync (no wgmma there); tiles fit its ~99 KB of shared memory."""
    for name, info in record["sm_121a"].items():
        if name.startswith("paged_attention"):
            assert any(i.startswith("mma.sync.aligned.m16n8k16") for i in info["instructions"]), name
        assert info["shared_bytes"] <= 99 * 1024, f"{name}: {info['shared_bytes']} B of shared memory"


def test_kv_write_fp8_uses_hardware_conversion_unless_soft(record):
    rows = record["sm_121a"]
    assert any(i.startswith("cvt.rn.satfinite.e4m3") for i in rows["write_kv_cache[fp8]"]["instructions"])
    assert not any(i.startswith("cvt.rn.satfinite") for i in rows["write_kv_cache[fp8,soft-e4m3]"]["instructions"])


def test_grouped_moe_gemms_use_bf16_mma_with_tokens_as_n(record):
    """The swap-AB grouped (prefill) GEMMs at every tile of the table: bf16 mma.sync m16n8k16 on
    sm_121a; on sm_90a wgmma m64 x n = BLOCK_M (tokens are the N, the weight rows the M)."""
    import re

    for arch in ("sm_121a", "sm_90a"):
        rows = {k: v for k, v in record[arch].items() if "_grouped[" in k}
        from vllm_sm121 import platform as P
        from vllm_sm121.kernels import moe as M

        table = M.GROUPED_TILES[P.SM12X if arch == "sm_121a" else P.SM90]
        assert len(rows) >= 2 * len(table) + 1, sorted(record[arch])  # FC1 + FC2 per tile, bf16-input FC1
        for name, info in rows.items():
            mma = [i for i in info["instructions"] if "mma" in i]
            block_m = int(re.search(r"tile (\d+),", name).group(1))
            want = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" if arch == "sm_121a"
                    else f"wgmma.mma_async.sync.aligned.m64n{block_m}k16.f32.bf16.bf16")
            assert mma == [want], (arch, name, mma)


def test_nvfp4_decode_variants_are_shorter_in_sm90_sass(record):
    """Static proxy where no GPU can time it: the MMA loop of the d64 nvfp4 decode kernel with the
    4-bytes-per-block inline-PTX decode (NVFP4_ASM, the sm_90 default) has well under the
    instructions of the per-element bit trick (1659 vs 2062 at b1e239a+1), and the off-by-default
    word variant (NVFP4_WORDS: 32-bit page words, e4m3-byte decode, V as V^T) under NVFP4_ASM's
    (1214 vs 1572 when added; it was nevertheless slower when timed on an H100, so instruction
    counts are only a proxy). Both archs compiled both (ptxas accepted their inline PTX)."""
    for arch in ("sm_90a", "sm_121a"):
        for variant in ("nvfp4-asm", "nvfp4-words-asm"):
            assert f"paged_attention[decode,d64,{variant},all-features]" in record[arch]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "vllm_sm121.kernels.aot", "--arch", "90", "--sass-loop",
                           "decode,d64,nvfp4"], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(proc.stdout)
    loops = {line.split()[1].rstrip(":"): int(line.split(": ")[1].split()[0]) for line in proc.stdout.splitlines()
             if line.startswith("sm_90a ") and "instructions per iteration" in line}
    name = "paged_attention[decode,d64,{},all-features]".format
    base, asm, words = loops[name("nvfp4")], loops[name("nvfp4-asm")], loops[name("nvfp4-words-asm")]
    assert 0 < asm < 0.9 * base, loops
    assert 0 < words < 0.85 * asm, loops


def test_fma_moe_tma_variants_pipeline_bulk_tensor_copies_on_sm90_only(record):
    """The TMA GEMVs (tile stages >= 3; on sm_90 the packed products' default): their sm_90a build
    loads the weight tiles with cp.async.bulk.tensor (Triton's pipeliner, shared-memory stages); no
    sm_121a build has them."""
    import re

    tma = {n: i for n, i in record["sm_90a"].items() if "TMA" in n}
    # FC1 and FC2, with 1 and 4 token accumulators; at one token also with the opt-in scale loads
    # ($VLLM_SM121_MOE_SCALE_LDG) and fp16 word products ($VLLM_SM121_MOE_FMA_F16X2=1)
    assert len([n for n in tma if re.search(r"TMA \d+ stages\]$", n)]) == 4, sorted(tma)
    assert len([n for n in tma if n.endswith(("scale ldg]", "word products]"))]) == 4, sorted(tma)
    for name, info in tma.items():
        assert any(i.startswith("cp.async.bulk.tensor") for i in info["instructions"]), name
        stages = int(re.search(r"TMA (\d+) stages", name).group(1))
        # the pipeliner keeps stages - 1 weight tiles in flight (the smallest tile: FC2's 32 x 256 bytes)
        assert info["shared_bytes"] >= (stages - 1) * 8192, (name, info["shared_bytes"])
    assert not any("TMA" in n for n in record["sm_121a"])


def test_every_constexpr_parameter_compiles_as_a_constant():
    """A constexpr parameter a spec leaves out (PDL, TMA, HAS_MAP, ...) takes its default as a
    constant, as the launchers' calls do, not a runtime i32 (which compiles both branches)."""
    from vllm_sm121 import platform
    from vllm_sm121.kernels import aot

    for family in (platform.SM90, platform.SM12X):
        for spec in aot.all_specs(family):
            sig, _ = aot._signature(spec)
            consts = aot._constexprs(spec)
            assert all(sig[k] == "constexpr" for k in consts), spec.name
            if spec.name.startswith("moe_route"):
                assert "HAS_MAP" in consts, spec.name


def _before(order: list[str], first: tuple[str, ...]) -> list[str]:
    """The ops before the first one starting with any of ``first``."""
    i = next((k for k, op in enumerate(order) if op.startswith(first)), len(order))
    return order[:i]


def test_small_decode_kernels_load_everything_before_waiting():
    """Where no GPU can time them: the small per-layer decode kernels issue all their global loads
    up front, so each makes one memory round trip before its stores (sm_90a SASS; at 56c2045 the
    KV write and the split combine loaded their data after an early-exit test on a loaded index,
    the norms loaded their weights after the sum-of-squares barriers and the router kernel its
    bias after a second one, the dense GEMV its scale and bias after the K loop, the MoE GEMVs
    their bias after the K loop and, in the TMA pipeline, each step's weight scales inside it, and
    the decode attention found its sequence by a binary search of dependent loads, then loaded its
    query range and length one after the other)."""
    names = ["fp4_kv_write[d64,8 heads]", "combine_splits[d64,sinks]", "add_rmsnorm_mxfp8[H2880]",
             "add_rmsnorm_mxfp8_router[H2880,E128]", "dense_fp8_fma[qkv K2880, M1]", "dense_fp8_fma[o K4096, M1]",
             "moe_fc1_swiglu_fma[gpt-oss K2880 I2880 top4, M1, TMA 3 stages]",
             "moe_fc2_fma[gpt-oss H2880 I2880 top4, M1, TMA 3 stages]", "paged_attention[decode,d64,bf16,plain]",
             "paged_attention[decode,d64,nvfp4-asm,all-features]"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "vllm_sm121.kernels.aot", "--sass-order", *names], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    order = json.loads(proc.stdout.strip().splitlines()[-1])
    loads = lambda ops: [op for op in ops if op.startswith("LDG")]  # noqa: E731
    for name in names[:2]:  # every load before the first exit, store or barrier
        assert loads(order[name]) and loads(_before(order[name], ("EXIT", "STG", "BAR"))) == loads(order[name]), \
            (name, order[name])
    for name in names[2:4]:  # every load before the first (reduction) barrier
        assert loads(_before(order[name], ("BAR",))) == loads(order[name]), (name, order[name])
    for name in names[4:6]:  # scale and bias (scalar loads) with the first weights, before the first barrier
        head = _before(order[name], ("BAR",))
        assert {"LDG.E", "LDG.E.U16"} <= set(head) and "LDG.E.128" in head, (name, order[name])
        assert not [op for op in order[name][len(head):] if op in ("LDG.E", "LDG.E.U16")], (name, order[name])
    for name in names[8:]:  # decode attention: the sequence lookup is the three list loads at once, no search loop
        head = _before(order[name], ("EXIT",))
        assert head == ["LDG.E"] * 3, (name, order[name])
    for name in names[6:8]:  # bias (bf16) and the first step's weight scales (bytes) before the pipeline's first wait
        head = _before(order[name], ("SYNCS.PHASECHK",))
        assert "LDG.E.U16" in head and "LDG.E.U8" in head, (name, order[name])
        assert "LDG.E.U16" not in order[name][len(head):], (name, order[name])


def test_no_sm90_kernel_leaves_a_register_operand_wgmma_in_flight():
    """Every sm_90a kernel with wgmma waits for a wgmma group whose A operand is in registers before it rewrites
    those registers (``aot.wgmma_register_hazards``): the cause of the stop-43 wrong outputs of the grouped MoE
    GEMMs with bf16 activations. The negative control (that build, no longer launched on sm_90) is flagged."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "vllm_sm121.kernels.aot", "--wgmma-hazards"], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["kernels"] >= 10 and report["control"], report
    assert not report["hazards"], report["hazards"]
