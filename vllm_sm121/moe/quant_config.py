"""The quantization config vLLM finds under ``sm121_mxfp4`` (see ``vllm_sm121.moe`` for the flow).

Import-light on purpose: the general plugin registers it in every process (API server
included), and vLLM's own MXFP4 config imports the fused-MoE stack and Triton. The class-level
API vLLM calls before building a config (``override_quantization_method``, names, capability)
lives here; ``from_config`` returns the real config, ``method.Sm121GptOssMxfp4Config``.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from . import QUANT_NAME, is_gpt_oss_mxfp4, resolve_moe


def _current_vllm_config():
    from vllm.config import get_current_vllm_config_or_none

    return get_current_vllm_config_or_none()


class Sm121Mxfp4Config(QuantizationConfig):
    """Registered front of the sm121 gpt-oss MXFP4 config; never instantiated itself."""

    @classmethod
    def get_name(cls) -> str:
        return QUANT_NAME

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80  # as vLLM's Mxfp4Config; our kernels are Triton (measured on sm_90, built for sm_121a)

    @classmethod
    def get_config_filenames(cls) -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict) -> QuantizationConfig:
        from .method import Sm121GptOssMxfp4Config

        return Sm121GptOssMxfp4Config.from_config(config)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None) -> str | None:
        """Claim gpt-oss MXFP4 checkpoints ("mxfp4" or "gpt_oss_mxfp4").

        With a current vLLM config, only when ``resolve_moe`` says "mxfp8". Without one (vLLM's
        engine path: this runs from ``ModelConfig.__post_init__``, before the VllmConfig exists),
        provisionally: ``get_quant_method`` decides with the full config and hands the layers to
        upstream's method when the option resolves to "upstream".
        """
        from . import READY

        if not READY or not is_gpt_oss_mxfp4(hf_quant_cfg, hf_config):
            return None
        if user_quant not in (None, QUANT_NAME, "mxfp4", "gpt_oss_mxfp4"):
            return None  # the user asked for another method
        vllm_config = _current_vllm_config()
        if vllm_config is not None:
            return QUANT_NAME if resolve_moe(vllm_config, hf_config, hf_quant_cfg) == "mxfp8" else None
        return QUANT_NAME

    def get_quant_method(self, layer, prefix):  # pragma: no cover - never instantiated
        raise NotImplementedError("Sm121Mxfp4Config.from_config builds Sm121GptOssMxfp4Config")
