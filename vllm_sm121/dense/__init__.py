"""FP8 dense weights for gpt-oss's qkv, o and lm_head (design.md: ``--additional-config '{"sm121": {"dense_weights": "fp8"}}'``).

Architecture
    ``method.Sm121DenseFp8LinearMethod`` (qkv_proj, o_proj) and ``method.Sm121DenseFp8LMHeadMethod``
    (lm_head) create and load the bf16 weights exactly as upstream (real checkpoint and
    ``--load-format dummy`` unchanged), convert them to e4m3 + one fp32 scale per output channel
    in ``process_weights_after_loading`` (the bf16 copy is freed) and run
    ``kernels.dense.dense_fp8_linear`` through the ``sm121::dense_fp8_linear`` custom op.
    ``method.dense_quant_method_for(layer, prefix, sm121_cfg)`` decides which layers get them.

Where it would be hooked (not wired yet: the option is refused until it runs on a GPU)
    qkv_proj / o_proj: gpt-oss builds them with the model's quant config (``vllm_config.quant_config``,
    for the MXFP4 checkpoint ``moe.method.Sm121GptOssMxfp4Config``); its ``get_quant_method``
    would return ``dense_quant_method_for(layer, prefix, cfg)`` for ``LinearBase`` layers before
    deferring to upstream. lm_head: ``GptOssForCausalLM`` builds ``ParallelLMHead(...)`` with
    no ``quant_config``, so it always gets ``UnquantizedEmbeddingMethod``; the plugin would swap
    ``model.lm_head.quant_method`` for ``Sm121DenseFp8LMHeadMethod`` after construction and
    before loading (same bf16 parameter, so loading is untouched; vLLM's
    ``model_loader.utils.process_weights_after_loading`` then converts it, and
    ``LogitsProcessor._apply_head`` calls its ``apply``) -- e.g. in a compat-registered
    ``GptOssForCausalLM.__init__`` wrapper like the MoE block hook. Not with tied embeddings
    (gpt-oss does not tie them) or a ``head_dtype`` other than bf16 (``_apply_head`` refuses
    quantized heads then).

upstream files: ``vllm/model_executor/layers/linear.py`` (``LinearMethodBase``,
``UnquantizedLinearMethod``), ``vllm/model_executor/layers/vocab_parallel_embedding.py``,
``vllm/model_executor/layers/logits_processor.py``, ``vllm/model_executor/models/gpt_oss.py``.
"""
