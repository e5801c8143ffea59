"""Whole-model graph mode, stage A (vllm_sm121/graph/{tail,runner,worker}.py), on CPU: the
option, its installation and refusals, which batches the tail covers, which batches may take
its tokens, the tail's own arithmetic and the runner's per-step hand-over. GPU behaviour (graph
capture, tokens equal to the mode off): tests/test_whole_model_gpu.py."""

from __future__ import annotations

import types

import pytest
import torch

from vllm_sm121 import config as sm121_config
from vllm_sm121.graph import tail as T

ON = {"sm121": {"cudagraph": "whole_model"}}


def _vllm_config(*, mode="FULL_AND_PIECEWISE", spec=None, tp=1, pp=1, dp=1, worker="vllm.v1.worker.gpu_worker.Worker",
                 additional=ON, v2=False):
    from vllm.config import CUDAGraphMode

    return types.SimpleNamespace(
        additional_config=additional, use_v2_model_runner=v2,
        compilation_config=types.SimpleNamespace(cudagraph_mode=getattr(CUDAGraphMode, mode)),
        speculative_config=spec,
        parallel_config=types.SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                              data_parallel_size=dp, use_ubatching=False, worker_cls=worker))


def test_option_is_implemented():
    assert sm121_config.parse(ON).cudagraph == "whole_model"
    assert "whole_model" in sm121_config.implemented("cudagraph")
    with pytest.raises(ValueError, match="cudagraph"):
        sm121_config.parse({"sm121": {"cudagraph": "whole-model"}})


def test_install_worker_sets_the_worker_only_when_asked():
    cfg = _vllm_config()
    assert T.install_worker(cfg) is True
    assert cfg.parallel_config.worker_cls == T.WORKER
    assert T.install_worker(cfg) is True  # idempotent (the hook may run twice)
    off = _vllm_config(additional={"sm121": {"dense_weights": "fp8"}})
    assert T.install_worker(off) is False
    assert off.parallel_config.worker_cls == T.STOCK_WORKER
    assert T.install_worker(_vllm_config(additional=None)) is False
    decode_only = _vllm_config(mode="FULL_DECODE_ONLY")
    assert T.install_worker(decode_only) is True and decode_only.parallel_config.worker_cls == T.WORKER


@pytest.mark.parametrize("kw, match", [
    (dict(mode="NONE"), "FULL decode graphs.*enforce-eager"),
    (dict(mode="PIECEWISE"), "FULL decode graphs"),
    (dict(mode="FULL"), "FULL replays decode batches as mixed graphs"),  # no uniform-decode keys: no tail
    (dict(v2=True), "VLLM_USE_V2_MODEL_RUNNER=0"),
    (dict(spec=object()), "stage D"),
    (dict(pp=2), "pipeline 2"),
    (dict(dp=2), "data 2"),
    (dict(worker="my.Worker"), "--worker-cls 'my.Worker'"),
])
def test_install_worker_refuses_with_the_option_named(kw, match):
    with pytest.raises(ValueError, match=match) as e:
        T.install_worker(_vllm_config(**kw))
    assert "cudagraph" in str(e.value) and "whole_model" in str(e.value)


def test_tensor_parallel_needs_logits_on_every_rank(monkeypatch):
    """TP (and EP) run the tail on every rank: allowed where vLLM all-gathers the logits (CUDA),
    refused by name where only rank 0 would receive them."""
    monkeypatch.setattr(T, "_logits_on_every_rank", lambda: True)
    cfg = _vllm_config(tp=2)
    assert T.install_worker(cfg) is True and cfg.parallel_config.worker_cls == T.WORKER
    monkeypatch.setattr(T, "_logits_on_every_rank", lambda: False)
    with pytest.raises(ValueError, match="tensor parallelism \\(2\\).*use_all_gather"):
        T.install_worker(_vllm_config(tp=2))
    assert T.install_worker(_vllm_config(tp=1)) is True  # TP=1 does not ask


