"""The model runner of the whole-model graph mode, stage A (``vllm_sm121.graph.tail``).

``WholeModelRunner`` is vLLM 0.26's ``GPUModelRunner`` with three changes, all inside methods
vLLM itself calls; every batch the tail does not cover runs stock code unchanged:

* ``load_model``: the FULL ``CUDAGraphWrapper`` is rebuilt around a :class:`DecodeTail` (before
  any capture), so captured uniform-decode graphs end in lm_head + greedy argmax.
* ``_model_forward`` (documented by vLLM as overridable): decides, per step, whether this batch
  takes the graph's tokens (covered by a FULL replay, every request eligible); if so the tail's
  ``compute_logits`` skips the eager lm_head for this step.
* ``_sample``: returns the graph's tokens for such a step (``SamplerOutput`` as stock's greedy
  path makes it), stock's sampler otherwise.

Verification (``sm121_graph_verify(True)``, e.g. ``LLM.collective_rpc("sm121_graph_verify",
args=(True,))``; a debugging and test aid, slower): a step that takes the graph's tokens also runs
stock's lm_head and sampler on the same hidden states, counts rows where the two tokens differ and
the largest logit gap of such a row (0 for an exact tie, which stock breaks to the lowest index as
well), and still returns the graph's tokens. Rows the graph samples at a temperature
(``$VLLM_SM121_GRAPH_SAMPLE=1``) are random on both sides: counted apart, not compared.

In-graph sampling (``$VLLM_SM121_GRAPH_SAMPLE=1``, opt-in): the tail runs
``kernels/decode_sample.py`` instead of the argmax, and unseeded temperature-only requests take the
graph's tokens as greedy ones do. Before a replay whose tokens are taken, the rows' temperatures and
seeds are copied to the tail's buffers when the rows changed (never within a steady greedy chain).
A row's seed is a hash of (the engine's ``--seed``, the request id): the same on every TP rank, as
each rank samples for itself.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import torch
from vllm import envs
from vllm.compilation.cuda_graph import CUDAGraphWrapper
from vllm.config import CUDAGraphMode
from vllm.logger import init_logger
from vllm.model_executor.offloader.base import get_offloader
from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput, SamplerOutput
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_sm121.kernels import decode_sample
from vllm_sm121.kernels.decode_inputs import MAX_PATCHES, advance_decode_inputs

from . import steady
from .tail import (MAX_ROWS, SAMPLE_ENV, SECTION_OPTION, DecodeTail, covers, current_context, ineligible_reason,
                   sample_level, unsupported_reason)

logger = init_logger("vllm.sm121.graph")


class StepGraphWrapper(CUDAGraphWrapper):
    """vLLM's FULL wrapper around a DecodeTail; ``unwrap()`` still gives the model itself."""

    def unwrap(self):
        return self.runnable.model


# Pinned host slots for the steady steps' tokens: a slot is rewritten RING steps later, and vLLM's
# engine keeps at most 2 steps in flight (async scheduling's batch queue) before reading one.
RING = 8
# Block-table entries one steady step may write through the input kernel (unless
# $VLLM_SM121_GRAPH_PATCH_PAGES=0): the input kernel's MAX_PATCHES, room for two new pages per row and group
# (more only with hybrid block sizes; beyond this, stock's upload).
assert MAX_PATCHES >= 2 * MAX_ROWS * steady.MAX_KV_GROUPS


class _TokensOutput(AsyncModelRunnerOutput):
    """A steady step's output: the tokens reach ``host`` (pinned) by a copy queued on the default
    stream right after the replay, ``event`` recorded after it (stock's AsyncGPUModelRunnerOutput
    does the same on a side stream, with an allocation and a new event per step)."""

    def __init__(self, output: ModelRunnerOutput, host: torch.Tensor, event: torch.cuda.Event):
        self._output, self._host, self._event = output, host, event

    def get_output(self) -> ModelRunnerOutput:
        self._event.synchronize()
        self._output.sampled_token_ids = self._host.tolist()
        return self._output


