#!/usr/bin/env bash
# The main job (README): on a CUDA GPU with vLLM 0.26.0 and this package installed,
#  1. benchmark the SM121 attention kernels against vLLM's own (Triton unified_attention, FA3),
#     gpt-oss shapes, same card, same run  -> results/attention.json
#  2. serve the shipped gpt-oss-tiny config with `vllm serve --attention-backend SM121`
#     (dummy weights), answer /v1/completions and quote the SM121 layer and CUDA-graph lines.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "vllm-sm121 main job needs a CUDA GPU (compute capability 9.x or 12.x) with vLLM 0.26.0; none found." >&2
  exit 2
fi
mkdir -p results
python3 benchmarks/attention.py --quick --out results/attention.json || exit 1
python3 scripts/serve_check.py --model models/gpt-oss-tiny --expect-layers 4 --log results/serve.log \
  -- --max-cudagraph-capture-size 8 || exit 1
