"""Whole-model CUDA graph mode (issue 7).

Stage A is wired (``--additional-config '{"sm121": {"cudagraph": "whole_model"}}'``):
``tail`` (the in-graph lm_head + greedy argmax, eligibility, installation), ``runner``
(``WholeModelRunner``), ``worker`` (``WholeModelWorker``). ``sampler`` is the capturable
non-greedy sampler building block, not wired yet. Design and later stages:
``docs/design-whole-model-graph.md``.
"""
