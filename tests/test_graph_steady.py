"""Stage B of the whole-model graph mode (vllm_sm121/graph/steady.py and the runner's fast path) on
CPU: which scheduler outputs continue the previous step (built with vLLM 0.26's own SchedulerOutput
and CachedRequestData, so field names are checked against the installed vLLM), which engines never
take the path, and the fast step's device inputs and host bookkeeping against what stock's step
would leave (fakes for the runner's state; the input kernel under the Triton interpreter).
The GPU check, with stock's inputs recomputed every step, is tests/test_whole_model_gpu.py."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from vllm_sm121.graph import steady as S

COMPUTED = [10, 31, 47]  # per row, on the host after the previous step (31 -> 32 crosses a 16-token page)
OUTPUTS = [3, 5, 1]  # output tokens so far, the previous step's -1 placeholder included
IDS = ("r0", "r1", "r2")


def _so(rows=IDS, new_block_ids=None, **over):
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    so = SchedulerOutput.make_empty()
    order = list(reversed(rows))  # the scheduler's order need not be the batch's
    idx = {r: IDS.index(r) for r in rows}
    so.scheduled_cached_reqs = CachedRequestData(
        req_ids=order, resumed_req_ids=set(), new_token_ids=[], all_token_ids={},
        new_block_ids=[(new_block_ids or {}).get(r) for r in order],
        num_computed_tokens=[COMPUTED[idx[r]] + 1 for r in order],
        num_output_tokens=[OUTPUTS[idx[r]] for r in order])
    so.num_scheduled_tokens = {r: 1 for r in rows}
    so.total_num_scheduled_tokens = len(rows)
    so.num_common_prefix_blocks = [0, 0]
    for k, v in over.items():
        setattr(so, k, v)
    return so


def _batch():
    return types.SimpleNamespace(num_reqs=3, req_ids=list(IDS), req_id_to_index={r: i for i, r in enumerate(IDS)},
                                 prev_req_id_to_index={r: i for i, r in enumerate(IDS)},
                                 num_computed_tokens_cpu=np.array(COMPUTED + [0], dtype=np.int32))


def _requests():
    # a decoding row: prompt + outputs = computed + 2 (the token in flight has its placeholder)
    return {r: types.SimpleNamespace(num_tokens=COMPUTED[i] + 2, output_token_ids=[7] * (OUTPUTS[i] - 1) + [-1])
            for i, r in enumerate(IDS)}


def test_a_steady_step_continues_and_new_blocks_are_staged():
    assert S.continuation_reason(_so(), _batch(), _requests(), IDS) == (None, False)
    assert S.continuation_reason(_so(new_block_ids={"r1": ([], [])}), _batch(), _requests(), IDS) == (None, False)
    assert S.continuation_reason(_so(new_block_ids={"r1": ([7], [9])}), _batch(), _requests(), IDS) == (None, True)


def test_common_prefix_blocks_do_not_stop_the_fast_path():
    # prefix caching (vLLM's default) reports a lone request's blocks as common prefix blocks;
    # SM121, the only backend admitted, never uses cascade attention, so stock replays the same graph
    assert S.continuation_reason(_so(num_common_prefix_blocks=[3, 2]), _batch(), _requests(), IDS) == (None, False)


def _mutate(case):
    so, batch, reqs, chain = _so(), _batch(), _requests(), IDS
    if case == "no chain":
        chain = None
    elif case == "other rows":
        chain = ("r0", "r2", "r1")
    elif case == "new request":
        so.scheduled_new_reqs = [object()]
    elif case == "finished":
        so.finished_req_ids = {"r9"}
    elif case == "row not scheduled":  # max_tokens reached: dropped one step before finished_req_ids says so
        so = _so(rows=("r0", "r2"))
    elif case == "two tokens":
        so.num_scheduled_tokens["r1"] = 2
        so.total_num_scheduled_tokens = 4
    elif case == "spec":
        so.scheduled_spec_decode_tokens = {"r0": [1]}
    elif case == "zero blocks":
        so.new_block_ids_to_zero = [4]
    elif case == "structured":
        so.has_structured_output_requests = True
    elif case == "resumed":
        so.scheduled_cached_reqs.resumed_req_ids = {"r0"}
    elif case == "discarded":  # the previous step's token of r1 was dropped (a prefill chunk)
        batch.prev_req_id_to_index = {"r0": 0, "r2": 2}
    elif case == "jump":  # e.g. a KV-load rollback: computed tokens not previous + 1
        so.scheduled_cached_reqs.num_computed_tokens[0] += 1
    elif case == "prefill chunk":  # one prompt token left to compute: decode-shaped, not a decode
        reqs["r1"].num_tokens += 5
    elif case == "trimmed":
        so.scheduled_cached_reqs.num_output_tokens[2] -= 1
    return so, batch, reqs, chain


@pytest.mark.parametrize("case, why", [
    ("no chain", "not a graphed decode"), ("other rows", "rows changed"), ("new request", "arrived"),
    ("finished", "finished"), ("row not scheduled", "one token for every row"), ("two tokens", "one token"),
    ("spec", "speculative"), ("zero blocks", "zero or copy"), ("structured", "structured"),
    ("resumed", "resumed"), ("discarded", "discarded"), ("jump", "one token further"),
    ("prefill chunk", "one token further"), ("trimmed", "trimmed"),
])
def test_anything_else_goes_to_stock_with_a_reason(case, why):
    reason, _ = S.continuation_reason(*_mutate(case))
    assert reason is not None and why in reason, reason


def _static_runner(**over):
    backend = types.SimpleNamespace(get_name=lambda: "SM121")
    r = types.SimpleNamespace(
        use_async_scheduling=True, lora_config=None, is_pooling_model=False, supports_mm_inputs=False,
        enable_prompt_embeds=False, uses_mrope=False, uses_xdrope_dim=0, dcp_world_size=1, routed_experts_initialized=False,
        eplb_state=None, parallel_config=types.SimpleNamespace(enable_eplb=False),
        cache_config=types.SimpleNamespace(kv_sharing_fast_prefill=False),
        vllm_config=types.SimpleNamespace(observability_config=types.SimpleNamespace(cudagraph_metrics=False)),
        input_batch=types.SimpleNamespace(block_table=types.SimpleNamespace(block_tables=[object(), object()])),
        attn_groups=[[types.SimpleNamespace(backend=backend)], [types.SimpleNamespace(backend=backend)]])
    for k, v in over.items():
        setattr(r, k, v)
    return r


def test_static_reasons():
    assert S.static_reason(_static_runner()) is None
    assert "async scheduling" in S.static_reason(_static_runner(use_async_scheduling=False))
    assert "LoRA" in S.static_reason(_static_runner(lora_config=object()))
    assert "connector" in S.static_reason(_static_runner(), kv_transfer=True)
    three = types.SimpleNamespace(block_table=types.SimpleNamespace(block_tables=[1, 2, 3]))
    assert "3 KV-cache groups" in S.static_reason(_static_runner(input_batch=three))
    fa = [[types.SimpleNamespace(backend=types.SimpleNamespace(get_name=lambda: "FLASH_ATTN"))]]
    assert "FLASH_ATTN" in S.static_reason(_static_runner(attn_groups=fa))


# ---------------------------------------------------------------------------------------------
# the runner's fast step on fakes
# ---------------------------------------------------------------------------------------------

class _Event:
    def __init__(self):
        self.records = self.syncs = 0

    def record(self):
        self.records += 1

    def synchronize(self):
        self.syncs += 1


class _Buffer:
    def __init__(self, t):
        self.cpu, self.gpu = t.clone(), t.clone()
        self.np = self.cpu.numpy()


def _fast_runner(monkeypatch, bs=(16, 32)):
    """A WholeModelRunner whose previous step was a graphed decode of 3 rows padded to 4."""
    from vllm.forward_context import BatchDescriptor

    from vllm_sm121.graph import runner as R
    from vllm_sm121.graph.tail import DecodeTail

    r = object.__new__(R.WholeModelRunner)
    n, rows, width = 3, 4, 8
    pos = torch.tensor(COMPUTED + [0])  # the previous step's positions (row order)
    tables = []
    for g, b in enumerate(bs):
        bt = types.SimpleNamespace(block_size=b, block_table=_Buffer(torch.arange(rows * width, dtype=torch.int32)
                                                                      .reshape(rows, width) * 3 + 100 * g),
                                   slot_mapping=_Buffer(torch.full((rows,), -7, dtype=torch.int64)),
                                   num_blocks_per_row=np.array([c // b + 1 for c in COMPUTED] + [0], dtype=np.int32))
        tables.append(bt)
    committed = []
    batch = types.SimpleNamespace(
        num_reqs=n, req_ids=list(IDS), req_id_to_index={x: i for i, x in enumerate(IDS)},
        prev_req_id_to_index={x: i for i, x in enumerate(IDS)}, num_computed_tokens_cpu=np.array(COMPUTED + [0]),
        prev_sampled_token_ids=torch.tensor([[11], [12], [13]], dtype=torch.int32),
        token_ids_cpu=np.zeros((4, 64), dtype=np.int32), is_token_ids=np.zeros((4, 64), dtype=bool),
        num_tokens_no_spec=np.array([c + 2 for c in COMPUTED] + [0]),
        block_table=types.SimpleNamespace(block_tables=tables, commit_block_table=committed.append),
        update_async_output_token_ids=lambda: None, sampling_metadata=None)
    batch.set_async_sampled_token_ids = lambda host, ev: setattr(batch, "async_set", (host, ev))
    r.input_batch, r.requests, r.device, r.max_model_len = batch, _requests(), "cpu", 4096
    r.input_ids = _Buffer(torch.zeros(16, dtype=torch.int32))
    r.positions, r.seq_lens = pos.clone(), (pos + 1).to(torch.int32)
    r.seq_lens[n:] = 0
    r.prepare_inputs_event = _Event()
    tail = DecodeTail(types.SimpleNamespace(), max_rows=8, device="cpu")
    bd = BatchDescriptor(rows, rows, True)
    replays = []

    def replay():  # the graph: records the inputs it would read, then "samples" 41, 42, 43
        replays.append((r.input_ids.gpu[:rows].clone(), r.positions[:rows].clone(), r.seq_lens[:rows].clone(),
                        [t.slot_mapping.gpu[:rows].clone() for t in tables]))
        tail.tokens[:rows] = torch.tensor([41, 42, 43, 0], dtype=torch.int32)

    entry = types.SimpleNamespace(cudagraph=types.SimpleNamespace(replay=replay), output=torch.randn(rows, 5))
    r.model = types.SimpleNamespace(concrete_cudagraph_entries={bd: entry}, compute_logits=lambda h: h * 2)
    r.discard_request_mask = types.SimpleNamespace(np=np.ones(8, dtype=bool))  # stale, as stock leaves it
    r.execute_model_state = r.kv_connector_output = None
    r._sm121_tail, r._sm121_chain, r._sm121_static = tail, (IDS, bd), None
    r._sm121_steady = {"fast": 0, "staged": 0, "fast_sampled": 0, "stock": {}}
    r._sm121_taken, r._sm121_fallbacks, r._sm121_take = 0, {}, False
    monkeypatch.setattr(R.WholeModelRunner, "_sm121_reason", lambda self: r.__dict__.get("reason"))

    def buffers(self):
        self._sm121_counts = torch.arange(9, dtype=torch.int32)
        self._sm121_host = torch.zeros((R.RING, 8, 1), dtype=torch.int32)
        self._sm121_events = [_Event() for _ in range(R.RING)]
        self._sm121_ring_next = 0
        self._sm121_patch_host = torch.zeros((R.RING, R.MAX_PATCHES, 4), dtype=torch.int32)
        self._sm121_patch_np = self._sm121_patch_host.numpy()
        self._sm121_patch_next = 0

    monkeypatch.setattr(R.WholeModelRunner, "_sm121_buffers", buffers)

    def update_states(self, so):  # what stock's _update_states does on a steady step
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            row = batch.req_id_to_index[rid]
            batch.num_computed_tokens_cpu[row] = cached.num_computed_tokens[i]
            for bt, ids in zip(tables, cached.new_block_ids[i] or ()):  # BlockTable.append_row
                start = bt.num_blocks_per_row[row]
                bt.block_table.np[row, start:start + len(ids)] = ids
                bt.num_blocks_per_row[row] += len(ids)
        return None

    monkeypatch.setattr(R.WholeModelRunner, "_update_states", update_states)
    monkeypatch.setattr(R.GPUModelRunner, "execute_model", lambda self, *a: "stock execute")
    monkeypatch.setattr(R.GPUModelRunner, "sample_tokens", lambda self, g: "stock sample")
    return r, replays, committed


@pytest.mark.interpreter
def test_fast_step_advances_inputs_replays_and_leaves_stock_state(monkeypatch):
    r, replays, committed = _fast_runner(monkeypatch)
    r._sm121_h2d_in_flight = True  # the previous step was stock's: its uploads are fenced first
    assert r.execute_model(_so()) is None and r._sm121_steady["fast"] == 1 and committed == []
    assert r.prepare_inputs_event.syncs == 1 and r.prepare_inputs_event.records == 0 and not r._sm121_h2d_in_flight
    ids, pos, seq, slots = replays[0]
    want = torch.tensor(COMPUTED) + 1
    assert ids.tolist() == [11, 12, 13, 0] and pos[:3].tolist() == want.tolist()
    assert seq.tolist() == (want + 1).tolist() + [0]
    for g, t in enumerate(r.input_batch.block_table.block_tables):
        page = t.block_table.gpu[torch.arange(3), want // t.block_size].long()
        assert slots[g].tolist() == (page * t.block_size + want % t.block_size).tolist() + [-1]
    out = r.sample_tokens(None)
    b = r.input_batch
    assert out.get_output().sampled_token_ids == [[41], [42], [43]]
    assert out.get_output().req_ids == list(IDS) and out.get_output().req_id_to_index == {x: i for i, x in enumerate(IDS)}
    # stock's async bookkeeping: a -1 placeholder per row, cursor advanced, tokens handed to the next step
    assert [int(b.token_ids_cpu[i, COMPUTED[i] + 2]) for i in range(3)] == [-1, -1, -1]
    assert b.num_tokens_no_spec[:3].tolist() == [c + 3 for c in COMPUTED]
    assert all(r.requests[x].output_token_ids[-2:] == [-1, -1] for x in IDS)
    assert b.prev_sampled_token_ids.dtype == torch.int32 and b.prev_sampled_token_ids.tolist() == [[41], [42], [43]]
    assert b.prev_req_id_to_index == {x: i for i, x in enumerate(IDS)} and b.async_set[0].shape == (3, 1)
    # the next steady step: no upload in flight, no fence; the inputs advance from the graph's tokens
    so = _so()
    for i, rid in enumerate(so.scheduled_cached_reqs.req_ids):
        so.scheduled_cached_reqs.num_computed_tokens[i] += 1
        so.scheduled_cached_reqs.num_output_tokens[i] += 1
    for i, x in enumerate(IDS):
        r.requests[x].num_tokens += 1
    assert r.execute_model(so) is None and r._sm121_steady["fast"] == 2
    assert r.prepare_inputs_event.syncs == 1
    ids, pos, _, _ = replays[1]
    assert ids[:3].tolist() == [41, 42, 43] and pos[:3].tolist() == (want + 1).tolist()
    assert r.sample_tokens(None).get_output().sampled_token_ids == [[41], [42], [43]]


@pytest.mark.interpreter
def test_new_blocks_are_uploaded_under_stocks_fence(monkeypatch):
    r, _, committed = _fast_runner(monkeypatch)
    r._sm121_h2d_in_flight = False
    assert r.execute_model(_so(new_block_ids={"r0": ([5], [6])})) is None
    assert committed == [3] and r._sm121_steady["staged"] == 1
    # no upload was in flight: no fence; the upload is recorded for the next step to wait on
    assert r.prepare_inputs_event.syncs == 0 and r.prepare_inputs_event.records == 1 and r._sm121_h2d_in_flight


@pytest.mark.interpreter
def test_new_pages_ride_the_input_kernel_when_opted_in(monkeypatch):
    r, replays, committed = _fast_runner(monkeypatch)
    r._sm121_h2d_in_flight, r._sm121_patch_pages = False, True
    tables = r.input_batch.block_table.block_tables
    # r1 goes 31 -> 32: a new 16-token page (column 2) in group 0; r0 gets a page it does not use yet in group 1
    assert r.execute_model(_so(new_block_ids={"r1": ([777], []), "r0": ([], [888])})) is None
    assert committed == [] and r._sm121_steady["staged"] == 1 and not r._sm121_h2d_in_flight
    assert r.prepare_inputs_event.syncs == 0 and r.prepare_inputs_event.records == 0
    assert r._sm121_patch_host[0, :2].tolist() == [[0, 1, 2, 777], [1, 0, 1, 888]]
    assert int(tables[0].block_table.gpu[1, 2]) == 777 and int(tables[1].block_table.gpu[0, 1]) == 888
    assert torch.equal(tables[0].block_table.gpu, tables[0].block_table.cpu)  # the device table = the host's
    assert torch.equal(tables[1].block_table.gpu, tables[1].block_table.cpu)
    assert int(replays[0][3][0][1]) == 777 * 16  # row 1's slot at position 32 is on the new page


def test_other_steps_run_stock_and_break_the_chain(monkeypatch):
    r, replays, _ = _fast_runner(monkeypatch)
    so = _so()
    so.finished_req_ids = {"zz"}
    assert r.execute_model(so) == "stock execute" and replays == [] and r._sm121_chain is None
    assert r.sample_tokens(None) == "stock sample"
    assert r._sm121_steady["stock"] == {"requests arrived, finished or were preempted": 1}
    r._sm121_chain = ("x",)  # a dummy run (capture, DP idle ranks) rewrites the inputs: no continuation
    monkeypatch.setattr(__import__("vllm_sm121.graph.runner", fromlist=["R"]).GPUModelRunner, "_dummy_run",
                        lambda self, *a, **k: "dummy")
    assert r._dummy_run(4) == "dummy" and r._sm121_chain is None


@pytest.mark.interpreter
def test_sampled_batches_run_on_device_inputs_then_stock_sampling_when_opted_in(monkeypatch):
    r, replays, _ = _fast_runner(monkeypatch)
    r.reason = "a request samples (temperature > 0)"
    assert r.execute_model(_so()) == "stock execute" and replays == []  # off by default: stock's step
    assert r._sm121_steady["stock"] == {"a request samples (temperature > 0)": 1} and r._sm121_chain is None
    r._sm121_chain = (IDS, next(iter(r.model.concrete_cudagraph_entries)))
    r._sm121_fast_sampled = True
    assert r.execute_model(_so()) is None and len(replays) == 1 and r._sm121_steady["fast_sampled"] == 1
    assert replays[0][0].tolist() == [11, 12, 13, 0]  # the inputs advanced as for a greedy steady step
    st = r.execute_model_state  # what stock's execute_model leaves for its sample_tokens
    hidden = r.model.concrete_cudagraph_entries[r._sm121_chain[1]].output
    assert st.scheduler_output is not None and torch.equal(st.logits, hidden[:3] * 2)
    assert st.hidden_states is hidden and st.spec_decode_metadata is None and st.slot_mappings is None
    assert not r.discard_request_mask.np[:3].any() and r._sm121_pending is None
    assert r.sample_tokens(None) == "stock sample" and r._sm121_taken == 0