def test_platform_shim_wraps_check_and_update_config_once():
    from vllm_sm121 import compat

    class Base:
        @classmethod
        def check_and_update_config(cls, vllm_config):
            if vllm_config.parallel_config.worker_cls == "auto":
                vllm_config.parallel_config.worker_cls = T.STOCK_WORKER

    module = types.SimpleNamespace(CudaPlatformBase=Base)
    compat._patch_cuda_platform_config(module)
    compat._patch_cuda_platform_config(module)  # second import hook: no double wrap
    assert Base.__dict__["check_and_update_config"].__func__.__wrapped__.__name__ == "check_and_update_config"
    cfg = _vllm_config(worker="auto")
    Base.check_and_update_config(cfg)
    assert cfg.parallel_config.worker_cls == T.WORKER
    stock = _vllm_config(worker="auto", additional=None)
    Base.check_and_update_config(stock)
    assert stock.parallel_config.worker_cls == T.STOCK_WORKER
    with pytest.raises(ValueError, match="FULL decode graphs"):
        Base.check_and_update_config(_vllm_config(worker="auto", mode="NONE"))


def test_shims_are_registered_for_the_real_platform_module():
    from vllm_sm121 import compat

    names = {s.patch for s in compat.SHIMS}
    assert {"0006-worker-model-runner-cls.patch", "0007-plugin-config-hook.patch"} <= names


def _ctx(mode="FULL", tokens=4, reqs=4, uniform=True, lora=False):
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    return types.SimpleNamespace(cudagraph_runtime_mode=getattr(CUDAGraphMode, mode),
                                 batch_descriptor=BatchDescriptor(tokens, reqs, uniform, has_lora=lora))


@pytest.mark.parametrize("ctx, want", [
    (dict(), True),
    (dict(tokens=32, reqs=32), True),
    (dict(tokens=64, reqs=64), False),  # above max_rows
    (dict(mode="PIECEWISE"), False),
    (dict(mode="NONE"), False),
    (dict(uniform=False), False),
    (dict(tokens=8, reqs=2), False),  # spec-verify: 1+3 tokens per request
    (dict(reqs=None), False),
    (dict(lora=True), False),
])
def test_covers_only_full_uniform_single_token_decode(ctx, want):
    assert T.covers(_ctx(**ctx), max_rows=32) is want
    assert T.covers(types.SimpleNamespace(cudagraph_runtime_mode=None, batch_descriptor=None), 32) is False


def _metadata(**kw):
    base = dict(all_greedy=True, max_num_logprobs=None, logprob_token_ids=None, no_penalties=True,
                allowed_token_ids_mask=None, bad_words_token_ids={})
    return types.SimpleNamespace(**{**base, **kw})


def _params(**kw):
    from vllm import SamplingParams

    return SamplingParams(**{"temperature": 0.0, **kw})


