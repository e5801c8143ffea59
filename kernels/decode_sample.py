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

With ``top_k`` / ``top_p`` (per row; off = 0 or >= V / 1.0), threshold launches first find each
temperature row's threshold and the race runs over the entries at or above it: vLLM's rules
(top-k keeps every value >= the k-th largest, ties included; top-p on the top-k survivors'
softmax keeps the values whose mass at or below them exceeds 1 - p, and always the largest). No
sort: a radix search, 4 bits a pass, over the logits' order-preserving integer keys (16-bit for
bf16 / fp16 logits, 32-bit for fp32: KB), first for top-k (digit counts, ``tl.histogram``) then
for top-p (digit masses exp(logit / T - max) over the top-k survivors). Division by T is
monotone, so the k-th largest raw logit, scaled, is the k-th largest scaled one; the threshold
found on raw keys becomes one on the scaled logits' keys, which the sampling launch compares
(values that only tie after the division tie there too, as in vLLM's filter on the scaled
logits). Every pass is one launch over a (P, cdiv(V, BLOCK)) grid, each program one BLOCK chunk
of one row: it first reduces the previous pass's per-chunk partials (a small workspace; every
program the same fixed-order sums, so all agree and reruns repeat: integer counts, fp32 masses
in a fixed tree) to the digit holding the answer, then writes its chunk's partials for the next
digit; the sampling launch completes the last pass. Per step: KB / 4 top-k + KB / 4 top-p passes
over the vocabulary, each a read of the rows' logits spread over the whole GPU, then the
sampling launch and the final one: 8 + 2 = 10 launches for bf16 / fp16 logits, 16 + 2 = 18 for
fp32 (the previous kernel ran 18 passes in one program per row: 5.7-5.8 ms at 1, 8 and 32 rows
on an H200). The new kernels are tested under the Triton interpreter, compiled for sm_121a /
sm_90a, and ran on an H200 (574be8c, ``benchmarks/sample.py``): 65.8 / 102.0 / 256.0 us per step
at 1 / 8 / 32 rows against 282.5 / 675.0 / 1,226.6 us for vLLM's torch top-k / top-p path (from 8
rows on vLLM's dispatcher takes its Triton filter instead, not timed then). Two differences at the top-p boundary: sums run in another order
than vLLM's cumsum (a token whose cumulative mass ties within rounding may go the other way), and
a group of *equal* values straddling the cut is kept whole, where vLLM's sort keeps part of it in
its own order (bf16 logits tie often: on bf16-rounded random logits the kernel kept ~0.2% more
mass at p = 0.9). ``top_p == 1`` is off (vLLM's filter then still drops tokens whose fp32
probability underflows to 0, which the race never picks anyway). No min-p. The step counter
(int64, one element, on the device) is advanced by the last launch, so every replay of a
captured graph draws new numbers; nothing is read from the host, and the grids depend only on
the number of rows and the vocabulary.

Launches: (P, cdiv(V, BLOCK)) programs each score BLOCK entries (the noise only on temperature
rows: a per-row branch) and keep their best (value, lowest index); then P programs reduce the
blocks. Logits are read once by the sampling itself. Numerics are not bit-exact with the torch
reference for temperature rows (``log`` may round differently); greedy rows are exact. NaN logits
are not handled specially (stock's ``argmax`` returns a NaN's index; this kernel may not).
"""

from __future__ import annotations

import torch
import triton

from .decode_sample_details._decode_sample import (_decode_sample_final_kernel, _decode_sample_partial_kernel,
                                                   _decode_sample_topk_pass_kernel, _decode_sample_topp_pass_kernel)

SAMPLING_EPS = 1e-5  # vllm/v1/sample/sampler.py _SAMPLING_EPS
BLOCK = 4096  # vocabulary entries per program, in the sampling launch and in every threshold pass
THRESHOLD_SUB = 512  # a threshold pass's inner tile (top-p: [FAN, SUB] one-hot sums in registers)
THRESHOLD_FAN = 16  # digits per pass (4 bits)
THRESHOLD_STATE = 8  # int32 words of search state per row and slot
NUM_WARPS = 8


def num_blocks(vocab_size: int) -> int:
    return triton.cdiv(vocab_size, BLOCK)


def key_bits(dtype: torch.dtype) -> int:
    """Bits of the threshold search's keys: 32 for fp32 logits, 16 for bf16 / fp16."""
    return 32 if dtype == torch.float32 else 16


