"""Metadata builder of the SM121 backend: no global plan, persistent buffers only.

Every hyperparameter that may differ between layers (scale, window, soft-cap, sinks) lives on
the layer's impl, so one builder serves a KV group whatever its layers are (gpt-oss layers and
an Eagle3 drafter layer included). The builder only wraps vLLM's persistent metadata tensors and
picks the split-KV count; its split workspace is allocated once, so full CUDA graphs capture
every batch kind (``AttentionCGSupport.ALWAYS``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionCGSupport, AttentionMetadataBuilder, CommonAttentionMetadata

from vllm_sm121.kernels.paged_attention import MAX_SPLITS, SPLIT_MAX_QUERY_ROWS, SplitWorkspace, choose_num_splits

# Partial results the split-KV workspace holds: (tokens x splits) rows of [Hq, head_pad] fp32.
# 2048 rows x 64 heads x 64 dims x 4 B = 32 MiB for gpt-oss; batch 32 decode needs 32 x 8 = 256.
WORKSPACE_TOKEN_SPLITS = 2048
MIXED_SPLIT_ENV = "VLLM_SM121_MIXED_SPLIT"


def mixed_split_enabled() -> bool:
    """$VLLM_SM121_MIXED_SPLIT: "1" (default) or "0"; anything else is refused by name."""
    value = os.environ.get(MIXED_SPLIT_ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{MIXED_SPLIT_ENV}={value!r} is not supported; supported: 1 (default: a mixed batch's "
                         "decode rows get their own split-KV launch) or 0 (one launch)")
    return value == "1"


# Mixed batches given a decode launch of their own in this process (tests read it through
# LLM.collective_rpc: the path must have run).
DECODE_PARTS_BUILT = 0


@dataclasses.dataclass
class DecodePart:
    """The leading decode rows of a mixed batch (vLLM orders decodes first, as the builder's
    ``reorder_batch_threshold`` asks), run in their own launch with split KV; without it they would
    ride in the prefill launch with one program per (sequence, KV head) over their whole context,
    the step's long pole at long context."""

    num_reqs: int
    num_tokens: int
    max_query_len: int
    num_splits: dict  # sliding window -> split count for the decode rows
    prefill_query_start_loc: torch.Tensor  # query_start_loc[num_reqs:] - num_tokens (device)


@dataclasses.dataclass
class SM121AttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_splits: dict  # sliding window (None: full attention) -> split-KV count for this batch
    split_acc: torch.Tensor  # persistent flat split-KV buffers
    split_ml: torch.Tensor
    split_cnt: torch.Tensor | None = None  # int32 arrival counters (the fused split merge), zero between launches
    decode_part: DecodePart | None = None  # mixed batches: the decode rows' own launch

    def splits_and_workspace(self, num_q_heads: int, head_size: int, sliding_window: int | None):
        """One layer's split count (chosen by the builder for its window) and workspace views."""
        return self._workspace(self.num_splits.get(sliding_window, 1), self.num_actual_tokens, num_q_heads, head_size)

    def decode_splits_and_workspace(self, num_q_heads: int, head_size: int, sliding_window: int | None):
        """The decode part's split count for this window and workspace (``decode_part`` set)."""
        dp = self.decode_part
        return self._workspace(dp.num_splits.get(sliding_window, 1), dp.num_tokens, num_q_heads, head_size)

    def _workspace(self, splits: int, num_tokens: int, num_q_heads: int, head_size: int):
        if splits == 1:
            return 1, None
        ws = SplitWorkspace.view_of(self.split_acc, self.split_ml, num_tokens, num_q_heads, splits, head_size,
                                    self.split_cnt)
        return (splits, ws) if ws is not None else (1, None)


