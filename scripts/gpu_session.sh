#!/usr/bin/env bash
# On the lent GPU machine (see ../shared/gpu-bundle/README.md): install the vLLM bundle's last
# part, this package, then run the named steps, logging to $OUT.
#   bash scripts/gpu_session.sh <part-dir> [tests|e2e|bench|quickbench|tune|aot|moebench|moetests]...
set -uo pipefail
export PYTHONUNBUFFERED=1
part=$1; shift
if [ -d /tmp/vllm-bundle/site/vllm ]; then
  export PYTHONPATH=/tmp/vllm-bundle/site PATH=/tmp/vllm-bundle/site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0
else
  [ -f "$part/install.sh" ] || { echo "no vLLM bundle here: carry $part (fresh machine)"; exit 3; }
  eval "$(bash "$part/install.sh" | tail -1)" || exit 3
fi
python3 -c "import vllm" || { echo "vLLM is not importable"; exit 3; }
[ -n "${SM121_NO_PIP:-}" ] || python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 4; }
python3 -c "import vllm_sm121.kernels" || exit 5
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export VLLM_SM121_RESULTS=$OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
reap_gpu() {  # a call cut by its time limit leaves engine workers holding ~all GPU memory (stop 36)
  local p pids="" i
  for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' '); do
    # only this machine's own processes (a PID nvidia-smi reports from another namespace has no /proc entry
    # here), never this shell
    [ -d "/proc/$p" ] && [ "$p" != "$$" ] && [ "$(stat -c %u "/proc/$p")" = "$(id -u)" ] && pids+="$p "
  done
  [ -n "$pids" ] || return 0
  echo "killing leftover GPU processes of an earlier call: $pids"; kill -9 $pids 2>/dev/null
  for i in $(seq 30); do  # until the driver has released their memory (at most 30 s)
    [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ')" ] && break; sleep 1
  done
}
[ -n "${SM121_PAR_CHILD:-}" ] || reap_gpu  # (par's jobs run at once: only the top-level call reaps)
wm_test() {  # tests/test_whole_model_gpu.py [-k EXPR], its summary lines
  local log="$OUT/wmtest${1:+_$1}.log"
  python3 -m pytest -q -s tests/test_whole_model_gpu.py ${1:+-k "$1"} -p no:cacheprovider > "$log" 2>&1; local r=$?
  grep -E "stats|verification|same engine|one engine|mode on|control|distinct|seeded|logprobs,|passed|failed|Error|^E " "$log" | head -n 30
  return $r
}
rc=0
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    tests) python3 -m pytest -q -m "gpu or interpreter" tests --ignore=tests/test_e2e_gpu.py -p no:cacheprovider 2>&1 | tail -n 40 | tee "$OUT/tests.log" ;;
    alltests) python3 -m pytest -q tests --ignore=tests/test_e2e_gpu.py -p no:cacheprovider 2>&1 | tail -n 60 | tee "$OUT/alltests.log" ;;
    e2e) python3 -m pytest -q -s tests/test_e2e_gpu.py -p no:cacheprovider > "$OUT/e2e_full.log" 2>&1; r=$?
         grep -E "Error|error|gap|spread|passed|failed" "$OUT/e2e_full.log" | grep -v "^\s*$" | head -n 60; tail -n 5 "$OUT/e2e_full.log"; (exit $r) ;;
    bench) python3 benchmarks/attention.py --out "$OUT/attention.json" 2>&1 | tee "$OUT/bench.log" | tail -n 150 ;;
    quickbench) python3 benchmarks/attention.py --quick --out "$OUT/attention_quick.json" 2>&1 | tee "$OUT/bench.log" | tail -n 80 ;;
    e2equick) python3 benchmarks/e2e.py --quick ${E2E_CONFIGS:+--configs "$E2E_CONFIGS"} --out "$OUT/e2e_quick${E2E_TAG:-}.json" 2>&1 | tee "$OUT/e2e_quick${E2E_TAG:-}.log" | tail -n 60 ;;
    e2e120b) python3 benchmarks/e2e.py --model models/gpt-oss-120b ${E2E_CONFIGS:+--configs "$E2E_CONFIGS"} ${E2E_ARGS:-} --out "$OUT/e2e_120b${E2E_TAG:-}.json" 2>&1 | tee "$OUT/e2e_120b${E2E_TAG:-}.log" | tail -n 60 ;;
    e2etp) python3 benchmarks/e2e.py --model models/gpt-oss-120b --tensor-parallel-size "${E2E_TP:-2}" --configs "${E2E_CONFIGS:-upstream-default,sm121-nvfp4kv}" ${E2E_ARGS:-} --out "$OUT/e2e_120b_${E2E_TAG:-tp2}.json" 2>&1 | tee "$OUT/e2e_120b_${E2E_TAG:-tp2}.log" | tail -n 60 ;;
    tptests) VLLM_SM121_MOE_EXPERIMENTAL=1 python3 -m pytest -q -m gpu tests/test_tp_gpu.py ${TP_K:+-k "$TP_K"} -s -p no:cacheprovider 2>&1 | tee "$OUT/tptests.log" | tail -n 40 ;;
    e2e20b) python3 benchmarks/e2e.py --model models/gpt-oss-20b ${E2E_CONFIGS:+--configs "$E2E_CONFIGS"} ${E2E_ARGS:-} --out "$OUT/e2e_20b${E2E_TAG:-}.json" 2>&1 | tee "$OUT/e2e_20b${E2E_TAG:-}.log" | tail -n 60 ;;
    tune) python3 benchmarks/tune_attention.py --out "$OUT/tune.json" 2>&1 | tee "$OUT/tune.log" | tail -n 80 ;;
    serve) python3 scripts/serve_check.py --model models/gpt-oss-tiny --expect-layers 4 --log "$OUT/serve_fp.log" -- --max-cudagraph-capture-size 8 ;;
    servefull) python3 scripts/serve_check.py --model models/gpt-oss-tiny --expect-layers 5 --stagger 0.03 --log "$OUT/serve_full.log" -- -cc.cudagraph_mode=FULL --max-cudagraph-capture-size 512 --speculative-config '{"method":"eagle3","model":"tests/eagle3-gpt-oss-tiny","num_speculative_tokens":3}' ;;
    eagle) python3 scripts/serve_check.py --model models/gpt-oss-tiny --expect-layers 5 --log "$OUT/serve_eagle.log" -- --max-cudagraph-capture-size 64 --speculative-config '{"method":"eagle3","model":"tests/eagle3-gpt-oss-tiny","num_speculative_tokens":3}' ;;
    e2e_numerics) python3 -m pytest -q -s tests/test_e2e_gpu.py -k "prompt_logprobs" -p no:cacheprovider > "$OUT/e2e_numerics.log" 2>&1; r=$?
         grep -E "^\[|Error|passed|failed" "$OUT/e2e_numerics.log" | head -n 40; (exit $r) ;;
    e2e_graphs) python3 -m pytest -q -s tests/test_e2e_gpu.py -k "graph" -p no:cacheprovider > "$OUT/e2e_graphs.log" 2>&1; r=$?
         grep -E "gap|Error|passed|failed" "$OUT/e2e_graphs.log" | head -n 40; (exit $r) ;;
    eagle_nvfp4) python3 scripts/serve_check.py --model models/gpt-oss-tiny --expect-layers 5 --log "$OUT/serve_eagle_nvfp4.log" -- --kv-cache-dtype nvfp4 --max-cudagraph-capture-size 64 --speculative-config '{"method":"eagle3","model":"tests/eagle3-gpt-oss-tiny","num_speculative_tokens":3}' ;;
    w8a8drift) python3 -m pytest -q -s tests/test_e2e_gpu.py -k "w8a8" -p no:cacheprovider > "$OUT/w8a8drift.log" 2>&1; r=$?
         grep -E "^\[w8a8|Error|passed|failed|^E " "$OUT/w8a8drift.log" | head -n 20; (exit $r) ;;
    e2e_moe) VLLM_SM121_MOE_EXPERIMENTAL=1 python3 -m pytest -q -s tests/test_e2e_gpu.py -k "${E2E_MOE_K:-moe}" -p no:cacheprovider > "$OUT/e2e_moe.log" 2>&1; r=$?
         grep -E "^\[|Error|passed|failed" "$OUT/e2e_moe.log" | head -n 40; (exit $r) ;;
    tunekv) python3 benchmarks/tune_kv.py --out "$OUT/tune_kv.json" 2>&1 | tee "$OUT/tune_kv.log" | grep -E "^(==|device)|Error" ;;
    tunekvprefill) python3 benchmarks/tune_kv.py --prefill --out "$OUT/tune_kv_prefill.json" 2>&1 | tee "$OUT/tune_kv_prefill.log" | grep -E "^(==|device)|Error" ;;
    # test_fp4_kv.py's kernel tests are marked "interpreter" and run on the GPU when one exists
    kvtests) python3 -m pytest -q -m "gpu or interpreter" tests/test_fp4_kv.py tests/test_paged_attention.py -p no:cacheprovider 2>&1 | tail -n 25 | tee "$OUT/kvtests.log" ;;
    moequick) python3 benchmarks/moe.py --m 1,2,4,8,64,512 --out "$OUT/moe.json" 2>&1 | tee "$OUT/moebench.log" | tail -n 45 ;;
    e2e_prefix) python3 -m pytest -q -s tests/test_e2e_gpu.py -k "nvfp4_prefix" -p no:cacheprovider > "$OUT/e2e_prefix.log" 2>&1; r=$?
         grep -E "^nvfp4|Error|passed|failed" "$OUT/e2e_prefix.log" | head -n 20; (exit $r) ;;
    kvacc) python3 benchmarks/kv_accuracy.py --kernel --out "$OUT/kv_accuracy.json" 2>&1 | tail -n 12 ;;
    benchkv) for kv in fp8 nvfp4; do python3 benchmarks/attention.py --kv-dtype $kv --out "$OUT/attention_$kv.json" 2>&1 | tee "$OUT/bench_$kv.log" | grep -E "^(decode full|device|copy)" ; done ;;
    e2e_kv) python3 -m pytest -q -s tests/test_e2e_gpu.py -k "quantized or nvfp4" -p no:cacheprovider > "$OUT/e2e_kv.log" 2>&1; r=$?
         grep -E "^\[|nvfp4|Error|passed|failed" "$OUT/e2e_kv.log" | head -n 40; (exit $r) ;;
    moebench) python3 benchmarks/moe.py --out "$OUT/moe.json" 2>&1 | tee "$OUT/moebench.log" | tail -n 80 ;;
    moegsweep) python3 benchmarks/moe.py --m "${MOE_M:-8,64,512,4096}" --providers "${MOE_PROVIDERS:-sm121_grouped,triton}" ${MOE_GROUPED_TILES:+--grouped-tiles "$MOE_GROUPED_TILES"} --out "$OUT/moe_grouped_sweep${MOE_TAG:-}.json" 2>&1 | tee "$OUT/moegsweep${MOE_TAG:-}.log" | grep -v "^INFO\|^WARNING" | tail -n 70 ;;
    moepdl) for v in 0 1; do VLLM_SM121_MOE_PDL=$v python3 benchmarks/moe.py --m 1,2,4 --in-graph "${MOE_IN_GRAPH:-0}" --providers sm121_fma,triton --fma-tiles "${MOE_FMA_TILES:-64,256,32,256,4,1;64,256,32,256,4,1,4,2}" --out "$OUT/moe_pdl$v.json" 2>&1 | tee "$OUT/moepdl$v.log" | grep -E "^(tile|fastest|[0-9])" | tail -n 12; done ;;  # programmatic dependent launch off / on
    moeprobe) python3 benchmarks/moe_probe.py ${MOEPROBE_ARGS:-} --out "$OUT/moe_probe.json" 2>&1 | tee "$OUT/moeprobe.log" | grep -v "^INFO\|^WARNING" | tail -n 40
              ncu --clock-control none -k "regex:_moe_fc1_swiglu_fma|_moe_fc2_fma|_stream_kernel" --launch-count ${NCU_COUNT:-10} \
                --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --section SchedulerStats \
                --section MemoryWorkloadAnalysis python3 benchmarks/moe_probe.py --ncu --m ${NCU_M:-1} --splits 1,3 --warps 4 \
                > "$OUT/moeprobe_ncu.log" 2>&1; grep -E "^  _|Duration|Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Issued Warp|No Eligible|Theoretical Occ|Block Limit" "$OUT/moeprobe_ncu.log" | head -n 120 ;;
    moesplit) python3 benchmarks/moe.py --m "${MOE_M:-1,2,4}" --in-graph "${MOE_IN_GRAPH:-10}" --providers sm121_fma,triton --fma-tiles "${MOE_FMA_TILES:-64,256,32,256,4,1;64,256,32,256,4,1,4,1,1,2;64,256,32,256,4,1,4,1,1,3;64,256,32,256,4,1,4,1,3,3;64,256,32,256,8,1,8,1,3,3;64,256,32,256,4,1,4,1,2,2;64,256,32,256,4,1,4,1,6,6;64,256,32,256,4,2,4,2,3,3}" --out "$OUT/moe_split${MOE_TAG:-}.json" 2>&1 | tee "$OUT/moesplit${MOE_TAG:-}.log" | grep -v "^INFO\|^WARNING" | tail -n 45 ;;
    moefmaall) python3 -m pytest -q -s tests/test_moe.py -k "${MOE_K:-fma}" -p no:cacheprovider 2>&1 | tee "$OUT/moefmaall.log" | grep -E "M=|passed|failed|Error" | tail -n 30 ;;
    moencu) ncu --clock-control none -k "regex:_moe_fc1_swiglu_fma|_moe_fc2_fma" --launch-count ${NCU_COUNT:-7} \
              --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --section SchedulerStats \
              --section MemoryWorkloadAnalysis --section InstructionStats --section SourceCounters \
              python3 benchmarks/moe_probe.py --ncu --no-stream --m ${NCU_M:-1} > "$OUT/moencu${NCU_TAG:-}.log" 2>&1
            grep -E "^  _|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Issued Warp|Theoretical Occ" "$OUT/moencu${NCU_TAG:-}.log" | head -n 60 ;;
    moetma) python3 benchmarks/moe.py --m "${MOE_M:-1,2,4}" --in-graph 10 --providers sm121_fma,triton --fma-tiles "${MOE_FMA_TILES:-64,256,32,256,4,1;64,256,32,256,8,1,4,1;64,256,32,256,4,3;64,256,32,256,4,4;64,256,32,256,4,6;64,256,32,256,8,4;64,256,32,256,8,4,4,4;64,256,32,256,8,4,8,4;64,256,32,256,8,4,4,4,1,2}" --out "$OUT/moe_tma${MOE_TAG:-}.json" 2>&1 | tee "$OUT/moetma${MOE_TAG:-}.log" | grep -v "^INFO\|^WARNING" | tail -n 40
            python3 -m pytest -q -s -m gpu tests/test_moe.py -k "tiles_on_gpu or register_cap or fused_routing" -p no:cacheprovider 2>&1 | tail -n 3 ;;  # the TMA tiles', register cap's and fused routing's GPU tests
    moef16split) fail=0; for cap in 0 128; do echo "packed fp16 products, register cap $cap (0: none)"  # FC1 / FC2 split-K with the packed products
                   VLLM_SM121_MOE_FMA_F16X2=1 VLLM_SM121_MOE_FMA_MAXNREG=$cap python3 benchmarks/moe.py --m "${MOE_M:-1,2,4}" --in-graph 10 --providers sm121_fma \
                     --fma-tiles "${MOE_FMA_TILES:-64,256,32,256,4,2;64,256,32,256,4,2,4,2,1,2;64,256,32,256,4,2,4,2,1,3;64,256,32,256,4,2,4,2,1,4;64,256,32,256,4,2,4,2,2,3;64,256,32,256,4,2,4,2,3,3;64,256,32,256,8,2,4,2,1,3;64,256,16,256,4,2;64,256,64,256,4,2;64,256,32,512,4,2;64,256,32,128,4,2;64,256,32,256,4,3;64,256,32,256,4,4;64,256,32,256,4,4,4,4,1,3}" \
                     --out "$OUT/moe_f16split_r$cap.json" > "$OUT/moef16split_r$cap.log" 2>&1 || fail=1
                   grep -v "^INFO\|^WARNING" "$OUT/moef16split_r$cap.log" | tail -n 25; done; (exit $fail) ;;
    quickgpu) python3 -m pytest -q -m "gpu or interpreter" tests/test_dense.py tests/test_fp4_kv.py -p no:cacheprovider 2>&1 | tail -n 4 | tee "$OUT/quickgpu.log"  # dense one-token tiles, the two-program KV write
         python3 benchmarks/dense.py --m 1 --providers sm121,cublas_bf16 --out "$OUT/dense_m1.json" 2>&1 | tee "$OUT/dense_m1.log" | grep -E "^(qkv|o |lm_head|device)" ;;
    # Stop 26's weight scales one step ahead in the TMA GEMVs: off then on in one run (in-graph, the default tiles),
    # and the norm / router kernels in the same job (load order changed there too).
    scalesahead) for v in 0 1; do VLLM_SM121_MOE_SCALES_AHEAD=$v python3 benchmarks/moe.py --m "${MOE_M:-1,2,4}" --in-graph 10 --providers sm121_fma,triton --out "$OUT/moe_scales_ahead$v.json" 2>&1 | tee "$OUT/scalesahead$v.log" | grep -v "^INFO\|^WARNING" | tail -n 8; done ;;
    normrouter) python3 benchmarks/moe.py --m "${MOE_M:-1,2,4,8}" --in-graph 10 --providers sm121_fma --norm-router --out "$OUT/moe_norm_router.json" 2>&1 | tee "$OUT/normrouter.log" | grep -v "^INFO\|^WARNING" | tail -n 14 ;;  # the router inside the norm kernel vs norm + cuBLAS
    # Stop 26's kernel changes (all GPU-untested when made): the kernel tests of every kernel they
    # touched, on the GPU (norms + router, KV write, split combine and decode attention, dense GEMV
    # incl. the rotation epilogue, the MoE FMA GEMVs incl. the TMA tiles, packed products, PDL).
    loadorder) python3 -m pytest -q -m "gpu or interpreter" tests/test_norm_mxfp8.py tests/test_fp4_kv.py tests/test_paged_attention.py tests/test_dense.py -p no:cacheprovider > "$OUT/loadorder.log" 2>&1; r=$?
         python3 -m pytest -q -m "gpu or interpreter" tests/test_moe.py -k "fma or f16x2 or fused or pdl or scales" -p no:cacheprovider >> "$OUT/loadorder.log" 2>&1 || r=1
         grep -E "passed|failed|Error|^E " "$OUT/loadorder.log" | tail -n 30; (exit $r) ;;
    # Stop 27's defaults on the GPU: the attention's in-kernel split merge (every split test of the
    # kernel and nvfp4 suites takes it now), the MoE's fused routing / combine (and their defaults).
    stop27) python3 -m pytest -q -m "gpu or interpreter" tests/test_paged_attention.py tests/test_fp4_kv.py -p no:cacheprovider > "$OUT/stop27.log" 2>&1; r=$?
         python3 -m pytest -q -m "gpu or interpreter" tests/test_moe_parallel.py tests/test_moe.py -k "fused or pdl" -p no:cacheprovider >> "$OUT/stop27.log" 2>&1 || r=1
         grep -E "passed|failed|Error|^E " "$OUT/stop27.log" | tail -n 30; (exit $r) ;;
    # Stop 27's opt-in KV write inside the qkv GEMV (VLLM_SM121_KV_IN_QKV=1): its kernel, op and hook tests on the
    # GPU, then gpt-oss-120b batch 1 with and without it (same machine, one run).
    kvwrite) python3 -m pytest -q -m "gpu or interpreter" tests/test_fp4_kv.py -k "write or calibration or power_of_two" -p no:cacheprovider 2>&1 | tail -n 8 | tee "$OUT/kvwrite.log" ;;  # the nvfp4 KV write kernel alone
    normroutersweep) for tl_ in ${NR_TILES:-4,4,128 4,4 2,4 1,4 4,8 2,2 1,2 8,4}; do  # the router kernel's tiles (4,4,128: all MXFP8 blocks on program 0, as before)
                       VLLM_SM121_NORM_ROUTER_TILES=$tl_ python3 benchmarks/moe.py --m 1,2,4 --in-graph 10 --providers , --norm-router \
                         --out "$OUT/norm_router_${tl_//,/_}.json" 2>&1 | grep -A5 "^norm ->"; done ;;
    normtests) python3 -m pytest -q -m "gpu or interpreter" tests/test_norm_mxfp8.py tests/test_ops.py -p no:cacheprovider 2>&1 | tail -n 6 | tee "$OUT/normtests.log" ;;
    minsplit) python3 -m pytest -q -m "gpu or interpreter" tests/test_paged_attention.py -k "min_split or fused_split or graph" -p no:cacheprovider 2>&1 | tail -n 4 | tee "$OUT/minsplit_tests.log"
              for n in ${MINSPLIT_TOKENS:-0 64 128 256}; do echo "--- min split tokens $n"  # short contexts on a graph's 64 splits
                VLLM_SM121_ATTN_MIN_SPLIT_TOKENS=$n python3 benchmarks/attention.py --kinds decode --providers sm121 --kv-dtype nvfp4 \
                  --ctx "${MINSPLIT_CTX:-128,512,2048,8192}" --batch 1,8 --window 128 --sm121-split-seq-len 4096 \
                  --out "$OUT/attention_minsplit_$n.json" 2>&1 | grep -E "^decode|refcheck"; done ;;
    splittests) python3 -m pytest -q -m "gpu or interpreter" tests/test_paged_attention.py tests/test_fp4_kv.py -k "split or graph or nvfp4_pages" -p no:cacheprovider 2>&1 | tail -n 4 | tee "$OUT/splittests.log" ;;
    attnncu) ncu --clock-control none -k "regex:_paged_attention_kernel" --launch-count ${NCU_COUNT:-4} \
               --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --section SchedulerStats \
               --section MemoryWorkloadAnalysis --section SourceCounters \
               python3 benchmarks/attention.py --kinds decode --providers sm121 --kv-dtype nvfp4 --ctx "${NCU_CTX:-128}" --batch 1 \
                 --window 128 --sm121-split-seq-len 4096 --reps 1 --no-refcheck --out "$OUT/attention_ncu.json" > "$OUT/attnncu.log" 2>&1
             grep -E "^  _|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Issued Warp|Grid Size|Waves Per SM" "$OUT/attnncu.log" | head -n 60 ;;  # the short-context decode attention under a 4k graph's 64 splits
    attnsass) for ly in ${ATTN_LAYERS:-full sliding}; do  # per-SASS stall samples of one short-context decode attention launch per layer kind (as moesass)
               ncu --clock-control none -k "regex:_paged_attention_kernel" --launch-skip 2 --launch-count 1 --section SourceCounters \
                 --section WarpStateStats --section LaunchStats --section Occupancy -f -o /tmp/attnsass_$ly \
                 python3 benchmarks/attention.py --kinds decode --layers $ly --providers sm121 --kv-dtype "${NCU_KV:-nvfp4}" \
                 --ctx "${NCU_CTX:-128}" --batch 1 --sm121-split-seq-len 4096 --reps 3 --no-refcheck --out "$OUT/attnsass_$ly.json" > "$OUT/attnsass_run_$ly.log" 2>&1
               ncu -i /tmp/attnsass_$ly.ncu-rep --page source --csv --print-source sass > "$OUT/attnsass_$ly.csv" 2>&1
               ncu -i /tmp/attnsass_$ly.ncu-rep --page details --print-details all > "$OUT/attnsass_details_$ly.txt" 2>&1
               grep -E "Duration|Grid Size|Registers Per|Warp Cycles Per Issued|Achieved Occupancy" "$OUT/attnsass_details_$ly.txt" | head -n 8
             done ;;
    attntiles) for t in ${ATTN_TILES:-16,128,4,3}; do  # the nvfp4 decode attention per tile: short contexts under a 4k graph's splits, then b8 ctx32k
               echo "--- tile $t"
               VLLM_SM121_ATTN_TILE="decode_nvfp4=$t" python3 benchmarks/attention.py --kinds decode --layers full,sliding --providers sm121 \
                 --kv-dtype nvfp4 --ctx "${ATTN_CTX:-128,1024,8192}" --batch 1 --sm121-split-seq-len 4096 --no-refcheck \
                 --out "$OUT/attntile_${t//,/_}_short.json" 2>&1 | grep -E "^\[|Error|error" | tail -n 8
               VLLM_SM121_ATTN_TILE="decode_nvfp4=$t" python3 benchmarks/attention.py --kinds decode --layers full --providers sm121 \
                 --kv-dtype nvfp4 --ctx 32768 --batch 8 --no-refcheck --out "$OUT/attntile_${t//,/_}_long.json" 2>&1 | grep -E "^\[|Error|error" | tail -n 3
             done ;;
    carrytests) python3 -m pytest -q -s -m gpu tests/test_next_norm.py -p no:cacheprovider 2>&1 | tee "$OUT/normtests.log" | grep -E "^M=|passed|failed|Error|^E " | tail -n 12
               python3 -m pytest -q -s tests/test_e2e_gpu.py -k carried -p no:cacheprovider > "$OUT/e2e_carried.log" 2>&1; r=$?
               grep -E "carried input norm|passed|failed|Error|^E " "$OUT/e2e_carried.log" | tail -n 15; (exit $r) ;;  # the carried input norm: kernels, then tiny end to end
    carrykernels) python3 -m pytest -q -s -m gpu tests/test_next_norm.py tests/test_dense.py -k "carried or rope or fma" -p no:cacheprovider 2>&1 | tee "$OUT/carrykernels.log" | grep -E "^M=|passed|failed|Error|^E " | tail -n 12 ;;
    carrybench) python3 benchmarks/norm_carry.py --out "$OUT/norm_carry.json" 2>&1 | tee "$OUT/normcarry.log" | grep -v "^INFO\|^WARNING" | tail -n 8 ;;  # one layer boundary: upstream order vs carried norm
    l2probe) python3 benchmarks/l2_probe.py ${L2_TILES:+--tiles "$L2_TILES"} --out "$OUT/l2_probe${L2_TAG:-}.json" 2>&1 | tee "$OUT/l2probe${L2_TAG:-}.log" | grep -v "^INFO\|^WARNING" | tail -n 30 ;;  # GEMV cold / hot / after an L2 prefetch (export L2_TILES="r,kw,w;..." for dense tiles cold / hot: PAR VARS cannot carry ";")
    gemvtiles) python3 benchmarks/gemv_tiles.py --shapes "${GEMV_SHAPES:-qkv,o,lm_head}" --m "${GEMV_M:-1}" --fma-tiles "${GEMV_FMA_TILES:-default}" --mmav-tiles "${GEMV_MMAV_TILES:-default}" ${GEMV_ARGS:-} --out "$OUT/gemv_tiles${GEMV_TAG:-}.json" 2>&1 | tee "$OUT/gemvtiles${GEMV_TAG:-}.log" | grep -v "^INFO\|^WARNING" | tail -n 60 ;;  # one-token dense GEMV per path / tile, cold and hot (export GEMV_MMAV_TILES="r,kb,split,w,st;...": ";" cannot go through PAR VARS)
    densekernels) python3 -m pytest -q -m "gpu or interpreter" tests/test_dense.py tests/test_dense_mmav.py ${DENSE_K:+-k "$DENSE_K"} -p no:cacheprovider 2>&1 | tail -n 8 | tee "$OUT/densekernels.log" ;;
    pdltests) python3 -m pytest -q -m "gpu or interpreter" tests/test_pdl.py tests/test_dense.py -k "pdl" -p no:cacheprovider 2>&1 | tail -n 25 | tee "$OUT/pdltests.log" ;;
    moesass) ncu --clock-control none -k "regex:${NCU_KERNEL:-_moe_fc1_swiglu_fma}" --launch-skip 2 --launch-count 1 --section SourceCounters \
               --section WarpStateStats --section InstructionStats -f -o /tmp/moesass python3 benchmarks/moe_probe.py --ncu --no-stream --m 1 > "$OUT/moesass_run.log" 2>&1
             ncu -i /tmp/moesass.ncu-rep --page source --csv --print-source sass > "$OUT/moesass${NCU_TAG:-}.csv" 2>&1
             ncu -i /tmp/moesass.ncu-rep --page details --print-details all > "$OUT/moesass_details${NCU_TAG:-}.txt" 2>&1
             wc -l "$OUT/moesass${NCU_TAG:-}.csv"; head -c 400 "$OUT/moesass${NCU_TAG:-}.csv"; echo ;;  # per-SASS-instruction stall samples of one FMA MoE GEMV launch (CSV)
    moeab) for v in ${AB_VALUES:-0 1}; do env "${AB_VAR:?export AB_VAR, e.g. VLLM_SM121_MOE_SCALE_LDG}=$v" python3 benchmarks/moe_probe.py --rotate --no-stream --m "${NCU_M:-1,2,4}" --reps "${PROBE_REPS:-30}" --out "$OUT/moe_probe_${AB_VAR}_$v.json" 2>&1 | tee "$OUT/moeprobe_${AB_VAR}_$v.log" | grep -E "fma|device" ; done ;;  # the MoE FMA GEMVs cold / hot with $AB_VAR at each of $AB_VALUES (VLLM_SM121_MOE_ACT_LDG / _SCALE_LDG: 0 1; _FMA_F16X2: 1 2)
    mmavtests) python3 -m pytest -q -m "gpu or interpreter" tests/test_dense_mmav.py ${MMAV_K:+-k "$MMAV_K"} -p no:cacheprovider 2>&1 | tail -n 8 | tee "$OUT/mmavtests.log" ;;
    l2tests) python3 -m pytest -q -m "gpu or interpreter" tests/test_l2_prefetch.py ${L2_K:+-k "$L2_K"} -p no:cacheprovider 2>&1 | tail -n 6 | tee "$OUT/l2tests.log" ;;  # prefetch placements: bit-identical outputs
    kvqkv) python3 -m pytest -q -m "gpu or interpreter" tests/test_dense.py tests/test_dense_method.py tests/test_moe_hook.py -k "kv_write or writes_the_nvfp4 or qkv_op or kv_in_qkv" -p no:cacheprovider > "$OUT/kvqkv.log" 2>&1; r=$?
           grep -E "passed|failed|Error|^E " "$OUT/kvqkv.log" | tail -n 20
           python3 benchmarks/e2e.py --model models/gpt-oss-120b --configs sm121-all-moe,sm121-all-moe-kvqkv ${E2E_ARGS:-} --out "$OUT/e2e_120b_kvqkv.json" 2>&1 | tee "$OUT/e2e_120b_kvqkv.log" | tail -n 12; (exit $r) ;;
    routertests) python3 -m pytest -q -s -m "gpu or interpreter" tests/test_norm_mxfp8.py tests/test_moe_block.py tests/test_moe.py -k "router or gpt_oss_shapes or f16x2 or tiles_on_gpu or matches_reference" -p no:cacheprovider > "$OUT/routertests.log" 2>&1; r=$?
         grep -E "packed fp16|passed|failed|Error|^E " "$OUT/routertests.log" | tail -n 30; (exit $r) ;;  # the fused router and the default packed products on the GPU
    moeupstream) python3 benchmarks/moe.py --m "${MOE_M:-1,2,4,8,64,512}" --in-graph 10 --providers sm121,triton,marlin --out "$OUT/moe_upstream${MOE_TAG:-}.json" 2>&1 | tee "$OUT/moeupstream${MOE_TAG:-}.log" | grep -v "^INFO\|^WARNING" | tail -n 30 ;;  # issue 6: every upstream backend that runs here
    moefused) fail=0; for v in 00 10 01 11; do echo "fused route ${v:0:1}, fused combine ${v:1:1}"  # routing / combine launches vs inside FC1 / FC2
                VLLM_SM121_MOE_FUSED_ROUTE=${v:0:1} VLLM_SM121_MOE_FUSED_COMBINE=${v:1:1} python3 benchmarks/moe.py --m "${MOE_M:-1,2,4}" --in-graph 10 --providers sm121_fmaq --out "$OUT/moe_fused$v.json" > "$OUT/moefused$v.log" 2>&1 || fail=1
                grep -E "^sm121|Error" "$OUT/moefused$v.log" ; done; (exit $fail) ;;
    moefmatests) python3 -m pytest -q -s -m gpu tests/test_moe.py -k "fma and not fma_tiles_on_gpu" -p no:cacheprovider 2>&1 | tee "$OUT/moefmatests.log" | grep -E "M=|passed|failed|Error" | tail -n 30 ;;
    moefmatiles) python3 -m pytest -q -s -m gpu tests/test_moe.py -k "fma_tiles_on_gpu" -p no:cacheprovider 2>&1 | tee "$OUT/moefmatiles.log" | grep -E "M=|passed|failed|Error" | tail -n 30 ;;  # (10 tile lists, compile-heavy: the step above was cut twice)
    moetests) python3 -m pytest -q -s -m gpu tests/test_moe*.py ${MOE_K:+-k "$MOE_K"} -p no:cacheprovider 2>&1 | tee "$OUT/moetests.log" | grep -E "M=|passed|failed|Error" | tail -n 60 ;;
    densetests) python3 -m pytest -q -s -m gpu tests/test_dense.py tests/test_dense_method.py tests/test_dense_wiring.py -p no:cacheprovider 2>&1 | tee "$OUT/densetests.log" | grep -E "delta|passed|failed|Error" | tail -n 30 ;;
    densegpu) python3 -m pytest -q -m gpu tests/test_dense.py -p no:cacheprovider 2>&1 | tail -n 15 | tee "$OUT/densegpu.log" ;;
    moefmasweep) python3 benchmarks/moe.py --m 1,2,4 --providers sm121_fma,triton --fma-tiles "${MOE_FMA_TILES:-64,256,32,256,4,1;64,256,32,256,4,1,4,1,2;64,256,32,256,4,1,4,1,4;64,256,16,256,4,1,4,1,2;64,256,32,256,8,2,4,2,2;64,256,32,256,8,2,4,2,4}" --out "$OUT/moe_fma_sweep.json" 2>&1 | tee "$OUT/moefmasweep.log" | grep -v "^INFO\|^WARNING" | tail -n 40 ;;
    # The one-token sweep of stop 25 won with the fewest K steps (each step is a dependent memory
    # round trip: its barriers keep the next step's loads behind it); the default list adds tiles
    # with one K step (kw 1024: every weight load issued at once; sm_90a, no spills, 47-80 regs).
    densesweep) python3 benchmarks/dense.py --m 1,2,4 --providers sm121,sm121_mma,cublas_bf16 --fma-tiles "${DENSE_FMA_TILES:-8,256,8;16,128,8;8,512,8;8,1024,8;4,1024,8;4,1024,4;8,1024,16;16,1024,16;4,512,4}" --out "$OUT/dense_sweep.json" 2>&1 | tee "$OUT/densesweep.log" | tail -n 50 ;;
    densemmav32) fail=0; python3 -m pytest -q -m "gpu or interpreter" tests/test_dense_mmav.py -p no:cacheprovider 2>&1 | tail -n 4 | tee "$OUT/densemmav32_tests.log"; [ "${PIPESTATUS[0]}" = 0 ] || fail=1  # stop 40: the 32-wide token tile (17-32 tokens), tests then timing
                python3 benchmarks/dense.py --m "${DENSE_M:-16,17,24,32}" --shapes "${DENSE_SHAPES:-qkv,o,lm_head}" --providers sm121_mma,sm121_mmav,cublas_bf16,vllm_cutlass_fp8 --out "$OUT/dense_mmav32.json" > "$OUT/densemmav32.log" 2>&1 || fail=1
                grep -E "^(device|shape|qkv|o |lm_head)" "$OUT/densemmav32.log"; (exit $fail) ;;
    densexrows) fail=0; for v in 1 0; do echo "VLLM_SM121_DENSE_X_ROWS=$v"  # stop 40: activations in the weight tile's layout (1) vs broadcast through shared memory (0)
                VLLM_SM121_DENSE_X_ROWS=$v python3 benchmarks/dense.py --m "${DENSE_M:-1,2,4}" --shapes "${DENSE_SHAPES:-qkv,o,lm_head}" --providers sm121,cublas_bf16 --fma-tiles "${DENSE_FMA_TILES:-8,256,8;4,512,4;8,512,8;16,256,8;4,1024,8;16,128,8}" --out "$OUT/dense_xrows$v.json" > "$OUT/densexrows$v.log" 2>&1 || fail=1
                grep -E "^(device|shape|qkv|o |lm_head|  [0-9])" "$OUT/densexrows$v.log" | tail -n 45; done; (exit $fail) ;;
    moewindow) python3 benchmarks/moe.py --m ${MOE_M:-1,4,5,8,16,32,64} --providers sm121_fma,sm121_grouped,triton --out "$OUT/moe_window.json" 2>&1 | tee "$OUT/moewindow.log" | grep -v "^INFO\|^WARNING" | tail -n 40 ;;  # the windowed FMA path (stop 39) vs grouped vs vLLM
    moehalves) fail=0; python3 -m pytest -q tests/test_moe.py -k "halves or grouped" --device cuda -p no:cacheprovider 2>&1 | tail -n 4 | tee "$OUT/moehalves_tests.log"; [ "${PIPESTATUS[0]}" = 0 ] || fail=1  # stop 41: the grouped GEMMs' halves decoder
               python3 -m pytest -q -m gpu tests/test_moe_block.py -k "gpt_oss_shapes" -p no:cacheprovider 2>&1 | tail -n 3 | tee -a "$OUT/moehalves_tests.log"; [ "${PIPESTATUS[0]}" = 0 ] || fail=1
               for v in 1 0; do echo "VLLM_SM121_MOE_GROUPED_HALVES=$v"; [ $v = 1 ] && pr=${MOE_PROVIDERS:-sm121_grouped,sm121_fma,triton} || pr=sm121_grouped
                 VLLM_SM121_MOE_GROUPED_HALVES=$v python3 benchmarks/moe.py --m ${MOE_M:-8,16,32,64,512,2048} --providers $pr --out "$OUT/moe_halves$v.json" 2>&1 | tee "$OUT/moehalves$v.log" | grep -v "^INFO\|^WARNING" | tail -n 14 || fail=1; done; (exit $fail) ;;
    moef2) fail=0; for f in auto on; do echo "--grouped-f2 $f"; [ $f = auto ] && pr=${MOE_PROVIDERS:-sm121_grouped,triton} || pr=sm121_grouped  # stop 42: the grouped GEMMs without the F2 multiply (registered scales, the default) vs with it
             python3 benchmarks/moe.py --m ${MOE_M:-32,64,512,2048} --providers $pr --grouped-f2 $f --out "$OUT/moe_f2_$f.json" 2>&1 | tee "/tmp/moef2_$f.log" | grep -v "^INFO\|^WARNING" | tail -n 12; [ "${PIPESTATUS[0]}" = 0 ] || fail=1; done; (exit $fail) ;;
    moeactbf16) fail=0; python3 -m pytest -q -rf --tb=short tests/test_moe.py -k "bf16_halves or grouped_fc1_fc2" --device cuda -p no:cacheprovider > "$OUT/moeactbf16_tests.log" 2>&1 || fail=1  # stop 42: grouped FC1 with bf16 halves-order activations (opt-in)
                grep -E "^FAILED|^E  .*(assert|Error)|passed|failed|^tests/.*Error" "$OUT/moeactbf16_tests.log" | tail -n 30
                [ "${MOEACT_BENCH:-1}" = 1 ] && for v in 0 1; do echo "VLLM_SM121_MOE_GROUPED_ACT_BF16=$v"; [ $v = 0 ] && pr=${MOE_PROVIDERS:-sm121_grouped,triton} || pr=sm121_grouped
                  VLLM_SM121_MOE_GROUPED_ACT_BF16=$v python3 benchmarks/moe.py --m ${MOE_M:-64,512,2048} --providers $pr --out "$OUT/moe_actbf16_$v.json" 2>&1 | tee "/tmp/moeactbf16_$v.log" | grep -v "^INFO\|^WARNING" | tail -n 8; [ "${PIPESTATUS[0]}" = 0 ] || fail=1; done; (exit $fail) ;;
    moewsweep) python3 benchmarks/moe.py --m ${MOE_M:-8,16,32} --providers sm121_fma,triton --fma-tiles "${MOE_FMA_TILES:-64,256,32,256,4,3;64,256,32,256,4,2;64,256,32,256,8,3;128,256,64,256,4,3;64,128,32,128,4,3}" --out "$OUT/moe_window_sweep.json" 2>&1 | tee "$OUT/moewsweep.log" | grep -v "^INFO\|^WARNING" | tail -n 60 ;;  # FMA tiles of the windowed launches (M > 4)
    windowtests) python3 -m pytest -q -s tests/test_moe.py -k "windows or fma_block_path" --device cuda -p no:cacheprovider > "$OUT/windowtests.log" 2>&1; r1=$?
                 tail -n 5 "$OUT/windowtests.log"
                 python3 -m pytest -q -s -m gpu tests/test_moe_block.py -k "gpt_oss_shapes" -p no:cacheprovider >> "$OUT/windowtests.log" 2>&1; r2=$?
                 grep -E "M=|passed|failed|Error" "$OUT/windowtests.log" | tail -n 40; [ $r1 -eq 0 ] && [ $r2 -eq 0 ] ;;
    moechunk) python3 benchmarks/moe.py --m 1,4,5,8,16,32,64 --providers sm121_fma,sm121_decode,sm121_grouped,triton --out "$OUT/moe_chunk.json" 2>&1 | tee "$OUT/moechunk.log" | grep -v "^INFO\|^WARNING" | tail -n 40 ;;
    kvattn) # stop 43: the decode nvfp4 KV write inside the attention kernel ($VLLM_SM121_KV_IN_ATTN=1): kernel tests on the GPU
            python3 -m pytest -q -rf --tb=short tests/test_fp4_kv.py -k "writes_the_new or reads_nvfp4 or kv_write_on_the_gpu" --device cuda -p no:cacheprovider \
              > "$OUT/kvattn_tests.log" 2>&1; r=$?; grep -E "^FAILED|passed|failed" "$OUT/kvattn_tests.log" | tail -n 20; (exit $r) ;;
    inductordump) # stop 43: which Inductor kernels the plugin's compiled decode graph keeps (a 1.9 us add + RMSNorm per
                  # carried layer in the 120b profiles): one tiny engine, then the generated kernels' names, their
                  # source and the FX graph lines that feed them
                  export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_dump VLLM_CACHE_ROOT=/tmp/vllm_cache_dump; rm -rf /tmp/inductor_dump /tmp/vllm_cache_dump
                  python3 benchmarks/e2e.py --model models/gpt-oss-tiny --configs "${E2E_CONFIGS:-sm121-all-moe}" --points tg128 --iters 2 \
                    --llm-kwargs '{"compilation_config":{"cudagraph_capture_sizes":[1]}}' --out "$OUT/e2e_tiny_dump.json" > /tmp/inductordump.log 2>&1; r=$?
                  tail -n 5 /tmp/inductordump.log
                  { echo "== kernels defined (name: file)"; grep -rhoE "def (triton_[a-z_0-9]+)" /tmp/inductor_dump /tmp/vllm_cache_dump 2>/dev/null | sort | uniq -c
                    echo "== FX graph lines with norm / rms / add"; grep -rhE "rms_norm|fused_add|sm121\.|vllm_ir" /tmp/vllm_cache_dump --include=*.py 2>/dev/null | sort | uniq -c | sort -rn | head -n 60
                    for f in $(grep -rlE "def triton_red_fused_[a-z_0-9]*rms_norm" /tmp/inductor_dump /tmp/vllm_cache_dump 2>/dev/null | head -n 3); do
                      echo "== $f"; grep -nE "def triton_red|origin|@triton|# kernel path|triton_red_fused_[a-z_0-9]*rms_norm[a-z_0-9]*\.run|# Source Nodes|# Original ATen" "$f" | head -n 80; done
                  } > "$OUT/inductordump.txt" 2>&1; head -c 12000 "$OUT/inductordump.txt"; (exit $r) ;;
    e2etiny) python3 benchmarks/e2e.py --model models/gpt-oss-tiny --configs "${E2E_CONFIGS:-upstream-default,upstream-triton,sm121,sm121-graph-a,sm121-graph}" --points "${E2E_POINTS:-tg128,tg128-b8}" ${E2E_ARGS:-} --out "$OUT/e2e_tiny${E2E_TAG:-}.json" 2>&1 | tee "$OUT/e2e_tiny${E2E_TAG:-}.log" | tail -n 40 ;;
    profilewm) fail=0; for a in "default|--backend default" "sm121|--backend SM121" "wm_a|--whole-model" "wm|--whole-model" "wm_p|--whole-model"; do
               tag=${a%%|*}; args=${a#*|}; [ "$tag" = wm_a ] && fp=0 || fp=1; [ "$tag" = wm_p ] && pp=1 || pp=0
               case " ${PROFILE_SET:-default sm121 wm_a wm wm_p} " in *" $tag "*) ;; *) continue ;; esac
               VLLM_SM121_GRAPH_PATCH_PAGES=$pp VLLM_SM121_GRAPH_FAST_PATH=$fp python3 benchmarks/profile_step.py $args --scopes --out "$OUT/profile_$tag.json" > "/tmp/profile_$tag.log" 2>&1; r=$?
               echo "--- profile $tag ($args, fast path $fp): rc $r" | tee -a "$OUT/profilewm.log"
               if [ $r = 0 ]; then sed -n '/^device/,$p' "/tmp/profile_$tag.log" >> "$OUT/profilewm.log"; else fail=1; tail -n 40 "/tmp/profile_$tag.log" >> "$OUT/profilewm.log"; fi
             done; grep -E "^--- profile|launches\+copies|^  cu|engine iteration|execute_model|generate" "$OUT/profilewm.log" | head -n 80; (exit $fail) ;;
    profile120b) fail=0; for a in "upstream|--backend default" "plugin|--moe-experimental --dense-fp8 --whole-model --kv-cache-dtype nvfp4" "pluginkv|--moe-experimental --dense-fp8 --whole-model --kv-cache-dtype nvfp4" "pluginl2|--moe-experimental --dense-fp8 --whole-model --kv-cache-dtype nvfp4"; do  # where gpt-oss-120b's batch-1 step goes (pluginkv: with VLLM_SM121_KV_IN_QKV=1; pluginl2: with VLLM_SM121_L2_PREFETCH=${PROFILE_L2:-o,qkv_late,w2_late})
                   tag=${a%%|*}; sets=${PROFILE120B_SET:-upstream plugin}; case " ${sets//[,_]/ } " in *" $tag "*) ;; *) continue ;; esac
                   [ "$tag" = pluginkv ] && kvq=1 || kvq=${VLLM_SM121_KV_IN_QKV:-0}
                   [ "$tag" = pluginl2 ] && l2=${PROFILE_L2:-o,qkv_late,w2_late} || l2=${VLLM_SM121_L2_PREFETCH:-}
                   VLLM_SM121_KV_IN_QKV=$kvq VLLM_SM121_L2_PREFETCH=$l2 python3 benchmarks/profile_step.py --model models/gpt-oss-120b ${a#*|} ${PROFILE_ARGS:-} --gpu-memory-utilization 0.85 --top 30 \
                     --out "$OUT/profile_120b_$tag.json" > "$OUT/profile_120b_$tag.log" 2>&1; r=$?; echo "--- profile 120b $tag: rc $r"
                   if [ $r = 0 ]; then sed -n '/^device/,$p' "$OUT/profile_120b_$tag.log" | head -n 60; else fail=1; tail -n 40 "$OUT/profile_120b_$tag.log"; fi
                 done; (exit $fail) ;;
    densecmp) python3 benchmarks/dense.py --m "${DENSE_M:-8,32,512,2048}" --providers "${DENSE_PROVIDERS:-sm121_mma,vllm_cutlass_fp8,cublas_bf16}" --out "$OUT/dense_cmp.json" 2>&1 | tee "$OUT/densecmp.log" | tail -n 50 ;;
    densebench) python3 benchmarks/dense.py --out "$OUT/dense.json" 2>&1 | tee "$OUT/densebench.log" | tail -n 40 ;;
    moefma) python3 benchmarks/moe.py --m 1,2,4,8 --providers sm121,sm121_fma,sm121_decode,triton --out "$OUT/moe_fma.json" 2>&1 | tee "$OUT/moefma.log" | tail -n 40 ;;
    profile) fail=0; for a in "--backend default" "--backend SM121" "--backend SM121 --dense-fp8" "--eager --backend default" "--eager --moe-experimental --dense-fp8"; do
               tag=$(echo "$a" | tr -d ' -'); python3 benchmarks/profile_step.py $a ${PROFILE_ARGS:-} --out "$OUT/profile_$tag.json" > "/tmp/profile_$tag.log" 2>&1; r=$?
               echo "--- profile $a: rc $r" | tee -a "$OUT/profile.log"
               if [ $r = 0 ]; then sed -n '/^device/,$p' "/tmp/profile_$tag.log" >> "$OUT/profile.log"; else fail=1; tail -n 40 "/tmp/profile_$tag.log" >> "$OUT/profile.log"; fi
             done; grep -A8 "^--- profile\|^CUDA API" "$OUT/profile.log" | head -n 80; (exit $fail) ;;
    wholemodel) wm_test; r=$?  # the stage A GPU test, then the profile with and without the mode
         for a in "" "--whole-model"; do python3 benchmarks/profile_step.py $a --out "$OUT/profile_wm$a.json" > "/tmp/profile_wm$a.log" 2>&1 \
           && sed -n '/^device/,$p' "/tmp/profile_wm$a.log" | head -n 30 || tail -n 30 "/tmp/profile_wm$a.log"; done; (exit $r) ;;
    mixedsplit) python3 -m pytest -q -s tests/test_e2e_gpu.py -k "mixed_batch" -p no:cacheprovider > "$OUT/mixedsplit.log" 2>&1; r=$?
         grep -E "gap|one launch|Error|passed|failed|^E " "$OUT/mixedsplit.log" | head -n 20; (exit $r) ;;
    wmtest) python3 -m pytest -q -m "gpu or interpreter" tests/test_decode_inputs.py -p no:cacheprovider 2>&1 | tail -n 3 | tee "$OUT/decode_inputs.log"
            wm_test ;;
    wmsample) python3 -m pytest -q -m "gpu or interpreter" tests/test_decode_sample.py -p no:cacheprovider 2>&1 | tail -n 3 | tee "$OUT/decode_sample.log"
              wm_test "temperature_sampling" ;;  # in-graph sampling: the kernel tests, then the engine tests (levels 1 and 2)
    sampletests) python3 -m pytest -q -m "gpu or interpreter" tests/test_decode_sample.py -p no:cacheprovider 2>&1 | tail -n 15 | tee "$OUT/decode_sample.log" ;;
    samplebench) python3 benchmarks/sample.py --out "$OUT/sample.json" 2>&1 | tee "$OUT/samplebench.log" | tail -n 20 ;;
    wmmain) wm_test "not temperature_sampling and not tp2" ;;  # the one-GPU engine tests without in-graph sampling
    wmtp) wm_test tp2 ;;  # the TP=2 case alone (2 GPUs)
    doctor) vllm-sm121 doctor; vllm-sm121 doctor --json > "$OUT/doctor.json" ;;
    eaglecost) python3 benchmarks/eagle_cost.py ${EAGLE_COST_ARGS:-} --out "$OUT/eagle_cost${EAGLE_COST_TAG:-}.json" 2>&1 | tee "$OUT/eagle_cost${EAGLE_COST_TAG:-}.log" | tail -n 30 ;;
    e2erot) # paired A/B over every GPU of the machine: card i runs $E2E_BASE and the variants in $E2E_VARIANTS
            # (space-separated) rotated by i (so no configuration always runs first), one e2e120b job per card;
            # then benchmarks/ab_summary.py over the cards' JSONs (each variant's step time over the
            # baseline's on the same card). E2E_ARGS as for e2e120b (exported: it reaches every job).
            # (other steps' files already in $OUT end up inside par.tgz too: run e2erot as a call's only step)
            if [ -z "${E2E_BASE:-}" ] || [ -z "${E2E_VARIANTS:-}" ]; then echo "e2erot: export E2E_BASE and E2E_VARIANTS"; rc=2; continue; fi
            n=$(nvidia-smi -L | grep -c "^GPU "); cfgs=($E2E_BASE $E2E_VARIANTS)
            jobs=""; for ((i = 0; i < n; i++)); do
              rot=(); for ((j = 0; j < ${#cfgs[@]}; j++)); do rot+=("${cfgs[$(((i + j) % ${#cfgs[@]}))]}"); done
              list=$(IFS=,; echo "${rot[*]}"); jobs+="$i|E2E_CONFIGS=$list E2E_TAG=_rot$i|e2e120b ;; "
            done
            OUT="$OUT" SM121_NO_PIP=1 PAR="$jobs" PAR_TIMEOUT="${PAR_TIMEOUT:-560}" bash "$0" "$part" par; r=$?
            (cd "$OUT" && tar xzf par.tgz --wildcards './e2e_120b_rot*.json')
            python3 benchmarks/ab_summary.py --baseline "$E2E_BASE" "$OUT"/e2e_120b_rot*.json --out "$OUT/ab_summary.json" 2>&1 | tail -n 20
            rm -f "$OUT"/e2e_120b_rot*.json; (exit $r) ;;
    par) # PAR="GPUS|VAR=val ...|step ... ;; GPUS|..." : the jobs at once, each on its own GPUs
         # (CUDA_VISIBLE_DEVICES) with its VARs (tags keep result files apart), output in $OUT/par_<i>.log;
         # then everything else under $OUT goes into $OUT/par.tgz (few files come back from the machine)
         pids=(); i=0; jobs=${PAR//;;/$'\n'}
         while IFS= read -r job; do
           [ -n "${job// /}" ] || continue
           gpus=${job%%|*}; rest=${job#*|}; vars=${rest%%|*}; steps=${rest#*|}; gpus=${gpus// /}
           echo "par_$i: GPUs $gpus: $vars $steps"
           # VARs are separated by spaces: "A=x,B=y" would set A to "x,B=y" (a stop-29 call ran the wrong configs so)
           if [[ "$vars" =~ ,[A-Z_][A-Z0-9_]*= ]]; then echo "par_$i: VARs must be space-separated: $vars"; exit 2; fi
           # each job ends by PAR_TIMEOUT (s) so that the packing below runs inside the call's limit
           timeout -k 10 "${PAR_TIMEOUT:-540}" bash -c "export CUDA_VISIBLE_DEVICES=$gpus SM121_NO_PIP=1 SM121_PAR_CHILD=1; $vars bash scripts/gpu_session.sh '$part' $steps" \
             > "$OUT/par_$i.log" 2>&1 &
           pids+=($!); i=$((i+1))
         done <<< "$jobs"
         r=0; for p in "${pids[@]}"; do wait "$p" || r=1; done
         for f in "$OUT"/par_*.log; do echo "--- $f"; grep -v "^INFO\|^WARNING\|^(EngineCore\|^\[" "$f" | tail -n 40; done
         (cd "$OUT" && tar czf /tmp/par.tgz --exclude 'par_*.log' . && find . -mindepth 1 ! -name 'par_*.log' -delete \
           && mv /tmp/par.tgz par.tgz); (exit $r) ;;
    loadwm) python3 scripts/serve_load.py --model models/gpt-oss-tiny --out "$OUT/serve_load_wm.json" -- --additional-config '{"sm121": {"cudagraph": "whole_model"}}' ${LOAD_ARGS:-} 2>&1 | tee "$OUT/serve_load_wm.log" | tail -n 30 ;;
    load) python3 scripts/serve_load.py --model models/gpt-oss-tiny --out "$OUT/serve_load.json" 2>&1 | tee "$OUT/serve_load.log" | tail -n 30 ;;
    *) echo "unknown step $step"; rc=2 ;;
  esac
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
done
exit $rc