@pytest.mark.parametrize("meta, params, flags, reason", [
    (dict(), [{}], {}, None),
    (dict(), [{}, {"max_tokens": 3}], {}, None),
    (dict(all_greedy=False), [{}], {}, "temperature > 0"),
    (dict(max_num_logprobs=0), [{}], {}, "logprobs"),
    (dict(logprob_token_ids={0: [1]}), [{}], {}, "logprobs"),
    (dict(no_penalties=False), [{}], {}, "penalties"),
    (dict(allowed_token_ids_mask=torch.zeros(1)), [{}], {}, "allowed_token_ids"),
    (dict(bad_words_token_ids={0: [[1]]}), [{}], {}, "bad_words"),
    (dict(), [{}, {"min_tokens": 2}], {}, "min_tokens"),
    (dict(), [{"logit_bias": {3: 1.0}}], {}, "logit_bias"),
    (dict(), [{}], {"custom_logits_processors": True}, "custom logits processors"),
    (dict(), [{}], {"nans_in_logits": True}, "VLLM_COMPUTE_NANS_IN_LOGITS"),
    (dict(), [{}], {"thinking_budget": True}, "thinking_token_budget"),
    (dict(), [], {}, "empty batch"),
    # in-graph temperature sampling ($VLLM_SM121_GRAPH_SAMPLE=1): unseeded temperature-only rows are taken
    (dict(all_greedy=False, generators={}, top_k=None, top_p=None), [{"temperature": 0.8}], {"graph_samples": True},
     None),
    (dict(all_greedy=False, generators={0: object()}, top_k=None, top_p=None), [{"temperature": 0.8, "seed": 3}],
     {"graph_samples": True}, "seeded"),
    (dict(all_greedy=False, generators={}, top_k=torch.ones(1), top_p=None), [{"temperature": 0.8, "top_k": 5}],
     {"graph_samples": True}, "top-k / top-p"),
    (dict(all_greedy=False, generators={}, top_k=None, top_p=torch.ones(1)), [{"temperature": 0.8, "top_p": 0.5}],
     {"graph_samples": True}, "top-k / top-p"),
    (dict(all_greedy=False, generators={}, top_k=torch.ones(1), top_p=torch.ones(1)),
     [{"temperature": 0.8, "top_k": 5, "top_p": 0.5}], {"graph_samples": 2}, None),
    (dict(all_greedy=False, generators={0: object()}, top_k=torch.ones(1), top_p=None),
     [{"temperature": 0.8, "top_k": 5, "seed": 1}], {"graph_samples": 2}, "seeded"),
    (dict(all_greedy=False, generators={}, top_k=None, top_p=None), [{"temperature": 0.8, "min_p": 0.1}],
     {"graph_samples": True}, "min_p"),
    (dict(all_greedy=False, generators={}, top_k=None, top_p=None, max_num_logprobs=1), [{"temperature": 0.8}],
     {"graph_samples": True}, "logprobs"),
])
def test_ineligible_reason(meta, params, flags, reason):
    got = T.ineligible_reason(_metadata(**meta), [_params(**p) for p in params], **flags)
    if reason is None:
        assert got is None
    else:
        assert got is not None and reason in got


