"""On-device decode sampling for the whole-model graph (issue 7): greedy and temperature rows in one
graph-capturable pair of launches.

``decode_sample(logits, temperature, seeds, step, out)`` writes one token per row of ``logits``
[P, V] into ``out``:

* greedy rows (``temperature < SAMPLING_EPS``, vLLM's 1e-5): ``argmax`` of the fp32 logits,
  lowest index on ties: stock vLLM's ``Sampler.greedy_sample`` on the same logits;
* temperature rows: ``argmax(logits / T - log(-log u))``, the exponential race stock's
  ``random_sample`` runs (``argmax(softmax(logits / T) / E)``, ``E ~ Exp(1)``) in the log domain,
  with u in (0, 1) a pure function of (the row's 64-bit seed, the step counter, the token index):
  ``vllm_sm121.graph.sampler.uniforms``, the same counter-based hash. Same distribution as stock's;
  not stock's random numbers (its per-request ``torch.Generator`` is host state), which is why the
  runner leaves seeded requests to stock's sampler.

With ``top_k`` / ``top_p`` (per row; off = 0 or >= V / 1.0), a third launch first finds each
temperature row's threshold (``_decode_sample_threshold_kernel``: one program per row, a 16-ary
search over the 32-bit keys of the scaled logits, 8 passes for top-k and 10 for top-p, no sort) and the
race runs over the entries at or above it: vLLM's rules (top-k keeps every value >= the k-th
largest, ties included; top-p on the top-k survivors' softmax keeps the values whose mass at or
below them exceeds 1 - p, and always the largest). Two differences at the top-p boundary: sums run
in another order than vLLM's cumsum (a token whose cumulative mass ties within rounding may go the
other way), and a group of *equal* values straddling the cut is kept whole, where vLLM's sort keeps
part of it in its own order (bf16 logits tie often: on bf16-rounded random logits the kernel kept
~0.2% more mass at p = 0.9). No min-p. The step
counter (int64, one element, on the device) is advanced by the second launch, so every replay of
a captured graph draws new numbers; nothing is read from the host.

Launches: (P, cdiv(V, BLOCK)) programs each score BLOCK entries (the noise only on temperature
rows: a per-row branch) and keep their best (value, lowest index); then P programs reduce the
blocks. Logits are read once. Numerics are not bit-exact with the torch reference for
temperature rows (``log`` may round differently); greedy rows are exact. NaN logits are not
handled specially (stock's ``argmax`` returns a NaN's index; this kernel may not).
"""

from __future__ import annotations

import torch
import triton

from .decode_sample_details._decode_sample import (_decode_sample_final_kernel, _decode_sample_partial_kernel,
                                                   _decode_sample_threshold_kernel)

SAMPLING_EPS = 1e-5  # vllm/v1/sample/sampler.py _SAMPLING_EPS
BLOCK = 4096
THRESHOLD_BLOCK = 512  # the threshold kernel's chunk (one program per row loops over the vocabulary)
THRESHOLD_FAN = 16  # pivots per pass: [THRESHOLD_BLOCK, FAN] compares in registers
NUM_WARPS = 8


def num_blocks(vocab_size: int) -> int:
    return triton.cdiv(vocab_size, BLOCK)


