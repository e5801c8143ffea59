"""CUDA-graph-capturable on-device decode sampler (issue 7, first building block).

``sample(logits, params, out_tokens)`` draws one token per row with vLLM 0.26's
sampling semantics for the options gpt-oss serving needs — greedy, temperature,
top-k, top-p and per-request seeds — with every per-row option read from
persistent device tensors (:class:`SamplingTensors`). For fixed ``B`` and ``V``
it runs a fixed sequence of kernels with fixed shapes: no host synchronization,
no data-dependent shapes, no Python branching on tensor values, so a whole
decode step graph can include it and replay it.

Semantics (checked against ``vllm/v1/sample/sampler.py`` and
``vllm/v1/sample/ops/topk_topp_sampler.py`` of vLLM 0.26):

* logits are converted to fp32 first.
* greedy rows: ``temperature < 1e-5`` (vLLM's ``_SAMPLING_EPS``); the token is
  ``argmax`` of the *raw* fp32 logits (before temperature), lowest index on
  ties (``torch.argmax``). Greedy rows ignore top-k/top-p.
* other rows: ``logits / temperature``, then top-k, then top-p, then an
  exponential race over the surviving tokens.
* top-k: ``0``, negative or ``>= V`` means off (vLLM stores ``V`` for off
  rows). It keeps every token whose scaled logit is ``>=`` the k-th largest
  value, so ties at the k-th value keep more than k tokens (vLLM's rule).
* top-p: ``1.0`` means off. Computed on the top-k-filtered distribution: sort
  ascending, fp32 softmax, cumulative sum, drop tokens whose cumulative mass
  is ``<= 1 - p``, always keep the largest token. That keeps the smallest set
  of most likely tokens whose mass is ``>= p``. Both filters are vLLM's own
  ``apply_top_k_top_p_pytorch`` (its tie handling included).
* random draw: ``argmax(filtered_logits - log(E))`` with ``E ~ Exp(1)``,
  the same exponential race vLLM uses (``argmax(probs / E)``), done in the
  log domain (no softmax needed, no underflow for unlikely tokens).

Randomness. vLLM uses ``torch.Generator`` objects per seeded request, which are
host state and need one kernel launch per seeded row. Here every row's
uniforms are a pure function of ``(seed, step, token index)`` through a
counter-based hash (Chris Wellons' ``lowbias32`` 32-bit mixer chained over the
32-bit halves of seed and step, computed exactly in int64 tensors holding
32-bit lanes, products split into 16-bit halves so nothing overflows int64).
So a row's draw does not depend on the other rows, its position in the batch,
or the batch size, and replaying the graph advances because ``sample``
increments ``params.step`` in place. Unseeded requests get a host-drawn random
seed when their row is filled (:func:`fill_sampling_tensors`). Seeded tokens
are reproducible across runs of *this* sampler but are NOT the same tokens
vLLM's stock sampler gives for the same seed (different generator).

Cost. Top-k/top-p sort the whole row (``torch.sort``, fp32 keys with
int64 values) plus a softmax, cumsum and scatter over ``[B, V]``; for gpt-oss
(``V = 201088``) that is the dominant cost of this sampler and it grows
linearly with ``B``. Pass ``apply_top_k_top_p=False`` (a static, capture-time
choice, e.g. a separate graph for batches without top-k/top-p) to skip it.
The hash makes several ``[B, V]`` int64 temporaries when run eagerly (about
1.6 MB each per row at V=201088); under ``torch.compile`` they fuse.

NOT done yet (this is a building block, not the feature):

* the whole-model graph itself (embedding + layers + lm_head + this sampler in
  one capture), capture sizes, memory/time reporting;
* a worker/scheduler (``--worker-cls`` / ``--scheduler-cls``) that keeps
  ``SamplingTensors`` rows in step with vLLM's persistent batch (row moves,
  step counters, per-batch fallback for unsupported options), multi-step
  decode, Eagle3 drafting/verification;
* logprobs, penalties, min_p, logit bias, allowed/bad words, min_tokens,
  structured outputs, logits processors (:func:`fill_sampling_tensors`
  rejects them);
* a sort-free top-k/top-p (e.g. fixed-iteration pivot bisection) for speed;
* graph capture has only been proxied on CPU (``torch.compile(fullgraph=True)``);
  it has not been captured with ``torch.cuda.graph`` on a GPU yet.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Sequence

import torch

__all__ = [
    "SAMPLING_EPS",
    "SUPPORTED_OPTIONS",
    "SamplingTensors",
    "fill_sampling_tensors",
    "sample",
    "sample_reference",
    "uniforms",
]

# vLLM's threshold below which a temperature means greedy.
SAMPLING_EPS = 1e-5

SUPPORTED_OPTIONS = ("temperature", "top_k", "top_p", "seed")

_M32 = 0xFFFFFFFF


# --------------------------------------------------------------------------
# Counter-based hash on int64 tensors holding 32-bit lanes.
# --------------------------------------------------------------------------


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for ``x`` in ``[0, 2**32)``; intermediates < 2**49."""
    lo = c & 0xFFFF
    hi = c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (bijective 32-bit mixer) on values in ``[0, 2**32)``."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    x = x ^ (x >> 16)
    return x


