"""Random gpt-oss checkpoints in the real Hugging Face MXFP4 layout, for tests and benchmarks.

``write_random_gpt_oss_checkpoint`` writes ``config.json`` and one ``model.safetensors`` that
``vllm.LLM(model=out_dir, load_format="safetensors", skip_tokenizer_init=True)`` loads through
vLLM 0.26's gpt-oss loader (``GptOssForCausalLM.hf_to_vllm_mapper`` and
``GptOssModel._load_weights_mxfp4``). Tensor names, shapes and dtypes are those of the published
``openai/gpt-oss-*`` checkpoints:

(``V`` vocab, ``H`` hidden, ``I`` intermediate, ``E`` experts, ``Hq``/``Hkv`` heads, ``D`` head
dim; per-layer names carry the prefix ``model.layers.{i}.``)::

    model.embed_tokens.weight                 [V, H]              BF16
    lm_head.weight                            [V, H]              BF16  (absent if tied)
    model.norm.weight                         [H]                 BF16
    input_layernorm.weight                    [H]                 BF16
    post_attention_layernorm.weight           [H]                 BF16
    self_attn.q_proj.weight / .bias           [Hq*D, H] / [Hq*D]  BF16
    self_attn.k_proj.weight / .bias           [Hkv*D, H] / [Hkv*D] BF16  (v_proj the same)
    self_attn.o_proj.weight / .bias           [H, Hq*D] / [H]     BF16
    self_attn.sinks                           [Hq]                BF16
    mlp.router.weight / .bias                 [E, H] / [E]        BF16
    mlp.experts.gate_up_proj_blocks           [E, 2I, H/32, 16]   U8
    mlp.experts.gate_up_proj_scales           [E, 2I, H/32]       U8
    mlp.experts.gate_up_proj_bias             [E, 2I]             BF16
    mlp.experts.down_proj_blocks              [E, H, I/32, 16]    U8
    mlp.experts.down_proj_scales              [E, H, I/32]        U8
    mlp.experts.down_proj_bias                [E, H]              BF16

MXFP4 layout (what the loader and the kernels assume): each ``*_blocks`` row holds one output
feature; its input features come in blocks of 32, each block stored as 16 bytes of two e2m1
codes, the LOW nibble first (element ``2j`` in ``byte j & 0xF``, element ``2j+1`` in
``byte j >> 4``), with one e8m0 exponent byte per block in ``*_scales`` (value ``2**(s-127)``).
``gate_up`` rows interleave gate and up (row ``2n`` gate, ``2n+1`` up): vLLM's ``swigluoai``
splits ``x[..., ::2]`` / ``x[..., 1::2]``, so the loader copies the rows as they are. Sizes are
the unpadded config sizes; backends that pad (hidden/intermediate rounded up to 64..256) copy
the checkpoint into the leading ``[:, :rows, :cols]`` of their larger parameters.

Values: norms ``1 + N(0, 0.02)``; linear weights, embeddings and all biases ``N(0, 0.02)``;
attention sinks ``N(0, 1)``; expert codes are uniform random bytes (every e2m1 code, both signs)
and each block's exponent is one of two adjacent powers of two, drawn so that the dequantized
weights have standard deviation 0.02 in expectation (E[s^2] matched to (0.02 / code RMS)^2).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = [
    "E2M1_VALUES",
    "MXFP4_BLOCK_SIZE",
    "dequant_mxfp4",
    "write_random_gpt_oss_checkpoint",
]

#: Magnitudes of the e2m1 codes 0..7; code ``c | 8`` is ``-E2M1_VALUES[c]``.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: Elements per MXFP4 block (one shared e8m0 scale); the loader's ``OCP_MX_BLOCK_SIZE``.
MXFP4_BLOCK_SIZE = 32
E8M0_BIAS = 127

_WEIGHT_STD = 0.02
_SINK_STD = 1.0
_CHUNK = 1 << 22  # elements generated per step: bounds the float32 scratch to 16 MiB
_ST_DTYPE = {torch.bfloat16: "BF16", torch.uint8: "U8", torch.float32: "F32"}

# RMS of one e2m1 code when the code (4 bits) is uniform: sqrt(mean(v^2)) over the 16 codes.
_UNIFORM_CODE_RMS = math.sqrt(sum(v * v for v in E2M1_VALUES) / len(E2M1_VALUES))


def dequant_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Reference MXFP4 dequantization: ``[..., G, 16]`` uint8 codes and ``[..., G]`` e8m0 bytes
    to float32 ``[..., G * 32]``.

    Low nibble first, as the gpt-oss checkpoint, transformers' converter and triton_kernels'
    ``upcast_from_mxfp`` read it. For ``gate_up_proj_blocks`` of one expert this gives the
    ``[2I, H]`` (out, in) weight with gate/up rows interleaved; for ``down_proj`` ``[H, I]``.
    Scale byte 255 (NaN in e8m0) is not special-cased: it dequantizes to ``inf`` here.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"expected uint8 blocks and scales, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != MXFP4_BLOCK_SIZE // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"shape mismatch: blocks {tuple(blocks.shape)}, scales {tuple(scales.shape)}")
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [..., G, 16, 2]: low, high
    values = lut[codes].flatten(-2)  # [..., G, 32]
    scale = torch.exp2(scales.float() - E8M0_BIAS).unsqueeze(-1)
    return (values * scale).flatten(-2)


def _layer_types(config: dict, num_layers: int) -> list[str]:
    # vLLM gives even layers the sliding window (OAIAttention: layer_idx % 2 == 0); keep the
    # config's own list where it is long enough, else continue that alternation.
    old = list(config.get("layer_types") or [])
    if len(old) >= num_layers:
        return old[:num_layers]
    return old + ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(len(old), num_layers)]


def _tensor_specs(config: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype, str]]:
    """HF name -> (shape, dtype, kind) for this config; kind picks the random fill."""
    h = config["hidden_size"]
    inter = config["intermediate_size"]
    n_exp = config["num_local_experts"]
    n_q = config["num_attention_heads"]
    n_kv = config["num_key_value_heads"]
    d = config.get("head_dim") or h // n_q
    vocab = config["vocab_size"]
    for what, size in (("hidden_size", h), ("intermediate_size", inter)):
        if size % MXFP4_BLOCK_SIZE:
            raise ValueError(f"{what}={size} is not a multiple of the MXFP4 block ({MXFP4_BLOCK_SIZE})")
    bf16, u8 = torch.bfloat16, torch.uint8
    specs: dict[str, tuple[tuple[int, ...], torch.dtype, str]] = {
        "model.embed_tokens.weight": ((vocab, h), bf16, "linear"),
        "model.norm.weight": ((h,), bf16, "norm"),
    }
    if not config.get("tie_word_embeddings", False):
        specs["lm_head.weight"] = ((vocab, h), bf16, "linear")
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs[p + "input_layernorm.weight"] = ((h,), bf16, "norm")
        specs[p + "post_attention_layernorm.weight"] = ((h,), bf16, "norm")
        for proj, rows in (("q_proj", n_q * d), ("k_proj", n_kv * d), ("v_proj", n_kv * d)):
            specs[p + f"self_attn.{proj}.weight"] = ((rows, h), bf16, "linear")
            specs[p + f"self_attn.{proj}.bias"] = ((rows,), bf16, "linear")
        specs[p + "self_attn.o_proj.weight"] = ((h, n_q * d), bf16, "linear")
        specs[p + "self_attn.o_proj.bias"] = ((h,), bf16, "linear")
        specs[p + "self_attn.sinks"] = ((n_q,), bf16, "sink")
        specs[p + "mlp.router.weight"] = ((n_exp, h), bf16, "linear")
        specs[p + "mlp.router.bias"] = ((n_exp,), bf16, "linear")
        e = p + "mlp.experts."
        for proj, rows, cols in (("gate_up_proj", 2 * inter, h), ("down_proj", h, inter)):
            groups = cols // MXFP4_BLOCK_SIZE
            specs[e + f"{proj}_blocks"] = ((n_exp, rows, groups, MXFP4_BLOCK_SIZE // 2), u8, "e2m1")
            specs[e + f"{proj}_scales"] = ((n_exp, rows, groups), u8, "e8m0")
            specs[e + f"{proj}_bias"] = ((n_exp, rows), bf16, "linear")
    return specs


def _e8m0_levels(std: float) -> tuple[int, int]:
    """Exponent byte ``base`` or ``base + 1`` per block: a random byte below ``threshold`` picks
    ``base + 1``, with ``P = threshold / 256`` chosen so that uniform e2m1 codes times these
    scales have standard deviation ``std``: ``E[s^2] = 4^k (1 + 3 P) = (std / code_rms)^2``
    with ``k = base - 127``."""
    target = std / _UNIFORM_CODE_RMS
    k = math.floor(math.log2(target))
    p_up = ((target / 2.0**k) ** 2 - 1.0) / 3.0
    base = k + E8M0_BIAS
    if not 1 <= base <= 253:
        raise ValueError(f"expert std {std} needs e8m0 exponent {k}, outside the representable range")
    return base, round(p_up * 256)


class _Stream:
    """One random stream writing its tensors at their file offsets in fixed-size chunks.

    Reused chunk buffers mean no tensor-sized allocation (fresh pages are what costs most on a
    small machine), and the fixed chunking keeps the bytes independent of the machine. The BF16
    and U8 tensors are two streams on two generators, written by two threads (torch ops and
    ``os.pwrite`` drop the GIL), so a file takes about as long as its larger half.
    """

    def __init__(self, fd: int, gen: torch.Generator, expert_std: float, chunk: int = _CHUNK):
        self.fd = fd
        self.gen = gen
        self.chunk = chunk
        self.e8m0 = _e8m0_levels(expert_std)
        self.f32 = torch.empty(chunk, dtype=torch.float32)
        self.bf16 = torch.empty(chunk, dtype=torch.bfloat16)
        self.i32 = torch.empty(chunk // 4, dtype=torch.int32)
        self.u8 = torch.empty(chunk, dtype=torch.uint8)
        self.mask = torch.empty(chunk, dtype=torch.bool)

    def _chunk(self, kind: str, n: int) -> torch.Tensor:
        if kind in ("linear", "norm", "sink"):
            mean = 1.0 if kind == "norm" else 0.0
            std = _SINK_STD if kind == "sink" else _WEIGHT_STD
            return self.bf16[:n].copy_(self.f32[:n].normal_(mean, std, generator=self.gen))
        # Uniform bytes, 4 per 32-bit draw: for e2m1 blocks every code pair is equally likely.
        words = self.i32[: (n + 3) // 4].random_(-(2**31), 2**31, generator=self.gen)
        raw = words.view(torch.uint8)[:n]
        if kind == "e2m1":
            return raw
        if kind == "e8m0":
            base, threshold = self.e8m0
            up = torch.lt(raw, threshold, out=self.mask[:n])
            return self.u8[:n].copy_(up).add_(base)
        raise AssertionError(kind)

    def write(self, jobs: list[tuple[int, int, str]]) -> None:
        for offset, numel, kind in jobs:
            for start in range(0, numel, self.chunk):
                t = self._chunk(kind, min(self.chunk, numel - start))
                data = t.view(torch.uint8).numpy()
                pos = offset + start * t.element_size()
                while data.size:  # pwrite may write less than asked
                    done = os.pwrite(self.fd, data, pos)
                    data, pos = data[done:], pos + done


def _write_safetensors(
    path: str, specs: dict[str, tuple[tuple[int, ...], torch.dtype, str]], seed: int, expert_std: float
) -> None:
    """Write random tensors for ``specs`` as one safetensors file.

    Layout as the safetensors library writes it: 8-byte header length, JSON header padded with
    spaces to 8 bytes, then the data; wider dtypes first so every tensor is aligned to its
    element size. BF16 tensors draw from ``Generator(seed)``, U8 ones from a generator seeded by
    the first draw of that one, each in file order.
    """
    order = sorted(specs, key=lambda n: (-specs[n][1].itemsize, n))
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in order:
        shape, dtype, _ = specs[name]
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _ST_DTYPE[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    data_start = 8 + len(raw)

    float_gen = torch.Generator(device="cpu").manual_seed(seed)
    byte_seed = int(torch.randint(0, 2**62, (1,), generator=float_gen))
    byte_gen = torch.Generator(device="cpu").manual_seed(byte_seed)
    jobs: dict[bool, list[tuple[int, int, str]]] = {True: [], False: []}
    for name in order:
        shape, dtype, kind = specs[name]
        jobs[dtype == torch.uint8].append((data_start + header[name]["data_offsets"][0], math.prod(shape), kind))

    tmp = path + ".partial"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            os.pwrite(fd, len(raw).to_bytes(8, "little") + raw, 0)
            os.ftruncate(fd, data_start + offset)
            streams = [(_Stream(fd, float_gen, expert_std), jobs[False]), (_Stream(fd, byte_gen, expert_std), jobs[True])]
            with ThreadPoolExecutor(max_workers=2) as pool:
                for fut in [pool.submit(stream.write, todo) for stream, todo in streams]:
                    fut.result()
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_random_gpt_oss_checkpoint(
    config_dir: str, out_dir: str, seed: int = 0, num_layers: int | None = None
) -> str:
    """Write a random gpt-oss MXFP4 checkpoint for ``config_dir/config.json`` into ``out_dir``.

    Writes ``out_dir/config.json`` (a byte copy, or with ``num_hidden_layers`` and
    ``layer_types`` cut/extended to ``num_layers`` when given) and ``out_dir/model.safetensors``
    (no index file: vLLM reads every ``*.safetensors`` in a local folder and needs an index only
    to drop duplicates). The same ``config``, ``seed`` and ``num_layers`` give identical bytes.
    Returns ``out_dir``.
    """
    src = os.path.join(config_dir, "config.json")
    with open(src) as f:
        config = json.load(f)
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") != "mxfp4":
        raise ValueError(f"{src}: expected quantization_config.quant_method 'mxfp4', got {quant.get('quant_method')!r}")
    if num_layers is not None and num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    specs = _tensor_specs({**config, "num_hidden_layers": num_layers or config["num_hidden_layers"]})
    os.makedirs(out_dir, exist_ok=True)
    dst = os.path.join(out_dir, "config.json")
    if num_layers is None:
        if os.path.abspath(src) != os.path.abspath(dst):
            shutil.copyfile(src, dst)
    else:
        config["layer_types"] = _layer_types(config, num_layers)
        config["num_hidden_layers"] = num_layers
        with open(dst, "w") as f:
            json.dump(config, f, indent=2)
            f.write("\n")

    _write_safetensors(os.path.join(out_dir, "model.safetensors"), specs, seed, _WEIGHT_STD)
    return out_dir