def workspace(rows: int, vocab_size: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-block partial results and per-row thresholds for ``rows`` rows (allocate once, outside
    graph capture)."""
    nb = num_blocks(vocab_size)
    return (torch.empty((rows, nb), dtype=torch.float32, device=device),
            torch.empty((rows, nb), dtype=torch.int32, device=device),
            torch.empty((rows,), dtype=torch.int32, device=device))


def _check(logits, temperature, seeds, step, out, ws, top_k, top_p):
    if logits.dim() != 2 or logits.dtype not in (torch.float32, torch.bfloat16, torch.float16) or logits.stride(1) != 1:
        raise ValueError(f"logits: expected a 2-D fp32/bf16/fp16 tensor with unit stride along the vocabulary, got "
                         f"{logits.dtype} {tuple(logits.shape)} stride {logits.stride()}")
    p = logits.shape[0]
    named = [("temperature", temperature, (torch.float32,)), ("seeds", seeds, (torch.int64,)),
             ("out", out, (torch.int32, torch.int64))]
    if (top_k is None) != (top_p is None):
        raise ValueError("top_k and top_p come together (off rows: top_k 0, top_p 1.0)")
    if top_k is not None:
        named += [("top_k", top_k, (torch.int32,)), ("top_p", top_p, (torch.float32,))]
    for name, t, dtypes in named:
        if t.dtype not in dtypes or t.dim() != 1 or t.shape[0] < p or t.stride(0) != 1:
            raise ValueError(f"{name}: expected a contiguous 1-D {'/'.join(map(str, dtypes))} tensor of >= {p} rows, "
                             f"got {t.dtype} {tuple(t.shape)}")
    if step.dtype != torch.int64 or step.numel() != 1:
        raise ValueError(f"step: expected a one-element int64 tensor, got {step.dtype} {tuple(step.shape)}")
    vals, idx, thr = ws
    nb = num_blocks(logits.shape[1])
    if vals.dtype != torch.float32 or idx.dtype != torch.int32 or vals.shape[0] < p or idx.shape[0] < p \
            or vals.shape[1] != nb or idx.shape[1] != nb or thr.dtype != torch.int32 or thr.shape[0] < p:
        raise ValueError(f"workspace: expected fp32 and int32 [>= {p}, {nb}] tensors and int32 [>= {p}] "
                         f"(decode_sample.workspace), got {vals.dtype} {tuple(vals.shape)}, {idx.dtype} "
                         f"{tuple(idx.shape)} and {thr.dtype} {tuple(thr.shape)}")
    devices = {t.device for t in (logits, temperature, seeds, step, out, vals, idx, thr)
               + ((top_k, top_p) if top_k is not None else ())}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def decode_sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, step: torch.Tensor,
                  out: torch.Tensor, ws: tuple[torch.Tensor, ...] | None = None,
                  top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None) -> torch.Tensor:
    """Tokens of the P = ``logits.shape[0]`` rows into ``out[:P]``; advances ``step`` by one.
    ``temperature`` fp32, ``seeds`` int64, ``top_k`` int32 / ``top_p`` fp32 (both or neither;
    rows >= P ignored); ``ws`` from :func:`workspace` (allocated here when None, which a graph
    capture should avoid)."""
    if ws is None:
        ws = workspace(logits.shape[0], logits.shape[1], logits.device)
    _check(logits, temperature, seeds, step, out, ws, top_k, top_p)
    p, v = logits.shape
    nb = num_blocks(v)
    vals, idx, thr = ws
    if top_k is not None:
        _decode_sample_threshold_kernel[(p,)](logits, logits.stride(0), temperature, top_k, top_p, thr, v,
                                              EPS=SAMPLING_EPS, BLOCK=THRESHOLD_BLOCK, FAN=THRESHOLD_FAN,
                                              num_warps=NUM_WARPS)
    _decode_sample_partial_kernel[(p, nb)](logits, logits.stride(0), temperature, seeds, step, thr, vals, idx, v, nb,
                                           EPS=SAMPLING_EPS, BLOCK=BLOCK, HAS_THR=top_k is not None,
                                           num_warps=NUM_WARPS)
    _decode_sample_final_kernel[(p,)](vals, idx, out, step, nb, NB_P2=triton.next_power_of_2(nb), num_warps=1)
    return out


def _scaled_torch(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """fp32 logits / T per row (T = 1 on greedy rows), as stock's ``apply_temperature`` scales them."""
    t = temperature[: logits.shape[0]].to(device=logits.device, dtype=torch.float32)
    return logits.to(torch.float32) / torch.where(t >= SAMPLING_EPS, t, torch.ones_like(t))[:, None]


def decode_sample_scores_torch(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                               step: int, top_k: torch.Tensor | None = None,
                               top_p: torch.Tensor | None = None) -> torch.Tensor:
    """Reference scores [P, V] (fp32): the raw logits on greedy rows, logits / T + Gumbel noise
    from ``graph.sampler.uniforms`` on the others (with top-k / top-p: vLLM's own filter on the
    scaled logits first, dropped entries -inf)."""
    from vllm_sm121.graph.sampler import _apply_top_k_top_p, uniforms

    p, v = logits.shape
    x = logits.to(torch.float32)
    t = temperature[:p].to(torch.float32)
    scaled = _scaled_torch(logits, temperature)
    if top_k is not None:
        scaled = _apply_top_k_top_p(scaled, top_k[:p], top_p[:p])  # a fresh tensor: edited in place
    u = uniforms(seeds[:p].to(torch.int64), torch.full((p,), step, dtype=torch.int64, device=logits.device), v)
    return torch.where((t >= SAMPLING_EPS)[:, None], scaled - torch.log(-torch.log(u)), x)


def decode_sample_torch(logits, temperature, seeds, step: int, top_k=None, top_p=None) -> torch.Tensor:
    """Reference tokens (int64 [P]): ``argmax`` of :func:`decode_sample_scores_torch`."""
    return decode_sample_scores_torch(logits, temperature, seeds, step, top_k, top_p).argmax(dim=-1)


def kept_torch(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[P, V] bool: the entries vLLM's top-k / top-p filter keeps on the scaled logits (tests)."""
    from vllm_sm121.graph.sampler import _apply_top_k_top_p

    p = logits.shape[0]
    scaled = _scaled_torch(logits, temperature)
    return torch.isfinite(_apply_top_k_top_p(scaled, top_k[:p].to(scaled.device), top_p[:p].to(scaled.device)))


def kept(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
         ws: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """[P, V] bool: the entries the threshold kernel keeps (runs it into ``ws``; tests)."""
    p, v = logits.shape
    _check(logits, temperature, torch.zeros(p, dtype=torch.int64, device=logits.device),
           torch.zeros(1, dtype=torch.int64, device=logits.device), torch.zeros(p, dtype=torch.int64, device=logits.device),
           ws, top_k, top_p)
    thr = ws[2]
    _decode_sample_threshold_kernel[(p,)](logits, logits.stride(0), temperature, top_k, top_p, thr, v,
                                          EPS=SAMPLING_EPS, BLOCK=THRESHOLD_BLOCK, FAN=THRESHOLD_FAN,
                                          num_warps=NUM_WARPS)
    b = (_scaled_torch(logits, temperature) + 0.0).view(torch.int32)
    key = b ^ ((b >> 31) & 0x7FFFFFFF)
    return key >= thr[:p, None]
