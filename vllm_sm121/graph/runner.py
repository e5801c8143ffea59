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
well), and still returns the graph's tokens.
"""

from __future__ import annotations

import torch
from vllm import envs
from vllm.compilation.cuda_graph import CUDAGraphWrapper
from vllm.config import CUDAGraphMode
from vllm.logger import init_logger
from vllm.v1.outputs import SamplerOutput
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from .tail import MAX_ROWS, SECTION_OPTION, DecodeTail, covers, current_context, ineligible_reason, unsupported_reason

logger = init_logger("vllm.sm121.graph")


class StepGraphWrapper(CUDAGraphWrapper):
    """vLLM's FULL wrapper around a DecodeTail; ``unwrap()`` still gives the model itself."""

    def unwrap(self):
        return self.runnable.model


class WholeModelRunner(GPUModelRunner):
    _sm121_tail: DecodeTail | None = None
    _sm121_fallbacks: dict
    _sm121_taken: int = 0
    _sm121_take: bool = False
    _sm121_verify: bool = False
    _sm121_checked: dict | None = None

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
        self._sm121_tail = DecodeTail(self.model.unwrap(), rows, self.device)
        self._sm121_fallbacks = {}
        self._sm121_taken = 0
        self.model = StepGraphWrapper(self._sm121_tail, self.vllm_config, runtime_mode=CUDAGraphMode.FULL)
        logger.info("sm121 whole-model graphs (stage A): lm_head + greedy sampling inside the FULL decode "
                    "graphs of <= %d requests; other batches run stock vLLM's path", rows)

    def capture_model(self) -> int:
        # vLLM may still lower cudagraph_mode after load_model (backend support, in
        # initialize_kv_cache); without FULL decode graphs the tail would silently never run.
        why = unsupported_reason(self.vllm_config)
        if why:
            raise ValueError(f"{SECTION_OPTION}: after vLLM resolved the CUDA graph mode, {why}")
        return super().capture_model()

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
            thinking_budget=not getattr(batch, "no_thinking_budget", True))

    def _model_forward(self, *args, **kwargs):
        tail = self._sm121_tail
        if tail is not None:
            tail.__dict__["claimed"] = False
            self._sm121_take = False
            if covers(current_context(), tail.max_rows):
                why = self._sm121_reason()
                if why is None:
                    if not self._sm121_verify:  # verification keeps stock's lm_head for the comparison
                        tail.claim()
                    self._sm121_take = True
                else:
                    if why not in self._sm121_fallbacks:
                        logger.info("sm121 whole-model graph: a batch falls back to stock sampling (%s); "
                                    "further fallbacks for this reason are not logged", why)
                    self._sm121_fallbacks[why] = self._sm121_fallbacks.get(why, 0) + 1
        return super()._model_forward(*args, **kwargs)

    def _sample(self, logits, spec_decode_metadata) -> SamplerOutput:
        if spec_decode_metadata is None and self._sm121_take:
            self._sm121_take = False
            self._sm121_taken += 1
            tokens = self._sm121_tail.sampled(self.input_batch.num_reqs)
            if self._sm121_verify:
                self._sm121_check(tokens, logits, super()._sample(logits, None).sampled_token_ids)
            else:
                self.input_batch.update_async_output_token_ids()  # stock's side effect, kept
            return SamplerOutput(sampled_token_ids=tokens, logprobs_tensors=None)
        return super()._sample(logits, spec_decode_metadata)

    def _sm121_check(self, graph, logits, stock) -> None:
        """Verification: count rows where the graph's token differs from stock's on these logits."""
        c = self._sm121_checked
        diff = (graph != stock).view(-1)
        c["steps"] += 1
        c["rows"] += int(diff.numel())
        bad = int(diff.sum().item())
        if bad:
            lf = logits.to(torch.float32)
            gap = (lf.gather(1, stock.long()) - lf.gather(1, graph.long())).view(-1)[diff].abs().max().item()
            c["mismatched_rows"] += bad
            c["max_logit_gap"] = max(c["max_logit_gap"], gap)

    def sm121_graph_verify(self, on: bool = True) -> None:
        """Turn verification on or off (module docstring); resets its counters."""
        self._sm121_verify = bool(on)
        self._sm121_checked = {"steps": 0, "rows": 0, "mismatched_rows": 0, "max_logit_gap": 0.0}

    def sm121_graph_stats(self) -> dict:
        """Decode steps that took the graph's tokens, fallbacks per reason, Python-side tail runs
        (captures), the rows a tail covers."""
        tail = self._sm121_tail
        return {"taken": self._sm121_taken, "fallbacks": dict(getattr(self, "_sm121_fallbacks", {})),
                "tail_runs": tail.ran if tail else 0, "max_rows": tail.max_rows if tail else 0,
                "verify": dict(self._sm121_checked) if self._sm121_checked is not None else None}