class WholeModelRunner(GPUModelRunner):
    _sm121_tail: DecodeTail | None = None
    _sm121_fallbacks: dict
    _sm121_taken: int = 0
    _sm121_take: bool = False
    _sm121_verify: bool = False
    _sm121_enabled: bool = True  # sm121_graph_enable: False runs every step as stock does
    _sm121_checked: dict | None = None
    # stage B (vllm_sm121.graph.steady)
    _sm121_chain: tuple | None = None  # (row request ids, batch descriptor) of a graphed decode step
    _sm121_static: str | None = None  # why the fast path is off for this engine ("" until checked)
    _sm121_pending: tuple | None = None  # a steady step between execute_model and sample_tokens
    _sm121_h2d_in_flight: bool = True  # a host-to-device copy may still read pinned input buffers
    _sm121_fast_sampled: bool = False  # steady steps of batches stage A does not take (off: $VLLM_SM121_GRAPH_FAST_SAMPLED=0)
    _sm121_patch_pages: bool = False  # new pages through the input kernel (off: $VLLM_SM121_GRAPH_PATCH_PAGES=0)

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        why = unsupported_reason(self.vllm_config)
        if why is None and type(self.model) is not CUDAGraphWrapper:
            why = f"vLLM did not wrap the model in a FULL CUDAGraphWrapper (got {type(self.model).__name__})"
        if why is None and getattr(self, "use_aux_hidden_state_outputs", False):
            why = "the model returns auxiliary hidden states (Eagle3 target): stage D, not built yet"
        if why:
            raise ValueError(f"{SECTION_OPTION}: {why}")
        rows = min(MAX_ROWS, self.compilation_config.max_cudagraph_capture_size or MAX_ROWS)
        self._sm121_tail = DecodeTail(self.model.unwrap(), rows, self.device,
                                      samples=sample_level(os.environ.get(SAMPLE_ENV)))
        self._sm121_sampling_key = None  # the rows whose temperatures / seeds the tail's buffers hold
        self._sm121_fallbacks = {}
        self._sm121_taken = 0
        self._sm121_steady = {"fast": 0, "staged": 0, "fast_sampled": 0, "stock": {}}
        self._sm121_static = "" if os.environ.get(steady.FAST_PATH_ENV, "1") != "0" else f"${steady.FAST_PATH_ENV}=0"
        self._sm121_fast_sampled = os.environ.get(steady.FAST_SAMPLED_ENV, "1") != "0"
        self._sm121_patch_pages = os.environ.get(steady.PATCH_PAGES_ENV, "1") != "0"
        self.model = StepGraphWrapper(self._sm121_tail, self.vllm_config, runtime_mode=CUDAGraphMode.FULL)
        logger.info("sm121 whole-model graphs: lm_head + greedy sampling inside the FULL decode graphs of <= %d "
                    "requests (other batches: stock's lm_head and sampler); steady decode steps on device inputs "
                    "unless $%s=0 (sampled / logprob batches too unless $%s=0; new KV pages through the input "
                    "kernel unless $%s=0)", rows, steady.FAST_PATH_ENV, steady.FAST_SAMPLED_ENV, steady.PATCH_PAGES_ENV)

    def capture_model(self) -> int:
        # vLLM may still lower cudagraph_mode after load_model (backend support, in
        # initialize_kv_cache); without FULL decode graphs the tail would silently never run.
        why = unsupported_reason(self.vllm_config)
        if why:
            raise ValueError(f"{SECTION_OPTION}: after vLLM resolved the CUDA graph mode, {why}")
        import time

        tail, t0 = self._sm121_tail, time.perf_counter()
        runs = tail.ran if tail is not None else 0
        size = super().capture_model()
        if tail is not None:  # the issue asks for capture time and memory at startup, mode on
            logger.info("sm121 whole-model graphs: capture %.1f s, %.2f GiB (vLLM's graphs; the lm_head + argmax "
                        "tail traced %d times, in the decode graphs of <= %d requests); steady decode steps: %s",
                        time.perf_counter() - t0, (size or 0) / (1 << 30), tail.ran - runs, tail.max_rows,
                        f"stock ({self._sm121_static})" if self._sm121_static else "on device inputs where eligible")
        return size

    def _sm121_custom_logitsprocs(self, metadata) -> bool:
        """Whether any logits processor beyond vLLM's built-ins exists (--logits-processors or a
        vllm.logits_processors plugin). The persistent batch builds its processors once, so this
        is computed on the first step and kept."""
        custom = self.__dict__.get("_sm121_custom")
        if custom is None:
            from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS

            procs = getattr(metadata, "logitsprocs", None)
            custom = bool(self.vllm_config.model_config.logits_processors) or (
                procs is not None and any(type(p) not in BUILTIN_LOGITS_PROCESSORS for p in procs.all))
            self._sm121_custom = custom
        return custom

    def _sm121_reason(self) -> str | None:
        batch = self.input_batch
        params = [self.requests[r].sampling_params for r in batch.req_ids[: batch.num_reqs]]
        metadata = batch.sampling_metadata
        return ineligible_reason(
            metadata, params, custom_logits_processors=self._sm121_custom_logitsprocs(metadata),
            nans_in_logits=bool(envs.VLLM_COMPUTE_NANS_IN_LOGITS),
            thinking_budget=not getattr(batch, "no_thinking_budget", True),
            graph_samples=getattr(self._sm121_tail, "samples", 0))

    def _sm121_sync_sampling(self) -> None:
        """Before a replay whose tokens are taken, with in-graph sampling: the rows' temperatures
        (0 = greedy) and seeds into the tail's buffers, copied only when they changed (an all-greedy
        batch needs only zero temperatures, so greedy chains never copy). The copies are queued from
        a pinned ring slot (RING, as the token slots: rewritten only RING syncs later), no host wait."""
        tail, batch = self._sm121_tail, self.input_batch
        if not tail.samples:
            return
        n = batch.num_reqs
        greedy = batch.sampling_metadata.all_greedy
        filt = tail.samples >= 2 and not greedy  # greedy rows ignore top-k / top-p
        if greedy:
            if self._sm121_sampling_key == "greedy":
                return
            key = "greedy"
        else:
            temps = np.asarray(batch.temperature_cpu[:n], dtype=np.float32)
            if filt:
                top_k = np.asarray(batch.top_k_cpu[:n], dtype=np.int32)
                top_p = np.asarray(batch.top_p_cpu[:n], dtype=np.float32)
            key = (tuple(batch.req_ids[:n]), temps.tobytes(), (top_k.tobytes(), top_p.tobytes()) if filt else None)
            if key == self._sm121_sampling_key:
                return
        if self.__dict__.get("_sm121_samp_t") is None:
            pin = tail.temperature.device.type == "cuda"  # (CPU tests: no pinned memory without a driver)
            self._sm121_samp_t = torch.zeros((RING, tail.max_rows), dtype=torch.float32, pin_memory=pin)
            self._sm121_samp_s = torch.zeros((RING, tail.max_rows), dtype=torch.int64, pin_memory=pin)
            self._sm121_samp_k = torch.zeros((RING, tail.max_rows), dtype=torch.int32, pin_memory=pin)
            self._sm121_samp_p = torch.ones((RING, tail.max_rows), dtype=torch.float32, pin_memory=pin)
            self._sm121_samp_next = 0
        k = self._sm121_samp_next
        self._sm121_samp_next = (k + 1) % RING
        host_t, host_s = self._sm121_samp_t[k].numpy(), self._sm121_samp_s[k].numpy()
        host_t[:] = 0.0
        host_s[:] = 0
        if not greedy:
            host_t[:n] = temps
            base = self.vllm_config.model_config.seed or 0
            for i, req_id in enumerate(batch.req_ids[:n]):
                digest = hashlib.blake2b(f"{base}:{req_id}".encode(), digest_size=8).digest()
                host_s[i] = int.from_bytes(digest, "little") & ((1 << 63) - 1)
        tail.temperature.copy_(self._sm121_samp_t[k], non_blocking=True)  # stream-ordered: after the last replay
        tail.seeds.copy_(self._sm121_samp_s[k], non_blocking=True)
        if filt:  # an all-greedy batch leaves top-k / top-p as they are
            host_k, host_p = self._sm121_samp_k[k].numpy(), self._sm121_samp_p[k].numpy()
            host_k[:] = 0
            host_p[:] = 1.0
            host_k[:n], host_p[:n] = top_k, top_p
            tail.top_k.copy_(self._sm121_samp_k[k], non_blocking=True)
            tail.top_p.copy_(self._sm121_samp_p[k], non_blocking=True)
        self._sm121_sampling_key = key

    def _sm121_sampled_rows(self, n: int) -> torch.Tensor | None:
        """Rows [n] bool that the graph sampled at a temperature (None: none): verification skips them."""
        if not self._sm121_tail.samples or self.input_batch.sampling_metadata.all_greedy:
            return None
        return torch.from_numpy(np.asarray(self.input_batch.temperature_cpu[:n]) >= decode_sample.SAMPLING_EPS)

    def _model_forward(self, *args, **kwargs):
        tail = self._sm121_tail
        if tail is not None:
            tail.__dict__["claimed"] = False
            self._sm121_take = False
            if self._sm121_enabled and covers(current_context(), tail.max_rows):
                why = self._sm121_reason()
                # a graphed uniform decode of these rows: the next step may continue it (stage B)
                self._sm121_chain = (tuple(self.input_batch.req_ids), current_context().batch_descriptor)
                if why is None:
                    if not self._sm121_verify:  # verification keeps stock's lm_head for the comparison
                        tail.claim()
                    self._sm121_take = True
                    self._sm121_sync_sampling()
                else:
                    self._sm121_note_fallback(why)
        return super()._model_forward(*args, **kwargs)

    def _sm121_note_fallback(self, why: str) -> None:
        """A step whose tokens stock's sampler draws: counted per reason, the first one logged."""
        if why not in self._sm121_fallbacks:
            logger.info("sm121 whole-model graph: a batch falls back to stock sampling (%s); "
                        "further fallbacks for this reason are not logged", why)
        self._sm121_fallbacks[why] = self._sm121_fallbacks.get(why, 0) + 1

    def _sample(self, logits, spec_decode_metadata) -> SamplerOutput:
        if spec_decode_metadata is None and self._sm121_take:
            self._sm121_take = False
            self._sm121_taken += 1
            tokens = self._sm121_tail.sampled(self.input_batch.num_reqs)
            if self._sm121_verify:  # stock's sampler edits the logits in place: it gets a copy
                self._sm121_check(tokens, logits, super()._sample(logits.clone(), None).sampled_token_ids)
            else:
                self.input_batch.update_async_output_token_ids()  # stock's side effect, kept
            return SamplerOutput(sampled_token_ids=tokens, logprobs_tensors=None)
        return super()._sample(logits, spec_decode_metadata)

    # ------------------------------------------------------------------------------------------
    # stage B: steady decode steps (vllm_sm121.graph.steady)
    # ------------------------------------------------------------------------------------------

    def _dummy_run(self, *args, **kwargs):
        self._sm121_chain = None  # it rewrites seq_lens, query_start_loc and the slot mappings
        return super()._dummy_run(*args, **kwargs)

    @torch.inference_mode()
    def execute_model(self, scheduler_output, intermediate_tensors=None):
        plan = self._sm121_plan(scheduler_output, intermediate_tensors)
        if plan is None:
            self._sm121_chain = None  # set again by _model_forward if this step is a graphed decode
            self._sm121_h2d_in_flight = True  # stock uploads inputs from pinned buffers
            return super().execute_model(scheduler_output, intermediate_tensors)
        return self._sm121_steady_step(scheduler_output, *plan)

    def _sm121_plan(self, so, intermediate_tensors):
        """(graph entry, new KV blocks, stock sampling) when ``so`` is a steady step the fast path
        takes, else None."""
        chain = self._sm121_chain
        if chain is None or self._sm121_tail is None or intermediate_tensors is not None or not self._sm121_enabled:
            return None
        if self._sm121_static == "":
            from vllm.distributed.ec_transfer import has_ec_transfer
            from vllm.distributed.kv_transfer import has_kv_transfer_group

            self._sm121_static = steady.static_reason(self, kv_transfer=has_kv_transfer_group(),
                                                      ec_transfer=has_ec_transfer())
            if self._sm121_static:
                logger.info("sm121 whole-model graph: steady decode steps run stock vLLM's loop (%s)",
                            self._sm121_static)
        if self._sm121_static:
            return None
        why, new_blocks = steady.continuation_reason(so, self.input_batch, self.requests, chain[0])
        stock_sampling = None  # why stock's sampler draws this steady step's tokens (after the replay)
        if why is None:
            stock_sampling = self._sm121_reason()
            if stock_sampling is not None and not self._sm121_fast_sampled:
                why, stock_sampling = stock_sampling, None
        entry = self.model.concrete_cudagraph_entries.get(chain[1])
        if why is None and (entry is None or entry.cudagraph is None):
            why = "no captured graph for this batch"
        if why is not None:
            stock = self._sm121_steady["stock"]
            stock[why] = stock.get(why, 0) + 1
            return None
        if stock_sampling is not None:
            self._sm121_note_fallback(stock_sampling)
        return entry, new_blocks, stock_sampling is not None

    def _sm121_steady_step(self, so, entry, new_blocks: bool, sampled: bool = False):
        tail, batch, bd = self._sm121_tail, self.input_batch, self._sm121_chain[1]
        n, rows = batch.num_reqs, bd.num_tokens
        if self.__dict__.get("_sm121_counts") is None:
            self._sm121_buffers()
        tables = batch.block_table.block_tables
        before = [bt.num_blocks_per_row[:n].copy() for bt in tables] if new_blocks and self._sm121_patch_pages else None
        if self._sm121_h2d_in_flight:  # stock's fence: a queued upload may still read the pinned buffers written below
            self.prepare_inputs_event.synchronize()
        corrections = self._update_states(so)  # stock's bookkeeping; a steady step moves no row
        if tuple(batch.req_ids) != self._sm121_chain[0]:
            raise RuntimeError("sm121 whole-model graph: a steady step changed the persistent batch's rows "
                               "(the continuation check missed a case)")
        patches = self._sm121_patches(tables, before, n) if before is not None else None
        uploaded = new_blocks and patches is None
        if uploaded:  # staging: the rows' new pages (stock's own upload, every row, every group)
            batch.block_table.commit_block_table(n)
            self.prepare_inputs_event.record()
        self._sm121_h2d_in_flight = uploaded
        prev = batch.prev_sampled_token_ids
        self._sm121_advance(prev[:, 0], n, rows, patches)
        if self._sm121_verify:
            self._sm121_check_inputs(n, prev)
        get_offloader().sync_prev_onload()  # as CUDAGraphWrapper does before a replay
        if not sampled:
            self._sm121_sync_sampling()
        entry.cudagraph.replay()
        self._sm121_take = False
        if sampled:  # stock's lm_head, sampler and output on the graph's hidden states
            return self._sm121_stock_sampling(so, entry.output, n, new_blocks, corrections)
        k = self._sm121_ring_next
        self._sm121_ring_next = (k + 1) % RING
        host, event = self._sm121_host[k, :n], self._sm121_events[k]
        host.copy_(tail.tokens[:n, None], non_blocking=True)
        event.record()
        if self._sm121_verify:
            from vllm.v1.worker.gpu_model_runner import GPUModelRunner as Stock

            logits = self.model.compute_logits(entry.output[:n])
            self._sm121_check(tail.tokens[:n, None], logits, Stock._sample(self, logits.clone(), None).sampled_token_ids)
        self._sm121_pending = (n, host, event)
        self._sm121_steady["fast"] += 1
        self._sm121_steady["staged"] += int(new_blocks)
        self._sm121_taken += 1
        if corrections:
            corrections()
        return None

    def _sm121_stock_sampling(self, so, hidden, n: int, new_blocks: bool, corrections):
        """A steady step of a batch stage A does not take: leave what stock's execute_model leaves
        for its sample_tokens (logits of the n rows, which a uniform decode's logits_indices select),
        so stock samples, bookkeeps and builds the output as usual."""
        from vllm.v1.worker.gpu_model_runner import ExecuteModelState

        sample_hidden = hidden[:n]
        logits = self.model.compute_logits(sample_hidden)
        self.discard_request_mask.np[:n] = False  # stock refreshes it in _prepare_inputs (trap 5)
        self.execute_model_state = ExecuteModelState(so, logits, None, None, hidden, sample_hidden, None, None,
                                                     None, None)
        self.kv_connector_output = None
        self._sm121_steady["fast_sampled"] += 1
        self._sm121_steady["staged"] += int(new_blocks)
        if corrections:
            corrections()
        return None

    def _sm121_patches(self, tables, before, n: int):
        """The block-table entries ``_update_states`` appended this step, as (group, row, column,
        page) rows in the next pinned patch slot, which the input kernel reads in place (no copy of
        the tables); None when they do not fit (then stock's upload)."""
        k = self._sm121_patch_next
        buf = self._sm121_patch_np[k]
        m = 0
        for g, bt in enumerate(tables):
            after = bt.num_blocks_per_row[:n]
            for row in np.nonzero(after != before[g])[0]:
                cols = range(int(before[g][row]), int(after[row]))
                if m + len(cols) > len(buf):
                    return None
                for col in cols:
                    buf[m] = (g, row, col, bt.block_table.np[row, col])
                    m += 1
        self._sm121_patch_next = (k + 1) % RING
        return self._sm121_patch_host[k], m

    def _sm121_advance(self, tokens, n: int, rows: int, patches=None) -> None:
        """The steady inputs of ``rows`` (P) rows, ``n`` live, in one launch (kernels/decode_inputs.py)."""
        groups = [(bt.block_table.gpu, bt.slot_mapping.gpu, bt.block_size)
                  for bt in self.input_batch.block_table.block_tables]
        buf, m = patches if patches is not None else (None, 0)
        advance_decode_inputs(tokens, self._sm121_counts[n:n + 1], self.input_ids.gpu, self.positions,
                              self.seq_lens, groups, rows, patches=buf, num_patches=m)

    def _sm121_buffers(self) -> None:
        """Allocated at the first steady step: row counts on the device (the input kernel reads
        its live row count from memory), the pinned token slots and their events."""
        self._sm121_counts = torch.arange(MAX_ROWS + 1, dtype=torch.int32, device=self.device)
        self._sm121_host = torch.zeros((RING, MAX_ROWS, 1), dtype=torch.int32, pin_memory=True)
        self._sm121_events = [torch.cuda.Event(blocking=True) for _ in range(RING)]
        self._sm121_ring_next = 0
        self._sm121_patch_host = torch.zeros((RING, MAX_PATCHES, 4), dtype=torch.int32, pin_memory=True)
        self._sm121_patch_np = self._sm121_patch_host.numpy()
        self._sm121_patch_next = 0

    @torch.inference_mode()
    def sample_tokens(self, grammar_output):
        pending = self._sm121_pending
        if pending is None:
            return super().sample_tokens(grammar_output)
        self._sm121_pending = None
        if grammar_output is not None:
            raise RuntimeError("sm121 whole-model graph: a steady step received a grammar bitmask (the "
                               "continuation check excludes structured output)")
        n, host, event = pending
        batch = self.input_batch
        batch.update_async_output_token_ids()  # stock's _sample side effect (a no-op for these batches)
        # the state stock's sample_tokens / _bookkeeping_sync (async branch) leaves behind
        self._draft_token_ids = self._draft_probs = self._draft_prob_req_ids = self._draft_token_req_ids = None
        self.valid_sampled_token_count_gpu = None
        batch.prev_sampled_token_ids = self._sm121_tail.tokens[:n, None]  # int32 [n, 1], stock's dtype
        req_ids = batch.req_ids
        # prev_req_id_to_index stays: the continuation check found it equal to {req_id: row} already
        cursor = batch.num_tokens_no_spec
        for i in range(n):  # the -1 placeholder of each row's token in flight
            start = int(cursor[i])
            if start >= self.max_model_len:
                raise RuntimeError(f"Sampled token IDs exceed the max model length ({start + 1} > {self.max_model_len})")
            batch.token_ids_cpu[i, start] = -1
            batch.is_token_ids[i, start] = True
            cursor[i] = start + 1
            self.requests[req_ids[i]].output_token_ids.append(-1)
        output = ModelRunnerOutput(req_ids=req_ids.copy(), req_id_to_index=batch.req_id_to_index.copy(),
                                   sampled_token_ids=[], logprobs=None, prompt_logprobs_dict={},
                                   num_nans_in_logits={})
        batch.set_async_sampled_token_ids(host, event)
        return _TokensOutput(output, host, event)

    def _sm121_check_inputs(self, n: int, prev: torch.Tensor) -> None:
        """Verification: the device inputs the fast path wrote vs what stock's _prepare_inputs
        computes from the host state (positions, sequence lengths, input ids, every group's slot
        mapping and the block-table pages they use); counts mismatching entries."""
        batch = self.input_batch
        pos = torch.from_numpy(np.asarray(batch.num_computed_tokens_cpu[:n], dtype=np.int64))
        bad = int((self.positions[:n].cpu() != pos).sum()) + int((self.seq_lens[:n].cpu() != pos + 1).sum())
        bad += int((self.input_ids.gpu[:n].cpu() != prev[:n, 0].cpu()).sum())
        rows = torch.arange(n)
        for bt in batch.block_table.block_tables:
            bs, table = bt.block_size, bt.block_table.cpu[:n]
            want = table[rows, pos // bs].to(torch.int64) * bs + pos % bs
            bad += int((bt.slot_mapping.gpu[:n].cpu() != want).sum())
            cols = int(pos.max()) // bs + 1
            bad += int((bt.block_table.gpu[:n, :cols].cpu() != table[:, :cols]).sum())
        c = self._sm121_checked
        c["input_steps"] = c.get("input_steps", 0) + 1
        c["input_mismatches"] = c.get("input_mismatches", 0) + bad

    def _sm121_check(self, graph, logits, stock) -> None:
        """Verification: count rows where the graph's token differs from stock's on these logits
        (rows the graph sampled at a temperature are counted apart: random on both sides)."""
        c = self._sm121_checked
        diff = (graph != stock).view(-1)
        sampled = self._sm121_sampled_rows(diff.numel())
        n_sampled = int(sampled.sum()) if sampled is not None else 0
        if n_sampled:
            diff = diff & ~sampled.to(diff.device)
            c["sampled_rows"] = c.get("sampled_rows", 0) + n_sampled
            c["sampled_outside_filter"] = c.get("sampled_outside_filter", 0) + self._sm121_outside_filter(
                graph, logits, sampled)
        c["steps"] += 1
        c["rows"] += int(diff.numel()) - n_sampled
        bad = int(diff.sum().item())
        if bad:
            lf = logits.to(torch.float32)
            gap = (lf.gather(1, stock.long()) - lf.gather(1, graph.long())).view(-1)[diff].abs().max().item()
            c["mismatched_rows"] += bad
            c["max_logit_gap"] = max(c["max_logit_gap"], gap)

    def _sm121_outside_filter(self, graph, logits, sampled) -> int:
        """Verification of temperature rows: how many graph tokens vLLM's own top-k / top-p filter
        (on these logits, the rows' options) would have dropped. 0 but for the kernel's documented
        boundary difference (ties at the top-p cut); a wrong copy of the options shows here."""
        batch, n = self.input_batch, sampled.numel()
        dev = logits.device
        option = lambda a, dtype: torch.from_numpy(np.asarray(a[:n], dtype=dtype))  # noqa: E731
        kept = decode_sample.kept_torch(logits[:n], option(batch.temperature_cpu, np.float32),
                                        option(batch.top_k_cpu, np.int32), option(batch.top_p_cpu, np.float32))
        inside = kept.gather(1, graph.reshape(-1)[:n].to(device=dev, dtype=torch.int64)[:, None])[:, 0]
        return int((~inside & sampled.to(dev)).sum())

    def sm121_graph_enable(self, on: bool = True) -> None:
        """Turn the mode's decode path on or off at run time (``collective_rpc``; tests): off, every
        step is stock's (no graph tokens taken, no steady steps; the captured graphs still replay,
        the tail's outputs go unused), so one engine, with one compiled model, runs with and
        without the mode. A test switch, not a fast stock mode: switched off, each replay still runs
        the tail (lm_head, sampling launches) and stock then computes the logits again."""
        self._sm121_enabled = bool(on)
        self._sm121_chain = None

    def sm121_graph_verify(self, on: bool = True) -> None:
        """Turn verification on or off (module docstring); resets its counters."""
        self._sm121_verify = bool(on)
        self._sm121_checked = {"steps": 0, "rows": 0, "mismatched_rows": 0, "max_logit_gap": 0.0,
                               "input_steps": 0, "input_mismatches": 0}

    def sm121_graph_stats(self) -> dict:
        """Decode steps that took the graph's tokens, fallbacks per reason, Python-side tail runs
        (captures), the rows a tail covers."""
        tail = self._sm121_tail
        steady_stats = getattr(self, "_sm121_steady", None) or {"fast": 0, "staged": 0, "fast_sampled": 0, "stock": {}}
        return {"taken": self._sm121_taken, "fallbacks": dict(getattr(self, "_sm121_fallbacks", {})),
                "steady": {**steady_stats, "stock": dict(steady_stats["stock"]), "off": self._sm121_static or None},
                "tail_runs": tail.ran if tail else 0, "max_rows": tail.max_rows if tail else 0,
                "verify": dict(self._sm121_checked) if self._sm121_checked is not None else None}
