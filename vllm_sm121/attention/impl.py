"""SM121AttentionImpl: one layer's hyperparameters plus the calls into the Triton kernels.

Each layer keeps its own scale, sliding window, logits soft-cap and sinks; nothing is shared
or planned globally, so gpt-oss's windowed/full layers with sinks and an Eagle3 drafter layer
without them run through the same backend.
"""

from __future__ import annotations

import torch
from vllm.logger import init_logger
from vllm.v1.attention.backend import AttentionImpl, AttentionType

from vllm_sm121 import envs
from vllm_sm121.envs import env_int
from vllm_sm121.l2_plan import attention_prefetch
from vllm_sm121.kernels import paged_attention, write_kv_cache
from vllm_sm121.kernels.fp4_kv import Nvfp4Pages, calibrate_global_scales, default_global_scale, fp4_kv_write

from .metadata import SM121AttentionMetadata

_FP8_CACHE = ("fp8", "fp8_e4m3")
KV_IN_ATTN_ENV = "VLLM_SM121_KV_IN_ATTN"
logger = init_logger("vllm.sm121")


def _tp_amax():
    """Under tensor parallelism: a [2] amax -> its max over the TP group's ranks (vLLM's all-gather),
    so a rank holding half of a layer's KV heads calibrates its nvfp4 scales as the whole layer
    does at TP=1; None at TP=1 or with $VLLM_SM121_KV_SCALE_TP_MAX=0 (each rank's own heads)."""
    from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_gather
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    from vllm_sm121.config import kv_scale_tp_max

    if not model_parallel_is_initialized() or get_tensor_model_parallel_world_size() == 1 or not kv_scale_tp_max():
        return None
    return lambda amax: tensor_model_parallel_all_gather(amax.view(1, 2), dim=0).amax(dim=0)


def _real_scale_calibration_allowed() -> bool:
    """Whether this engine may set the nvfp4 scales again from the first real tokens
    ($VLLM_SM121_KV_SCALE_REAL, config.py): opted in, and no mixed (prefill) batch replays a FULL
    graph -- a graph holds no calibration, so a real prefill inside one would write the cache with
    the warm-up scales before any eager batch could reset them."""
    from vllm.config import CUDAGraphMode
    from vllm.config.vllm import get_current_vllm_config_or_none

    from vllm_sm121.config import kv_scale_real

    if not kv_scale_real():
        return False
    vllm_config = get_current_vllm_config_or_none()
    mode = None if vllm_config is None else getattr(vllm_config.compilation_config, "cudagraph_mode", None)
    return mode is None or mode.mixed_mode() != CUDAGraphMode.FULL


def _validate_sm121_options() -> None:
    """Check ``--additional-config '{"sm121": ...}'`` when a model builds SM121 layers (the vLLM
    config is current then): an unknown key, value or a value not implemented in this release is
    an error at startup, never ignored."""
    from vllm.config import get_current_vllm_config

    from vllm_sm121 import config

    try:
        vllm_config = get_current_vllm_config()
    except AssertionError:  # no vLLM config being built (kernel-level use, tests)
        return
    config.from_vllm_config(vllm_config)


