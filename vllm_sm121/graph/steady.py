"""Stage B of the whole-model graph mode (issue 7): steady decode steps without stock vLLM's input
preparation (``docs/design-whole-model-graph.md`` section 4, ``docs/stage-b-state-map.md``).

A decode step is *steady* when the batch is exactly the previous step's: the same requests in the
same rows, one token each, the previous step a graphed uniform decode whose every row's token is
valid. Its inputs then follow on the device from the previous step's: positions and sequence
lengths advance by one, the input ids are the tokens just sampled, the slot of each row is read
from its block table (``kernels/decode_inputs.py``, one launch). The runner
(``vllm_sm121.graph.runner``) keeps stock's host bookkeeping (``_update_states``, the async
placeholders of ``_bookkeeping_sync``) so that any later stock step finds the state stock would
have left, and skips everything else: ``_prepare_inputs``, the attention metadata, the forward
context, the eager lm_head and sampler, the output object's extra stream and allocations. Per step:
the input launch, the graph replay, one copy of the tokens to the host (plus, on a step where a
request got a new KV block, one copy of the block tables per KV group).

Batches whose tokens stage A does not take (temperature, logprobs, penalties, ...): their steady
steps also run on device inputs and the graph replay, followed by stock's eager lm_head, sampler,
bookkeeping and output (``$VLLM_SM121_GRAPH_FAST_SAMPLED=0``: stock's whole step instead).

Import-light (no vLLM at import): the predicates take plain objects, so they are CPU-testable.
"""

from __future__ import annotations

from typing import Any

FAST_PATH_ENV = "VLLM_SM121_GRAPH_FAST_PATH"  # "0": stage A only (every step through stock's loop)
# steady steps of batches stage A does not take (sampling, logprobs, penalties, ...) also run on
# device inputs, then stock's eager lm_head and sampler; "0": stock's whole step for them
FAST_SAMPLED_ENV = "VLLM_SM121_GRAPH_FAST_SAMPLED"
# a steady step whose requests got new KV pages hands them to the input kernel as (group, row,
# column, page) entries it reads from pinned host memory, instead of stock's copy of the block
# tables (one or two copies every 16th step at batch 1); "0": stock's block-table copies
PATCH_PAGES_ENV = "VLLM_SM121_GRAPH_PATCH_PAGES"
MAX_KV_GROUPS = 2  # the input kernel's limit (gpt-oss: full and sliding-window layers)
STEADY_BACKENDS = ("SM121",)  # attention metadata built on persistent buffers, no device work


def static_reason(runner: Any, *, kv_transfer: bool = False, ec_transfer: bool = False) -> str | None:
    """Why this engine never takes the fast path (None: it may). ``runner``: vLLM's V1
    ``GPUModelRunner`` (attributes read by name); checked once, after the KV cache exists."""
    if not getattr(runner, "use_async_scheduling", False):
        return "async scheduling is off (the fast path hands tokens to the next step as async scheduling does)"
    if runner.lora_config is not None:
        return "LoRA"
    if runner.is_pooling_model:
        return "pooling model"
    if runner.supports_mm_inputs or runner.enable_prompt_embeds:
        return "multimodal inputs or prompt embeddings"
    if runner.uses_mrope or getattr(runner, "uses_xdrope_dim", 0):
        return "M-RoPE / XD-RoPE positions"
    if getattr(runner, "dcp_world_size", 1) > 1 or getattr(runner, "pcp_world_size", 1) > 1:
        return "context parallelism (other slot and sequence-length formulas)"
    if runner.routed_experts_initialized:
        return "routed-experts capture"
    if runner.eplb_state is not None or getattr(runner.parallel_config, "enable_eplb", False):
        return "EPLB (step-counted rebalancing)"
    if kv_transfer or ec_transfer:
        return "a KV or encoder-cache connector"
    if getattr(runner.cache_config, "kv_sharing_fast_prefill", False):
        return "kv_sharing_fast_prefill"
    if runner.vllm_config.observability_config.cudagraph_metrics:
        return "CUDA graph metrics (observability) are on: they are collected by stock's step"
    tables = runner.input_batch.block_table.block_tables
    if not 1 <= len(tables) <= MAX_KV_GROUPS:
        return f"{len(tables)} KV-cache groups (the input kernel handles 1 or 2)"
    names = sorted({g.backend.get_name() for groups in runner.attn_groups for g in groups})
    if any(n not in STEADY_BACKENDS for n in names):
        return (f"attention backend(s) {', '.join(names)}: steady steps skip the attention metadata, which only "
                f"{', '.join(STEADY_BACKENDS)} builds without per-step device work")
    return None


def continuation_reason(so: Any, batch: Any, requests: dict, chain_req_ids: tuple | None) -> tuple[str | None, bool]:
    """(why ``so`` (vLLM's ``SchedulerOutput``) is not a steady continuation of the previous step,
    or None; whether a request got new KV blocks). Read before ``_update_states`` applies ``so``.
    ``batch``: the persistent ``InputBatch``; ``requests``: the runner's ``CachedRequestState``s;
    ``chain_req_ids``: the rows of the previous step if it was a graphed uniform decode whose rows
    all took the graph's tokens (None otherwise)."""
    if chain_req_ids is None:
        return "the previous step was not a graphed decode of this batch", False
    n = batch.num_reqs
    if n != len(chain_req_ids) or tuple(batch.req_ids) != chain_req_ids:
        return "the rows changed", False
    if so.scheduled_new_reqs or so.finished_req_ids or so.preempted_req_ids:
        return "requests arrived, finished or were preempted", False
    if so.total_num_scheduled_tokens != n or len(so.num_scheduled_tokens) != n:
        return "not one token for every row", False
    if so.scheduled_spec_decode_tokens or so.scheduled_encoder_inputs or so.num_spec_tokens_to_schedule:
        return "speculative or encoder inputs", False
    if so.new_block_ids_to_zero or so.kv_cache_block_copies or so.kv_connector_metadata is not None:
        return "KV blocks to zero or copy, or connector metadata", False
    if so.has_structured_output_requests or so.pending_structured_output_tokens:
        return "structured output", False
    # so.num_common_prefix_blocks is not checked: with prefix caching (vLLM's default) it is
    # non-zero for any lone request, but it only matters to backends that choose cascade
    # attention, and static_reason admits SM121 alone, whose builder never does (vLLM's base
    # use_cascade_attention), so stock's step replays the same FULL graph for it.
    cached = so.scheduled_cached_reqs
    if cached.resumed_req_ids or cached.all_token_ids or cached.new_token_ids or len(cached.req_ids) != n:
        return "requests resumed or rescheduled", False
    prev = batch.prev_req_id_to_index
    if prev is None or len(prev) != n:
        return "the previous step discarded a row's token", False
    index = batch.req_id_to_index
    new_blocks = False
    for i, rid in enumerate(cached.req_ids):
        row = index.get(rid)
        if row is None or prev.get(rid) != row or so.num_scheduled_tokens.get(rid) != 1:
            return "the rows changed", False
        state = requests[rid]
        computed = cached.num_computed_tokens[i]
        if computed != int(batch.num_computed_tokens_cpu[row]) + 1 or computed + 1 != state.num_tokens:
            return "a row is not one token further than last step (prefill chunk or rollback)", False
        if cached.num_output_tokens[i] != len(state.output_token_ids):
            return "the scheduler trimmed a row's outputs", False
        ids = cached.new_block_ids[i]
        if ids is not None and any(ids):
            new_blocks = True
    return None, new_blocks