def _row_keys(seed: torch.Tensor, step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two 32-bit keys per row from 64-bit ``seed`` and ``step`` ([B] int64)."""
    s_lo = seed & _M32
    s_hi = (seed >> 32) & _M32  # arithmetic shift, then mask: two's-complement bits
    t_lo = step & _M32
    t_hi = (step >> 32) & _M32
    k = _mix32(s_lo ^ 0x9E3779B9)
    k = _mix32(k ^ s_hi)
    k = _mix32(k ^ t_lo)
    k1 = _mix32(k ^ t_hi)
    k2 = _mix32(k1 ^ 0x85EBCA6B)
    return k1, k2


def uniforms(seed: torch.Tensor, step: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[B, V]`` fp32 uniforms in the open interval (0, 1), a pure function of
    each row's ``(seed, step)`` and the token index."""
    k1, k2 = _row_keys(seed.to(torch.int64), step.to(torch.int64))
    idx = torch.arange(vocab_size, device=seed.device, dtype=torch.int64)
    x = _mix32(idx.unsqueeze(0) ^ k1.unsqueeze(1))
    x = _mix32(x ^ k2.unsqueeze(1))
    m = (x >> 9).to(torch.float32)  # 23 bits: (m + 0.5) * 2**-23 is exact in fp32
    return (m + 0.5) * (1.0 / 8388608.0)


# --------------------------------------------------------------------------
# Persistent per-row options.
# --------------------------------------------------------------------------


@dataclass
class SamplingTensors:
    """Persistent per-row sampling options on the device (one row per request slot).

    temperature [N] fp32 (< 1e-5 => greedy), top_k [N] int32 (<= 0 or >= V => off),
    top_p [N] fp32 (1.0 => off), seed [N] int64, step [N] int64 (tokens already
    sampled for the row's request; ``sample`` increments it in place).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor
    step: torch.Tensor

    @classmethod
    def allocate(cls, max_rows: int, device: torch.device | str = "cpu") -> "SamplingTensors":
        return cls(
            temperature=torch.zeros(max_rows, dtype=torch.float32, device=device),
            top_k=torch.zeros(max_rows, dtype=torch.int32, device=device),
            top_p=torch.ones(max_rows, dtype=torch.float32, device=device),
            seed=torch.zeros(max_rows, dtype=torch.int64, device=device),
            step=torch.zeros(max_rows, dtype=torch.int64, device=device),
        )

    @property
    def max_rows(self) -> int:
        return self.temperature.shape[0]

    def rows(self, n: int) -> "SamplingTensors":
        """Views of the first ``n`` rows (same storage: graph-safe)."""
        return SamplingTensors(
            self.temperature[:n], self.top_k[:n], self.top_p[:n], self.seed[:n], self.step[:n]
        )


def _as_int64(value: int) -> int:
    """Map any Python int to the signed int64 with the same low 64 bits."""
    v = value & 0xFFFFFFFFFFFFFFFF
    return v - (1 << 64) if v >= (1 << 63) else v


def _check_params(i: int, p: Any) -> tuple[float, int, float, int | None]:
    def bad(field: str, value: Any, why: str) -> ValueError:
        return ValueError(
            f"sm121 graph sampler: request {i}: unsupported {field}={value!r} ({why}); "
            f"supported options: {', '.join(SUPPORTED_OPTIONS)} "
            "(no logprobs, penalties, min_p, logit_bias, allowed_token_ids, bad_words, "
            "min_tokens, structured outputs or logits processors)"
        )

    temperature = float(getattr(p, "temperature", 1.0))
    if not (temperature == temperature and abs(temperature) != float("inf")) or temperature < 0:
        raise bad("temperature", temperature, "must be finite and >= 0")
    top_k = getattr(p, "top_k", 0)
    if top_k is None:
        top_k = 0
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1:
        raise bad("top_k", top_k, "must be an int: -1 or 0 (off) or >= 1")
    top_p = getattr(p, "top_p", 1.0)
    top_p = 1.0 if top_p is None else float(top_p)
    if not 0.0 < top_p <= 1.0:
        raise bad("top_p", top_p, "must be in (0, 1]")
    seed = getattr(p, "seed", None)
    if seed == -1:
        seed = None
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad("seed", seed, "must be an int or None")

    # Options this sampler does not implement: reject rather than ignore.
    checks = (
        ("min_p", 0.0, lambda v: v is None or float(v) <= SAMPLING_EPS),
        ("presence_penalty", 0.0, lambda v: v is None or float(v) == 0.0),
        ("frequency_penalty", 0.0, lambda v: v is None or float(v) == 0.0),
        ("repetition_penalty", 1.0, lambda v: v is None or float(v) == 1.0),
        ("logit_bias", None, lambda v: not v),
        ("allowed_token_ids", None, lambda v: not v),
        ("bad_words", None, lambda v: not v),
        ("min_tokens", 0, lambda v: not v),
        ("logprobs", None, lambda v: v is None),
        ("logits_processors", None, lambda v: not v),
        ("structured_outputs", None, lambda v: v is None),
    )
    for field, default, ok in checks:
        value = getattr(p, field, default)
        if not ok(value):
            raise bad(field, value, "not implemented by the graph sampler")
    return temperature, top_k, top_p, seed


def fill_sampling_tensors(
    tensors: SamplingTensors,
    params: Sequence[Any],
    vocab_size: int,
    *,
    steps: Sequence[int] | None = None,
    rng: random.Random | None = None,
) -> None:
    """Validate SamplingParams-like objects and write them into rows ``0..len-1``.

    Host-side (runs before a replay, never inside the graph). Rows past
    ``len(params)`` become greedy padding. ``steps[i]`` is the number of tokens
    request ``i`` has sampled already (default 0). Requests without a seed get
    a random 63-bit seed from ``rng`` (default: ``random.SystemRandom``).
    Raises ValueError naming the field for anything unsupported.
    """
    n = len(params)
    if n > tensors.max_rows:
        raise ValueError(f"{n} requests but SamplingTensors has {tensors.max_rows} rows")
    if steps is not None and len(steps) != n:
        raise ValueError(f"steps has {len(steps)} entries for {n} requests")
    rng = rng or random.SystemRandom()
    temps, ks, ps, seeds = [], [], [], []
    for i, p in enumerate(params):
        temperature, top_k, top_p, seed = _check_params(i, p)
        if temperature < SAMPLING_EPS:
            temperature, top_k, top_p = 0.0, 0, 1.0  # vLLM: greedy ignores top-k/top-p
        if not 0 < top_k < vocab_size:
            top_k = vocab_size
        temps.append(temperature)
        ks.append(top_k)
        ps.append(top_p)
        seeds.append(_as_int64(rng.getrandbits(63) if seed is None else seed))
    m = tensors.max_rows
    pad = m - n
    dev = tensors.temperature.device
    tensors.temperature.copy_(torch.tensor(temps + [0.0] * pad, dtype=torch.float32), non_blocking=dev.type != "cpu")
    tensors.top_k.copy_(torch.tensor(ks + [vocab_size] * pad, dtype=torch.int32))
    tensors.top_p.copy_(torch.tensor(ps + [1.0] * pad, dtype=torch.float32))
    tensors.seed.copy_(torch.tensor(seeds + [0] * pad, dtype=torch.int64))
    st = [int(s) for s in steps] if steps is not None else [0] * n
    tensors.step.copy_(torch.tensor(st + [0] * pad, dtype=torch.int64))


# --------------------------------------------------------------------------
# The graph-safe sampling path.
# --------------------------------------------------------------------------


def _apply_top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p on ``scaled`` [B, V] (in place, dropped tokens -> -inf) with vLLM's own
    ``apply_top_k_top_p_pytorch`` (sort/gather/cumsum/scatter only: graph-safe without its
    ``allow_cpu_sync`` shortcut). Rows with top-k off (0, negative or >= V) get ``V``, as vLLM
    stores them."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    vocab = scaled.shape[1]
    k = top_k.to(torch.int64)
    k = torch.where((k <= 0) | (k >= vocab), torch.full_like(k, vocab), k)
    return apply_top_k_top_p_pytorch(scaled, k, top_p.to(torch.float32), allow_cpu_sync=False)


def sample(
    logits: torch.Tensor,
    params: SamplingTensors,
    out_tokens: torch.Tensor,
    *,
    apply_top_k_top_p: bool = True,
    advance: bool = True,
) -> torch.Tensor:
    """Sample one token per row of ``logits`` [B, V] into ``out_tokens`` [B] int64.

    Reads rows ``0..B-1`` of ``params`` (which may hold more rows), writes the
    tokens into ``out_tokens`` in place and, when ``advance``, increments
    ``params.step[:B]`` in place. ``apply_top_k_top_p`` is a static choice:
    ``False`` skips the sort and treats every row as top-k/top-p off.
    Returns ``out_tokens``.
    """
    batch, vocab = logits.shape
    if out_tokens.shape != (batch,) or out_tokens.dtype != torch.int64:
        raise ValueError(f"out_tokens must be int64 of shape ({batch},)")
    p = params.rows(batch)
    x = logits.to(torch.float32)
    greedy_tok = torch.argmax(x, dim=-1)
    is_greedy = p.temperature < SAMPLING_EPS
    temp = torch.where(is_greedy, torch.ones_like(p.temperature), p.temperature)
    scaled = x / temp.unsqueeze(1)
    if apply_top_k_top_p:
        scaled = _apply_top_k_top_p(scaled, p.top_k, p.top_p)
    u = uniforms(p.seed, p.step, vocab)
    neg_log_e = -torch.log(-torch.log(u))  # Gumbel noise: -log(E), E = -log(u) ~ Exp(1)
    random_tok = torch.argmax(scaled + neg_log_e, dim=-1)
    out_tokens.copy_(torch.where(is_greedy, greedy_tok, random_tok))
    if advance:
        p.step.add_(1)
    return out_tokens


# --------------------------------------------------------------------------
# Straightforward reference (tests only; per-row Python, same random numbers).
# --------------------------------------------------------------------------


def sample_reference(
    logits: torch.Tensor,
    temperature: Sequence[float],
    top_k: Sequence[int],
    top_p: Sequence[float],
    seed: Sequence[int],
    step: Sequence[int],
) -> list[int]:
    """Per-row reference: greedy argmax, or temperature -> top-k -> top-p ->
    exponential race ``argmax(probs / E)`` with ``E = -log(u)`` from :func:`uniforms`.

    top-p is written the direct way: sort descending and keep the shortest
    prefix whose mass reaches ``p`` (the most likely token always kept).
    """
    out = []
    vocab = logits.shape[1]
    for i in range(logits.shape[0]):
        row = logits[i].to(torch.float64)
        if temperature[i] < SAMPLING_EPS:
            out.append(int(torch.argmax(logits[i].to(torch.float32))))
            continue
        z = row / float(temperature[i])
        k = top_k[i]
        if 0 < k < vocab:
            kth = torch.sort(z, descending=True).values[k - 1]
            z = torch.where(z >= kth, z, torch.tensor(float("-inf"), dtype=z.dtype))
        if top_p[i] < 1.0:
            probs = torch.softmax(z, dim=0)
            order = torch.argsort(probs, descending=True, stable=True)
            mass_before = torch.cumsum(probs[order], dim=0) - probs[order]
            keep_sorted = mass_before < top_p[i]
            keep_sorted[0] = True
            keep = torch.zeros(vocab, dtype=torch.bool)
            keep[order[keep_sorted]] = True
            z = torch.where(keep, z, torch.tensor(float("-inf"), dtype=z.dtype))
        probs = torch.softmax(z, dim=0)
        u = uniforms(
            torch.tensor([seed[i]], dtype=torch.int64), torch.tensor([step[i]], dtype=torch.int64), vocab
        )[0].to(torch.float64)
        e = -torch.log(u)
        out.append(int(torch.argmax(probs / e)))
    return out