def workspace(rows: int, vocab_size: int, device) -> tuple[torch.Tensor, ...]:
    """Scratch for ``rows`` rows (allocate once, outside graph capture): the sampling launch's
    per-block partial results (fp32 and int32 [rows, NB]), per-row thresholds (int32 [rows]), and
    the threshold passes' per-chunk largest keys (int32 [rows, NB]), per-chunk digit counts
    (int32 [rows, 2, NB, FAN]) and masses (fp32, same shape), and search state (int32
    [rows, 2, STATE]). Nothing needs initialising: every pass writes what the next one reads."""
    nb, fan = num_blocks(vocab_size), THRESHOLD_FAN
    f32, i32 = dict(dtype=torch.float32, device=device), dict(dtype=torch.int32, device=device)
    return (torch.empty((rows, nb), **f32), torch.empty((rows, nb), **i32), torch.empty((rows,), **i32),
            torch.empty((rows, nb), **i32), torch.empty((rows, 2, nb, fan), **i32),
            torch.empty((rows, 2, nb, fan), **f32), torch.empty((rows, 2, THRESHOLD_STATE), **i32))


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
    nb, fan = num_blocks(logits.shape[1]), THRESHOLD_FAN
    want = [(torch.float32, (nb,)), (torch.int32, (nb,)), (torch.int32, ()), (torch.int32, (nb,)),
            (torch.int32, (2, nb, fan)), (torch.float32, (2, nb, fan)), (torch.int32, (2, THRESHOLD_STATE))]
    if len(ws) != len(want) or any(w.dtype != dt or w.dim() != 1 + len(shape) or w.shape[0] < p
                                   or tuple(w.shape[1:]) != shape or not w.is_contiguous()
                                   for w, (dt, shape) in zip(ws, want)):
        raise ValueError(f"workspace: expected decode_sample.workspace(>= {p}, {logits.shape[1]}): "
                         f"{[(str(dt), ('>=' + str(p),) + s) for dt, s in want]}, got "
                         f"{[(str(w.dtype), tuple(w.shape)) for w in ws]}")
    devices = {t.device for t in (logits, temperature, seeds, step, out, *ws)
               + ((top_k, top_p) if top_k is not None else ())}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def _consts(logits: torch.Tensor) -> dict:
    nb = num_blocks(logits.shape[1])
    return dict(EPS=SAMPLING_EPS, BLOCK=BLOCK, KB=key_bits(logits.dtype), FAN=THRESHOLD_FAN,
                NB_P2=triton.next_power_of_2(nb), NSTATE=THRESHOLD_STATE)


def _threshold_passes(logits, temperature, top_k, top_p, ws) -> None:
    """The top-k then top-p passes (``threshold_passes(dtype)`` launches); the sampling launch
    completes the last one."""
    p, v = logits.shape
    nb = num_blocks(v)
    _, _, _, cmax, cnt, mass, state = ws
    c = _consts(logits)
    for g in range(c["KB"] // 4):
        _decode_sample_topk_pass_kernel[(p, nb)](logits, logits.stride(0), temperature, top_k, top_p, cmax, cnt, state,
                                                 v, nb, g, SUB=THRESHOLD_SUB, **c, num_warps=NUM_WARPS)
    for j in range(c["KB"] // 4):
        _decode_sample_topp_pass_kernel[(p, nb)](logits, logits.stride(0), temperature, top_k, top_p, cmax, cnt, mass,
                                                 state, v, nb, j, SUB=THRESHOLD_SUB, **c, num_warps=NUM_WARPS)


def _partial(logits, temperature, seeds, step, ws, top_k, top_p) -> None:
    p, v = logits.shape
    nb = num_blocks(v)
    vals, idx, thr, _, _, mass, state = ws
    has_thr = top_k is not None
    _decode_sample_partial_kernel[(p, nb)](logits, logits.stride(0), temperature, seeds, step,
                                           top_k if has_thr else thr, top_p if has_thr else temperature, state, mass,
                                           thr, vals, idx, v, nb, HAS_THR=has_thr, **_consts(logits),
                                           num_warps=NUM_WARPS)


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
    if top_k is not None:
        _threshold_passes(logits, temperature, top_k, top_p, ws)
    _partial(logits, temperature, seeds, step, ws, top_k, top_p)
    nb = num_blocks(logits.shape[1])
    _decode_sample_final_kernel[(logits.shape[0],)](ws[0], ws[1], out, step, nb, NB_P2=triton.next_power_of_2(nb),
                                                    num_warps=1)
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
    """[P, V] bool: the entries the threshold passes keep (runs them and the sampling launch, which
    completes the last pass and stores the thresholds, into ``ws``; tests)."""
    p, v = logits.shape
    seeds, step = torch.zeros(p, dtype=torch.int64, device=logits.device), torch.zeros(1, dtype=torch.int64,
                                                                                        device=logits.device)
    _check(logits, temperature, seeds, step, torch.zeros(p, dtype=torch.int64, device=logits.device), ws, top_k, top_p)
    _threshold_passes(logits, temperature, top_k, top_p, ws)
    _partial(logits, temperature, seeds, step, ws, top_k, top_p)
    b = (_scaled_torch(logits, temperature) + 0.0).view(torch.int32)
    key = b ^ ((b >> 31) & 0x7FFFFFFF)
    return key >= ws[2][:p, None]
