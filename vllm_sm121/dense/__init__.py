"""FP8 dense weights for gpt-oss's qkv, o and lm_head (design.md: ``--additional-config '{"sm121": {"dense_weights": "fp8"}}'``).

Architecture
    ``method.Sm121DenseFp8LinearMethod`` (qkv_proj, o_proj) and ``method.Sm121DenseFp8LMHeadMethod``
    (lm_head) create and load the bf16 weights exactly as upstream (real checkpoint and
    ``--load-format dummy`` unchanged), convert them to e4m3 + one fp32 scale per output channel
    in ``process_weights_after_loading`` (the bf16 copy is freed) and run
    ``kernels.dense.dense_fp8_linear`` through the ``sm121::dense_fp8_linear`` custom op.
    ``method.dense_quant_method_for(layer, prefix, sm121_cfg)`` decides which layers get them.

Wiring (``hook.py``)
    gpt-oss builds qkv_proj / o_proj with the model's quant config (stock MXFP4 checkpoint:
    ``UnquantizedLinearMethod``) and ``ParallelLMHead(...)`` with no quant config
    (``UnquantizedEmbeddingMethod``), so no public route reaches all three. The plugin wraps
    ``GptOssForCausalLM.__init__`` (compat shim ``compat.register_gpt_oss_dense_weights``,
    installed by ``register()`` in every process when gpt_oss.py is imported): after the
    upstream constructor, ``hook.apply_dense_weights`` swaps the three layers' ``quant_method``
    for ours when the option is "fp8" (same bf16 parameters, so loading is untouched); vLLM's
    ``model_loader.utils.process_weights_after_loading`` then converts them and
    ``LogitsProcessor._apply_head`` calls the head's ``apply``. Configurations it cannot serve
    (tied embeddings, ``head_dtype`` other than bf16, LoRA, TP/PP > 1, a drafter head of the
    target's shape, already-quantized layers) are refused there with a ``ValueError``.
    Upstream proposal ``patches/vllm/0005-gpt-oss-lm-head-quant-config.patch`` (gpt-oss's head
    built with the model's quant config) would let a quant config's ``get_quant_method`` pick
    all three through ``dense_quant_method_for`` instead.

Measured (H100, vLLM 0.26.0, tree 86635e0 + this change)
    End to end (``tests/test_dense_wiring.py``, random real-format gpt-oss-tiny, SM121 attention):
    the workers convert 9 layers; teacher-forced prompt logprobs vs bf16 |delta| mean 0.242 /
    p99 0.896 eager, 0.244 / 0.917 under CUDA graphs -- the same as bf16 with the weights replaced
    by their FP8 values (0.242 / 0.889: the format's cost in a random MoE model), and 0.070 /
    0.421 (eager), 0.081 / 0.446 (graphs) from that fake-quant run (1.2-1.6x the FLASH_ATTN vs
    TRITON_ATTN spread ``tests/test_e2e_gpu.py`` measures on the same model, other prompts).
    Speed (``benchmarks/dense.py``, gpt-oss-120b shapes, weights rotated past L2): at M = 1..16
    qkv 19.5 us and o 17.8 us vs cuBLAS bf16 13.7 / 13.9 us (0.70-0.82x: the kernel reaches ~25%
    of copy bandwidth), lm_head 336-346 us vs 410-417 us (1.2x); vLLM's cutlass W8A8 (11 / 10.5 /
    194 us) and FP8 Marlin (13 / 11.5 / 235 us) are faster on all three. So on an H100 the
    option is a net slowdown per decode step until the kernel is tuned (a BLOCK_N = 64 /
    BLOCK_K = 128 sweep point gave lm_head 222 us); it has not run on a GB10.

upstream files: ``vllm/model_executor/layers/linear.py`` (``LinearMethodBase``,
``UnquantizedLinearMethod``), ``vllm/model_executor/layers/vocab_parallel_embedding.py``,
``vllm/model_executor/layers/logits_processor.py``, ``vllm/model_executor/models/gpt_oss.py``.
"""