class SM121AttentionImpl(AttentionImpl[SM121AttentionMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        **kwargs,
    ) -> None:
        if alibi_slopes is not None:
            raise ValueError("SM121 attention does not support ALiBi; use another --attention-backend")
        _validate_sm121_options()
        if attn_type != AttentionType.DECODER:
            raise ValueError(f"SM121 attention supports decoder self-attention only, got attn_type={attn_type}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window = sliding_window if sliding_window and sliding_window > 0 else None
        self.kv_cache_dtype = kv_cache_dtype
        self.logits_soft_cap = logits_soft_cap if logits_soft_cap else None
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sinks = sinks
        if sinks is not None and sinks.shape[0] != num_heads:
            raise ValueError(f"sinks has {sinks.shape[0]} entries; this layer has num_heads={num_heads}")
        self._sinks_f32: torch.Tensor | None = None
        # The kernels validate this layer's arguments on its first call only (host time per step).
        self._checked = False
        self._write_checked = False
        # nvfp4: this layer's K and V global scales (set from the first batch it writes, on the
        # device) and cached page views of vLLM's uint8 cache tensor.
        self._nvfp4 = kv_cache_dtype == "nvfp4"
        if self._nvfp4 and kv_sharing_target_layer_name is not None:
            # (each layer's nvfp4 global scales are its own: a sharing layer would read another's
            # cache with scales it never calibrated)
            raise ValueError(f"--kv-cache-dtype nvfp4: KV-cache sharing (this layer reads "
                             f"{kv_sharing_target_layer_name}'s cache) is not supported on the SM121 backend; "
                             "supported with it: auto, bfloat16, float16, fp8, fp8_e4m3")
        if self._nvfp4 and (head_size % 16 or head_size & (head_size - 1) or head_size > 256):
            raise ValueError(f"--kv-cache-dtype nvfp4: head_size={head_size} is not supported; "
                             "supported: 16, 32, 64, 128, 256")
        self._g: torch.Tensor | None = None
        self._g_done: torch.Tensor | None = None
        self._calibrating = self._nvfp4
        self._calib_log: list[tuple[int, int, int]] = []  # the batches ``_calibrate`` saw (see there)
        # Opt-in: the first batch writing real tokens sets the scales once more from them alone
        # (``_calibrate_real``); closed for good by that batch or by a qkv GEMV that writes the cache.
        self._real_scale_pending = self._nvfp4 and _real_scale_calibration_allowed()
        self._pages_src: torch.Tensor | None = None
        self._pages: tuple[Nvfp4Pages, Nvfp4Pages] | None = None
        # Opt-in (stop 43, interpreter- and AOT-tested, not timed): a decode step's nvfp4 KV write happens
        # inside the attention kernel (kernels.paged_attention kv_write): vLLM's update op hands the new
        # tokens over (``_kv_for_attn``) instead of launching the write kernel, one launch fewer per layer.
        self._kv_in_attn = self._nvfp4 and env_int(KV_IN_ATTN_ENV, 0) == 1
        self._kv_for_attn: tuple | None = None  # (key, value, slot mapping, the step's metadata)
        self._kv_write_checked = False
        fault = envs.VLLM_SM121_FAULT
        if fault:
            logger.warning("SM121 attention: VLLM_SM121_FAULT=%s set: results are deliberately WRONG (tests only)", fault)
            if fault == "drop_sinks":
                self.sinks = None
            elif fault == "no_window":
                self.sliding_window = None
        logger.info(
            "SM121 attention layer: %d q heads / %d kv heads, head_size %d, scale %.4g, window %s, "
            "soft-cap %s, sinks %s, kv-cache %s",
            num_heads, self.num_kv_heads, head_size, self.scale, self.sliding_window, self.logits_soft_cap,
            "yes" if self.sinks is not None else "no", kv_cache_dtype,
        )

    def process_weights_after_loading(self, act_dtype: torch.dtype):
        if self.sinks is not None:
            # Loaded after __init__; keep an fp32 copy so forward() launches nothing extra.
            self._sinks_f32 = self.sinks.detach().float().contiguous()

    def _kv(self, kv_cache: torch.Tensor):
        if self._nvfp4:
            return self._nvfp4_pages(kv_cache)
        if self.kv_cache_dtype in _FP8_CACHE:
            kv_cache = kv_cache.view(torch.float8_e4m3fn)
        return kv_cache[:, 0], kv_cache[:, 1]

    def _nvfp4_pages(self, kv_cache: torch.Tensor) -> tuple[Nvfp4Pages, Nvfp4Pages]:
        """K and V page views of the uint8 cache ``[num_blocks, 2, page_side_bytes]`` (cached)."""
        if kv_cache is not self._pages_src:  # vLLM binds one cache tensor per layer: built once
            if self._g is None:
                self._g = torch.full((2,), default_global_scale(), dtype=torch.float32, device=kv_cache.device)
                self._g_done = torch.zeros(2, dtype=torch.bool, device=kv_cache.device)
            if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 3 or kv_cache.shape[1] != 2:
                raise ValueError(f"nvfp4 KV cache must be uint8 [num_blocks, 2, bytes], got {kv_cache.dtype} "
                                 f"{tuple(kv_cache.shape)}")
            per_token = self.num_kv_heads * (self.head_size // 2 + self.head_size // 16)
            block_size, rem = divmod(kv_cache.shape[2], per_token)
            if rem:
                raise ValueError(f"nvfp4 KV page of {kv_cache.shape[2]} bytes is not a whole number of tokens "
                                 f"({per_token} bytes each)")
            self._pages = tuple(Nvfp4Pages.view(kv_cache[:, i], self.num_kv_heads, block_size, self.head_size,
                                                self._g[i:i + 1]) for i in (0, 1))
            self._pages_src = kv_cache
        return self._pages

    def _calibrate(self, key: torch.Tensor, value: torch.Tensor, cache_numel: int) -> None:
        """Set this layer's nvfp4 K/V global scales from the first non-empty batch it writes (under
        tensor parallelism from the max over all ranks' heads: TP=1's scales, see ``_tp_amax``).

        Device-only; outside CUDA-graph capture the Python flag stops calling it once the device
        says both are set (a single host sync per layer, in the first eager steps), so captured
        graphs and later steps carry no calibration work.
        """
        capturing = key.is_cuda and torch.cuda.is_current_stream_capturing()
        # Which batches took part, for diagnosis (host-known values, no sync): (tokens, capturing, the
        # cache's elements: 0 in vLLM's profile run, before the cache exists); a few entries at most.
        if len(self._calib_log) < 8:
            self._calib_log.append((int(key.shape[0]), int(capturing), int(cache_numel)))
        # (never a collective inside a captured graph: vLLM warms each FULL graph up eagerly first,
        # which calibrates; a graph captured before any calibration reduces over this rank's heads)
        calibrate_global_scales(key, value, self._g, self._g_done, reduce_amax=None if capturing else _tp_amax())
        if not capturing:
            self._calibrating = not bool(self._g_done.all())

    def _calibrate_real(self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
                        name: str = "?") -> None:
        """$VLLM_SM121_KV_SCALE_REAL: the first batch (outside graph capture) that writes real tokens
        (slot >= 0) sets this layer's scales from those tokens' amax (a padding or dummy row may hold
        anything), under tensor parallelism over all ranks' heads as ``_calibrate``. One shot: the
        cache holds no real token before this batch and is written with the final scales from it
        on. A side whose real amax is 0 or not finite keeps its warm-up scale. One host sync per
        layer and batch until then (dummy runs: every slot -1)."""
        real = slot_mapping >= 0
        if not bool(real.any()):
            return
        self._real_scale_pending = False
        before = self._g.clone()
        calibrate_global_scales(key, value, self._g, None, reduce_amax=_tp_amax(), rows=real)
        # (one more sync, once per layer; the log says the option took effect and whether it changed anything)
        now, was, n_real = self._g.tolist(), before.tolist(), int(real.sum())
        (logger.info if now != was else logger.debug)(
            "SM121 nvfp4 KV, %s: global scales (K, V) %s from the first %d real tokens ($VLLM_SM121_KV_SCALE_REAL; "
            "warm-up gave %s)", name, now, n_real, was)
        if len(self._calib_log) < 8:
            self._calib_log.append((n_real, 0, -2))  # (-2: the real-token calibration)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        if self.kv_sharing_target_layer_name is not None:
            return
        key_cache, value_cache = self._kv(kv_cache)
        n = min(key.shape[0], slot_mapping.shape[0])
        if self._nvfp4:
            if self._calibrating:
                self._calibrate(key[:n], value[:n], kv_cache.numel())
            if self._real_scale_pending and not (key.is_cuda and torch.cuda.is_current_stream_capturing()):
                self._calibrate_real(key[:n], value[:n], slot_mapping[:n], getattr(layer, "layer_name", "?"))
            md = self._decode_launch(layer, n) if self._kv_in_attn else None
            if md is not None:  # the attention kernel writes them (this step's forward, the same metadata)
                self._kv_for_attn = (key[:n], value[:n], slot_mapping[:n], md)
                return
            fp4_kv_write(key[:n], value[:n], key_cache, value_cache, slot_mapping[:n], check=not self._write_checked)
            self._write_checked = True
            return
        fp8 = self.kv_cache_dtype in _FP8_CACHE
        write_kv_cache(key[:n], value[:n], key_cache, value_cache, slot_mapping[:n],
                       k_scale=layer._k_scale if fp8 else None, v_scale=layer._v_scale if fp8 else None,
                       check=not self._write_checked)
        self._write_checked = True

    def _decode_launch(self, layer, n_kv: int) -> SM121AttentionMetadata | None:
        """This step's metadata (vLLM's forward context) if ``forward`` will run one attention launch of one
        query token per sequence over at most ``n_kv`` token rows: that launch can then write the new tokens
        itself (``_kv_in_attn``). None otherwise."""
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import get_forward_context, is_forward_context_available
        from vllm.model_executor.layers.attention.attention import get_attention_context

        if not is_forward_context_available():
            return None
        if (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
                and get_forward_context().cudagraph_runtime_mode != CUDAGraphMode.FULL):
            # a piecewise capture may hold this op in its graph while the attention op runs outside it
            # (Inductor graph partition, custom splitting ops): a handover would leave no write at replay
            return None
        md = get_attention_context(layer.layer_name)[0]  # (what the attention op will be handed)
        ok = (isinstance(md, SM121AttentionMetadata) and md.max_query_len == 1 and md.num_actual_tokens <= n_kv
              and not self._mixed_split(md))
        return md if ok else None

    def _mixed_split(self, md: SM121AttentionMetadata) -> bool:
        """Whether ``forward`` splits this batch into a decode launch and a launch for the rest."""
        dp = md.decode_part
        return dp is not None and dp.num_splits.get(self.sliding_window, 1) > 1

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("SM121 attention does not fuse output quantization")
        kv_write, self._kv_for_attn = self._kv_for_attn, None  # (the new tokens, when the update op left them)
        if kv_write is not None and kv_write[3] is not attn_metadata:
            # Never in vLLM's order of ops (each update op is followed by its layer's attention op in the same
            # step). A handover from another step is dropped, not written late: its slots may belong to
            # another request by now.
            logger.warning_once("SM121 attention: a KV write handed over by another step's update op was dropped "
                                "($VLLM_SM121_KV_IN_ATTN)")
            kv_write = None
        if attn_metadata is None:  # profiling run
            return output
        md: SM121AttentionMetadata = attn_metadata
        n = md.num_actual_tokens
        key_cache, value_cache = self._kv(kv_cache)
        if kv_write is not None:
            kv_write = kv_write[:3]
        sinks = self._sinks_f32 if self._sinks_f32 is not None else (
            self.sinks.float() if self.sinks is not None else None)
        fp8 = self.kv_cache_dtype in _FP8_CACHE
        q = query[:n].view(n, self.num_heads, self.head_size)
        out = output[:n].view(n, self.num_heads, self.head_size)
        # (the first call that hands the kernel a KV write is checked too, whenever it comes)
        check = not self._checked or (kv_write is not None and not self._kv_write_checked)
        common = dict(max_seq_len=md.max_seq_len, scale=self.scale, sliding_window=self.sliding_window,
                      softcap=self.logits_soft_cap, sinks=sinks, k_scale=layer._k_scale if fp8 else None,
                      v_scale=layer._v_scale if fp8 else None, check=check)
        # the weight of the GEMV after this kernel, prefetched into L2 by it (vllm_sm121/l2_plan.py)
        prefetch = attention_prefetch(layer)
        dp = md.decode_part
        if self._mixed_split(md):
            # mixed batch: the leading decode rows with split KV, then the rest in one launch
            d, r = dp.num_tokens, dp.num_reqs
            if kv_write is not None:  # (never: _decode_launch hands over single launches only)
                fp4_kv_write(*kv_write[:2], key_cache, value_cache, kv_write[2])
            splits, workspace = md.decode_splits_and_workspace(self.num_heads, self.head_size, self.sliding_window)
            paged_attention(q[:d], key_cache, value_cache, md.block_table[:r], md.query_start_loc[: r + 1],
                            md.seq_lens[:r], max_query_len=dp.max_query_len, out=out[:d], num_splits=splits,
                            workspace=workspace, prefetch=prefetch, **common)
            paged_attention(q[d:], key_cache, value_cache, md.block_table[r: md.seq_lens.shape[0]],
                            dp.prefill_query_start_loc, md.seq_lens[r:], max_query_len=md.max_query_len,
                            out=out[d:], num_splits=1, workspace=None, **common)
        else:
            num_splits, workspace = md.splits_and_workspace(self.num_heads, self.head_size, self.sliding_window)
            paged_attention(q, key_cache, value_cache, md.block_table, md.query_start_loc, md.seq_lens,
                            max_query_len=md.max_query_len, out=out, num_splits=num_splits, workspace=workspace,
                            prefetch=prefetch, kv_write=kv_write, **common)
        self._checked = True
        self._kv_write_checked = self._kv_write_checked or kv_write is not None
        return output
