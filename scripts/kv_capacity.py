"""Start vLLM (dummy weights, SM121, eager) with one --kv-cache-dtype; print the KV capacity it logs.

    python scripts/kv_capacity.py --model <gpt-oss dir> --kv-cache-dtype nvfp4

Prints ``kv_capacity <dtype>: <vLLM's "GPU KV cache size" line>`` and its max-concurrency line.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

CODE = """
import sys
from vllm import LLM
LLM(model=sys.argv[1], load_format="dummy", skip_tokenizer_init=True, attention_backend="SM121",
    kv_cache_dtype=sys.argv[2], enforce_eager=True, max_model_len=32768, gpu_memory_utilization=0.9)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--kv-cache-dtype", required=True, choices=["auto", "bfloat16", "fp8", "nvfp4"])
    args = ap.parse_args()
    p = subprocess.run([sys.executable, "-c", CODE, args.model, args.kv_cache_dtype], capture_output=True, text=True,
                       check=False, timeout=900)
    text = p.stdout + p.stderr
    lines = [l for l in text.splitlines() if re.search(r"GPU KV cache size|Maximum concurrency", l)]
    for l in lines:
        print(f"kv_capacity {args.kv_cache_dtype}: {l.split('] ', 1)[-1]}")
    if not lines:
        print(f"kv_capacity {args.kv_cache_dtype}: Error: no capacity line (rc {p.returncode})\n{text[-3000:]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