def test_structured_output_falls_back():
    from vllm.sampling_params import StructuredOutputsParams

    p = _params(structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    assert "structured output" in T.ineligible_reason(_metadata(), [p])


class _Model(torch.nn.Module):
    """hidden = embedding rows; logits = hidden @ W^T (bf16, as an lm_head)."""

    def __init__(self, vocab=50, hidden=16):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.randn(vocab, hidden, generator=g).to(torch.bfloat16)
        self.head = torch.randn(vocab, hidden, generator=g).to(torch.bfloat16)
        self.marker = "the model's attribute"
        self.logits_calls = 0

    def forward(self, input_ids, positions=None):
        return self.emb[input_ids]

    def compute_logits(self, hidden):
        self.logits_calls += 1
        return hidden @ self.head.T


def test_decode_tail_runs_on_covered_batches_only():
    model = _Model()
    state = {"ctx": _ctx(tokens=4, reqs=4)}
    tail = T.DecodeTail(model, max_rows=8, device="cpu", get_context=lambda: state["ctx"])
    ids = torch.tensor([3, 7, 11, 19])
    out = tail(ids)
    assert torch.equal(out, model.emb[ids])
    want = model.compute_logits(model.emb[ids]).float().argmax(-1)
    assert tail.tokens.dtype == torch.int32 and torch.equal(tail.tokens[:4], want.int()) and tail.ran == 1
    assert tail.sampled(3).dtype == torch.int32 and torch.equal(tail.sampled(3)[:, 0], want[:3].int())
    assert tail.sampled(3).shape == (3, 1)
    before = tail.tokens.clone()
    for ctx in (_ctx(mode="PIECEWISE"), _ctx(tokens=8, reqs=2), _ctx(mode="NONE")):
        state["ctx"] = ctx
        tail(torch.tensor([1, 2, 3, 4]))
        assert torch.equal(tail.tokens, before) and tail.ran == 1
    assert tail.marker == "the model's attribute"  # attributes fall through to the model


def test_decode_tail_argmax_ties_take_the_lowest_index_like_stock():
    model = _Model()
    model.head = torch.zeros_like(model.head)  # every logit 0: a tie over the whole vocabulary
    tail = T.DecodeTail(model, max_rows=4, device="cpu", get_context=lambda: _ctx(tokens=2, reqs=2))
    tail(torch.tensor([1, 2]))
    assert tail.tokens[:2].tolist() == [0, 0]


def test_decode_tail_samples_temperature_rows_in_the_graph():
    """$VLLM_SM121_GRAPH_SAMPLE=1: the tail runs kernels/decode_sample.py (interpreter here): greedy
    rows keep stock's argmax, temperature rows get the reference's draw, the step advances."""
    from vllm_sm121.kernels import decode_sample as ds

    model = _Model(vocab=300)
    tail = T.DecodeTail(model, max_rows=4, device="cpu", get_context=lambda: _ctx(tokens=3, reqs=3), samples=1)
    tail.temperature[:3] = torch.tensor([0.0, 1.0, 0.5])
    tail.seeds[:3] = torch.tensor([0, 11, 12])
    ids = torch.tensor([3, 7, 11])
    for step in range(3):
        tail(ids)
        logits = model.compute_logits(model.emb[ids]).float()
        scores = ds.decode_sample_scores_torch(logits, tail.temperature, tail.seeds, step)
        got = tail.tokens[:3].long()
        assert got[0] == logits[0].argmax()
        assert torch.all(scores.max(-1).values - scores.gather(1, got[:, None])[:, 0] <= 1e-5)
        assert int(tail.step) == step + 1


def test_claimed_step_skips_the_lm_head_once():
    model = _Model()
    tail = T.DecodeTail(model, max_rows=8, device="cpu", get_context=lambda: _ctx(mode="NONE"))
    h = torch.randn(3, 16).to(torch.bfloat16)
    calls = model.logits_calls
    tail.claim()
    stub = tail.compute_logits(h)
    assert stub.shape == (3, 0) and model.logits_calls == calls
    real = tail.compute_logits(h)  # the claim is consumed: the next call is the model's
    assert real.shape == (3, 50) and model.logits_calls == calls + 1


def test_decode_tail_outside_a_forward_context_is_the_model():
    model = _Model()
    tail = T.DecodeTail(model, max_rows=4, device="cpu")  # vLLM's forward context: none set here
    assert torch.equal(tail(torch.tensor([1, 2])), model.emb[torch.tensor([1, 2])]) and tail.ran == 0


def test_step_wrapper_unwraps_to_the_model():
    from vllm_sm121.graph.runner import StepGraphWrapper

    model = _Model()
    tail = T.DecodeTail(model, max_rows=4, device="cpu")
    assert StepGraphWrapper.unwrap(types.SimpleNamespace(runnable=tail)) is model


def _runner(monkeypatch, reason=None, ctx=None):
    from vllm_sm121.graph import runner as R

    r = object.__new__(R.WholeModelRunner)
    model = _Model()
    r._sm121_tail = T.DecodeTail(model, max_rows=8, device="cpu")
    r._sm121_tail.tokens[:4] = torch.tensor([5, 6, 7, 8])
    r._sm121_fallbacks, r._sm121_taken, r._sm121_take = {}, 0, False
    r.input_batch = types.SimpleNamespace(num_reqs=3, req_ids=["a", "b", "c"], update_async_output_token_ids=lambda: None)
    monkeypatch.setattr(R.WholeModelRunner, "_sm121_reason", lambda self: reason)
    monkeypatch.setattr(R, "current_context", lambda: ctx or _ctx(tokens=4, reqs=4))
    seen = {}
    monkeypatch.setattr(R.GPUModelRunner, "_model_forward", lambda self, *a, **k: seen.setdefault("forward", True))
    monkeypatch.setattr(R.GPUModelRunner, "_sample", lambda self, logits, spec: ("stock", logits))
    return r, seen


def test_runner_takes_the_graph_tokens_for_an_eligible_covered_step(monkeypatch):
    r, seen = _runner(monkeypatch)
    r._model_forward(input_ids=None)
    assert seen["forward"] and r._sm121_take and r._sm121_tail.claimed
    assert r._sm121_tail.compute_logits(torch.zeros(3, 16)).shape == (3, 0)
    out = r._sample(None, None)
    assert out.sampled_token_ids.tolist() == [[5], [6], [7]] and out.logprobs_tensors is None
    assert r.sm121_graph_stats()["taken"] == 1
    assert r._sample("L", None) == ("stock", "L")  # the hand-over is for one step only


def test_runner_switched_off_at_run_time_leaves_every_step_to_stock(monkeypatch):
    r, seen = _runner(monkeypatch)
    r._sm121_chain = ("chain",)
    r.sm121_graph_enable(False)
    assert r._sm121_chain is None
    r._model_forward()
    assert seen["forward"] and not r._sm121_take and not r._sm121_tail.claimed
    assert r._sample("L", None) == ("stock", "L") and r.sm121_graph_stats()["fallbacks"] == {}
    r._sm121_chain = ("chain",)
    assert r._sm121_plan(object(), None) is None  # no steady step while off
    r.sm121_graph_enable(True)
    r._model_forward()
    assert r._sm121_take and r._sm121_tail.claimed


def test_runner_falls_back_per_batch_and_counts_the_reason(monkeypatch, caplog):
    r, _ = _runner(monkeypatch, reason="logprobs requested")
    for _ in range(3):
        r._model_forward()
        assert not r._sm121_take and not r._sm121_tail.claimed
        assert r._sample("L", None) == ("stock", "L")
    assert r.sm121_graph_stats()["fallbacks"] == {"logprobs requested": 3}


def test_runner_leaves_uncovered_and_spec_steps_to_stock(monkeypatch):
    r, _ = _runner(monkeypatch, ctx=_ctx(mode="PIECEWISE"))
    r._model_forward()
    assert not r._sm121_take and r.sm121_graph_stats()["fallbacks"] == {}
    r._sm121_take = True
    assert r._sample("L", object()) == ("stock", "L")  # spec-decode metadata: never the tail


def test_worker_builds_the_runner_subclass_and_restores_the_module(monkeypatch):
    import vllm.v1.worker.gpu_model_runner as M

    from vllm_sm121.graph import worker as W
    from vllm_sm121.graph.runner import WholeModelRunner

    stock = M.GPUModelRunner
    seen = {}
    monkeypatch.setattr(W.Worker, "init_device", lambda self: seen.setdefault("cls", M.GPUModelRunner))
    w = object.__new__(W.WholeModelWorker)
    w.use_v2_model_runner = False
    w.init_device()
    assert seen["cls"] is WholeModelRunner and M.GPUModelRunner is stock
    monkeypatch.setattr(W.Worker, "init_device", lambda self: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        w.init_device()
    assert M.GPUModelRunner is stock  # restored on errors too
    w.use_v2_model_runner = True
    with pytest.raises(ValueError, match="V2_MODEL_RUNNER"):
        w.init_device()


def test_worker_exposes_every_runner_rpc_the_tests_call():
    """``LLM.collective_rpc`` calls the worker, not the runner: each ``sm121_*`` method the GPU tests
    call must be forwarded (a missing one failed only on the GPU)."""
    import re
    from pathlib import Path

    from vllm_sm121.graph import worker as W
    from vllm_sm121.graph.runner import WholeModelRunner

    called = set()
    for f in Path(__file__).parent.glob("test_*.py"):
        called |= set(re.findall(r"collective_rpc\(\s*\"(sm121_\w+)\"", f.read_text()))
    assert "sm121_graph_enable" in called
    for name in sorted(called):
        assert hasattr(WholeModelRunner, name), name
        assert name in vars(W.WholeModelWorker), f"WholeModelWorker does not forward {name}"

    class Runner:
        def __init__(self):
            self.calls = []

        def __getattr__(self, name):
            return lambda *a: self.calls.append((name, a))

    w = object.__new__(W.WholeModelWorker)
    w.model_runner = Runner()
    w.sm121_graph_enable(False)
    assert w.model_runner.calls == [("sm121_graph_enable", (False,))]


def test_runner_reason_sees_plugin_logits_processors_and_thinking_budgets():
    from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS

    from vllm_sm121.graph import runner as R

    class PluginProcessor:  # e.g. loaded from a vllm.logits_processors entry point
        pass

    builtin = [object.__new__(c) for c in BUILTIN_LOGITS_PROCESSORS]

    def runner(procs, configured=None, thinking=False):
        r = object.__new__(R.WholeModelRunner)
        r.vllm_config = types.SimpleNamespace(model_config=types.SimpleNamespace(logits_processors=configured))
        r.requests = {"a": types.SimpleNamespace(sampling_params=_params())}
        meta = _metadata(logitsprocs=types.SimpleNamespace(all=procs))
        r.input_batch = types.SimpleNamespace(req_ids=["a"], num_reqs=1, sampling_metadata=meta,
                                              no_thinking_budget=not thinking)
        return r

    assert runner(builtin)._sm121_reason() is None
    assert "thinking_token_budget" in runner(builtin, thinking=True)._sm121_reason()
    assert "custom logits processors" in runner(builtin + [PluginProcessor()])._sm121_reason()
    assert "custom logits processors" in runner(builtin, configured=["my.Processor"])._sm121_reason()
    r = runner(builtin + [PluginProcessor()])
    r._sm121_reason()
    r.input_batch.sampling_metadata.logitsprocs = None  # the batch's processors are built once: the answer is kept
    assert "custom logits processors" in r._sm121_reason()


def test_runner_refuses_to_capture_once_vllm_lowered_the_graph_mode(monkeypatch):
    from vllm_sm121.graph import runner as R

    monkeypatch.setattr(R.GPUModelRunner, "capture_model", lambda self: 7)
    r = object.__new__(R.WholeModelRunner)
    r.vllm_config = _vllm_config()
    assert r.capture_model() == 7
    r._sm121_tail = T.DecodeTail(_Model(), max_rows=8, device="cpu")  # with the tail: the startup line too
    records = []
    monkeypatch.setattr(R.logger, "info", lambda msg, *a: records.append(msg % a))
    assert r.capture_model() == 7
    assert "capture" in records[-1] and "0.00 GiB" in records[-1] and "<= 8 requests" in records[-1], records
    r.vllm_config = _vllm_config(mode="PIECEWISE")
    with pytest.raises(ValueError, match="after vLLM resolved the CUDA graph mode"):
        r.capture_model()


def test_runner_verification_compares_with_stock_on_the_same_logits(monkeypatch):
    from vllm_sm121.graph import runner as R

    r, _ = _runner(monkeypatch)
    r.sm121_graph_verify(True)
    r._model_forward()
    assert r._sm121_take and not r._sm121_tail.claimed  # stock's lm_head still runs
    logits = torch.zeros(3, 10)
    logits[0, 5], logits[1, 9], logits[2, 7] = 1.0, 3.0, 2.0  # stock would pick 5, 9, 7; the graph has 5, 6, 7
    logits[1, 6] = 0.5
    monkeypatch.setattr(R.GPUModelRunner, "_sample", lambda self, lg, spec: types.SimpleNamespace(
        sampled_token_ids=lg.argmax(-1, keepdim=True).to(torch.int32)))
    out = r._sample(logits, None)
    assert out.sampled_token_ids.tolist() == [[5], [6], [7]]  # the graph's tokens are what the step returns
    v = r.sm121_graph_stats()["verify"]
    assert v == {"steps": 1, "rows": 3, "mismatched_rows": 1, "max_logit_gap": 2.5, "input_steps": 0,
                 "input_mismatches": 0}, v
    r.sm121_graph_verify(False)
    r._model_forward()
    assert r._sm121_tail.claimed and r.sm121_graph_stats()["verify"]["steps"] == 0


def test_sample_level_names_the_variable():
    assert [T.sample_level(v) for v in (None, "", "0", "1", "2", " 2 ")] == [0, 0, 0, 1, 2, 2]
    with pytest.raises(ValueError, match="VLLM_SM121_GRAPH_SAMPLE='yes'"):
        T.sample_level("yes")


def test_decode_tail_samples_top_k_top_p_rows_in_the_graph():
    """Level 2: rows' top-k / top-p reach the kernel; the drawn token is one vLLM's filter keeps
    and the reference's best among them."""
    from vllm_sm121.kernels import decode_sample as ds

    model = _Model(vocab=300)
    tail = T.DecodeTail(model, max_rows=4, device="cpu", get_context=lambda: _ctx(tokens=3, reqs=3), samples=2)
    tail.temperature[:3] = torch.tensor([1.0, 1.0, 0.0])
    tail.seeds[:3] = torch.tensor([5, 6, 7])
    tail.top_k[:3] = torch.tensor([2, 0, 3], dtype=torch.int32)
    tail.top_p[:3] = torch.tensor([1.0, 0.3, 0.5])
    ids = torch.tensor([3, 7, 11])
    logits = model.compute_logits(model.emb[ids]).float()
    for step in range(4):
        tail(ids)
        scores = ds.decode_sample_scores_torch(logits, tail.temperature, tail.seeds, step, tail.top_k, tail.top_p)
        got = tail.tokens[:3].long()
        picked = scores.gather(1, got[:, None])[:, 0]
        assert torch.isfinite(picked).all() and torch.all(scores.max(-1).values - picked <= 1e-5)
        assert got[0] in logits[0].topk(2).indices and got[2] == logits[2].argmax()


def test_runner_syncs_sampling_rows_only_when_they_change():
    """In-graph sampling: the rows' temperatures / seeds reach the tail's buffers before a taken
    replay, copied only when the rows or temperatures changed; an all-greedy batch needs zeros
    only (a greedy chain never copies); a seed is a stable hash of (--seed, request id), so every
    TP rank draws the same numbers; verification skips the temperature rows."""
    import numpy as np

    from vllm_sm121.graph import runner as R

    r = object.__new__(R.WholeModelRunner)
    r._sm121_tail = T.DecodeTail(_Model(), max_rows=4, device="cpu", samples=1)
    r._sm121_sampling_key = None
    r.vllm_config = types.SimpleNamespace(model_config=types.SimpleNamespace(seed=0))
    copies = []
    real_copy = torch.Tensor.copy_

    def batch(req_ids, temps, greedy):
        r.input_batch = types.SimpleNamespace(req_ids=list(req_ids), num_reqs=len(req_ids),
                                              temperature_cpu=np.array(temps, dtype=np.float32),
                                              top_k_cpu=np.full(len(req_ids), 7, dtype=np.int32),
                                              top_p_cpu=np.full(len(req_ids), 0.5, dtype=np.float32),
                                              sampling_metadata=types.SimpleNamespace(all_greedy=greedy))

    def counted(self, src, *a, **k):
        copies.append(self.shape)
        return real_copy(self, src, *a, **k)

    torch.Tensor.copy_ = counted
    try:
        batch(["a", "b"], [0.0, 0.0], True)
        r._sm121_sync_sampling()
        r._sm121_sync_sampling()  # the same greedy batch: nothing copied
        batch(["c"], [0.0], True)
        r._sm121_sync_sampling()  # another greedy batch: zeros already there
        assert len(copies) == 2 and r._sm121_tail.temperature.tolist() == [0.0] * 4
        batch(["a", "b"], [0.0, 0.7], False)
        r._sm121_sync_sampling()
        r._sm121_sync_sampling()
        assert len(copies) == 4
        seeds = r._sm121_tail.seeds.tolist()
        assert r._sm121_tail.temperature[:2].tolist() == pytest.approx([0.0, 0.7]) and seeds[0] != seeds[1] != 0
        assert r._sm121_sampled_rows(2).tolist() == [False, True]
        r._sm121_checked = {"steps": 0, "rows": 0, "mismatched_rows": 0, "max_logit_gap": 0.0}
        r._sm121_check(torch.tensor([[5], [6]]), torch.zeros(2, 10), torch.tensor([[5], [9]]))
        assert r._sm121_checked["mismatched_rows"] == 0 and r._sm121_checked["sampled_rows"] == 1
        batch(["b", "a"], [0.7, 0.0], False)  # rows moved: copied again, each request keeps its seed
        r._sm121_sync_sampling()
        assert len(copies) == 6 and r._sm121_tail.seeds[:2].tolist() == [seeds[1], seeds[0]]
        # level 2: the rows' top-k / top-p too (two more copies), not for an all-greedy batch
        r._sm121_tail = T.DecodeTail(_Model(), max_rows=4, device="cpu", samples=2)
        r._sm121_sampling_key = None
        r._sm121_sync_sampling()
        assert len(copies) == 10 and r._sm121_tail.top_k.tolist() == [7, 7, 0, 0]
        assert r._sm121_tail.top_p.tolist() == pytest.approx([0.5, 0.5, 1.0, 1.0])
        batch(["c"], [0.0], True)
        r._sm121_sync_sampling()
        assert len(copies) == 12  # temperatures and seeds only
    finally:
        torch.Tensor.copy_ = real_copy


def test_verification_counts_sampled_tokens_outside_vllms_filter():
    """A temperature row's graph token is checked against vLLM's own top-k / top-p filter on the
    same logits with the row's options: a token it drops is counted (a wrong copy of the options
    would show there)."""
    import numpy as np

    from vllm_sm121.graph import runner as R

    r = object.__new__(R.WholeModelRunner)
    r._sm121_tail = T.DecodeTail(_Model(), max_rows=4, device="cpu", samples=2)
    r.input_batch = types.SimpleNamespace(req_ids=["a", "b"], num_reqs=2,
                                          temperature_cpu=np.array([1.0, 1.0], dtype=np.float32),
                                          top_k_cpu=np.array([2, 10], dtype=np.int32),
                                          top_p_cpu=np.array([1.0, 1.0], dtype=np.float32),
                                          sampling_metadata=types.SimpleNamespace(all_greedy=False))
    logits = torch.arange(20, dtype=torch.float32).reshape(2, 10)
    r._sm121_checked = {"steps": 0, "rows": 0, "mismatched_rows": 0, "max_logit_gap": 0.0}
    r._sm121_check(torch.tensor([[9], [0]]), logits, torch.tensor([[1], [2]]))  # inside top-2; top-k off
    assert r._sm121_checked["sampled_rows"] == 2 and r._sm121_checked["sampled_outside_filter"] == 0
    r._sm121_check(torch.tensor([[3], [0]]), logits, torch.tensor([[1], [2]]))  # row 0: outside its top-2
    assert r._sm121_checked["sampled_outside_filter"] == 1 and r._sm121_checked["mismatched_rows"] == 0


def test_a_taken_stage_a_step_copies_the_sampling_rows_before_the_replay(monkeypatch):
    """_model_forward: when a covered batch takes the graph's tokens with in-graph sampling on,
    the rows' temperatures reach the tail's buffer before stock's forward (the replay) runs; a
    batch that falls back copies nothing."""
    import numpy as np
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_sm121.graph import runner as R

    r = object.__new__(R.WholeModelRunner)
    r._sm121_tail = T.DecodeTail(_Model(), max_rows=4, device="cpu", samples=1)
    r._sm121_sampling_key, r._sm121_verify, r._sm121_fallbacks = None, False, {}
    r.vllm_config = types.SimpleNamespace(model_config=types.SimpleNamespace(seed=0))
    r.input_batch = types.SimpleNamespace(req_ids=["a", "b"], num_reqs=2,
                                          temperature_cpu=np.array([0.0, 0.9], dtype=np.float32),
                                          sampling_metadata=types.SimpleNamespace(all_greedy=False))
    seen = []
    monkeypatch.setattr(R, "current_context", lambda: _ctx(tokens=2, reqs=2))
    monkeypatch.setattr(GPUModelRunner, "_model_forward",
                        lambda self, *a, **k: seen.append(self._sm121_tail.temperature[:2].tolist()))
    reason = {"why": None}
    monkeypatch.setattr(R.WholeModelRunner, "_sm121_reason", lambda self: reason["why"])
    r._model_forward()
    assert seen == [pytest.approx([0.0, 0.9])] and r._sm121_take
    r._sm121_tail.temperature.zero_()
    r._sm121_sampling_key = None
    reason["why"] = "logprobs requested"
    r._model_forward()
    assert seen[-1] == [0.0, 0.0] and not r._sm121_take and r._sm121_fallbacks == {"logprobs requested": 1}
