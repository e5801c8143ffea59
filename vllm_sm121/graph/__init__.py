"""Whole-model CUDA graph mode (issue 7) — building blocks only.

Nothing here is registered or reachable from the plugin's config yet: the
``{"sm121": {"cudagraph": "whole_model"}}`` option is still refused by
``vllm_sm121.config``. See :mod:`vllm_sm121.graph.sampler` for what exists.
"""