class SM121AttentionMetadataBuilder(AttentionMetadataBuilder[SM121AttentionMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, layer_names)
        # Layers of one group may differ in window (e.g. an Eagle3 drafter layer next to
        # gpt-oss's); each window gets its own split count, chosen here once per batch.
        self.windows = sorted({getattr(getattr(l, "impl", None), "sliding_window", None) for l in layers.values()},
                              key=lambda w: -1 if w is None else w) or [None]
        # Sized from the layers themselves (a drafter may differ from the target model config).
        self.num_q_heads = max((getattr(l, "num_heads", 0) for l in layers.values()), default=0) or (
            vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config)
        )
        self.num_kv_heads = kv_cache_spec.num_kv_heads
        # The split count is chosen from the KV heads of a rank; in the TP-invariant mode (one rank
        # computing as two, $VLLM_SM121_TP_INVARIANT) from a TP=2 rank's half, so the split
        # attention's summation order is TP=2's too.
        self.split_kv_heads = self.num_kv_heads
        from vllm_sm121.config import traced_choices

        if (traced_choices(vllm_config).get("tp_invariant", "")
                and getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) == 1 and self.num_kv_heads % 2 == 0):
            self.split_kv_heads = self.num_kv_heads // 2
        self.head_size = kv_cache_spec.head_size
        self.head_pad = max(16, 1 << (self.head_size - 1).bit_length())
        self.max_model_len = vllm_config.model_config.max_model_len
        # Queries of up to this many tokens may split their KV (choose_num_splits); vLLM puts such
        # requests first in a batch when a builder sets reorder_batch_threshold.
        self.decode_query_max = max(1, SPLIT_MAX_QUERY_ROWS // max(1, self.num_q_heads // self.num_kv_heads))
        # $VLLM_SM121_MIXED_SPLIT=0 keeps a mixed batch in one launch, in vLLM's own row order (A/B runs, tests).
        self.mixed_split = mixed_split_enabled()
        self.reorder_batch_threshold = self.decode_query_max if self.mixed_split else None
        self.sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        rows = WORKSPACE_TOKEN_SPLITS * self.num_q_heads
        self._acc = torch.empty(rows * self.head_pad, dtype=torch.float32, device=device)
        self._ml = torch.empty(rows * 2, dtype=torch.float32, device=device)
        self._cnt = torch.zeros(rows, dtype=torch.int32, device=device)  # the fused merge's arrival counters

    def _num_splits(self, num_tokens, num_reqs, max_query_len, max_seq_len) -> dict:
        out = {}
        for window in self.windows:
            splits = choose_num_splits(
                num_seqs=num_reqs, num_kv_heads=self.split_kv_heads, max_query_len=max_query_len,
                max_seq_len=max_seq_len, num_q_per_kv=max(1, self.num_q_heads // self.num_kv_heads),
                sm_count=self.sm_count, sliding_window=window,
            )
            while splits > 1 and num_tokens * splits > WORKSPACE_TOKEN_SPLITS:
                splits //= 2
            out[window] = splits
        return out

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False):
        return self._build(common_attn_metadata, common_attn_metadata.max_seq_len)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata):
        # Graphs are replayed at any context length: pick splits for long contexts, and run the
        # capture's warm-up on 1-token contexts (fast), as vLLM's Triton backend does.
        md = self._build(common_attn_metadata, self.max_model_len, capture=True)
        md.seq_lens.fill_(1)
        return md

    def _decode_part(self, cm: CommonAttentionMetadata) -> DecodePart | None:
        """Mixed batches: the leading requests of <= decode_query_max tokens, when at least one
        window would split their KV (long contexts)."""
        if not self.mixed_split or cm.max_query_len <= self.decode_query_max or cm.num_reqs < 2:
            return None
        qsl = cm.query_start_loc_cpu[: cm.num_reqs + 1].tolist()
        nd = 0
        while nd < cm.num_reqs and qsl[nd + 1] - qsl[nd] <= self.decode_query_max:
            nd += 1
        if nd == 0 or nd == cm.num_reqs:
            return None
        qmax = max(qsl[i + 1] - qsl[i] for i in range(nd))
        ub = cm.seq_lens_cpu_upper_bound  # the decode rows' own longest context where vLLM gives it
        seq_max = min(cm.max_seq_len, int(ub[:nd].max())) if ub is not None and ub.numel() >= nd else cm.max_seq_len
        splits = self._num_splits(qsl[nd], nd, qmax, seq_max)
        if max(splits.values()) == 1:
            return None
        global DECODE_PARTS_BUILT
        DECODE_PARTS_BUILT += 1
        return DecodePart(num_reqs=nd, num_tokens=qsl[nd], max_query_len=qmax, num_splits=splits,
                          prefill_query_start_loc=cm.query_start_loc[nd: cm.num_reqs + 1] - qsl[nd])

    def _build(self, cm: CommonAttentionMetadata, split_seq_len: int, capture: bool = False) -> SM121AttentionMetadata:
        num_splits = self._num_splits(cm.num_actual_tokens, cm.num_reqs, cm.max_query_len, split_seq_len)
        assert max(num_splits.values()) <= MAX_SPLITS
        return SM121AttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len,
            query_start_loc=cm.query_start_loc,
            seq_lens=cm.seq_lens,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            num_splits=num_splits,
            split_acc=self._acc,
            split_ml=self._ml,
            split_cnt=self._cnt,
            # a captured graph keeps one launch structure for every replay: no decode part there
            decode_part=None if capture else self._decode_part(cm),
        )
