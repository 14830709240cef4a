"""Decode steps over shapes planned up front and captured once at start (``runtime.decode_step`` graph,
magnetar/engine/graphs.py; issue 47, item 1). CI has no GPU: the planned steps run uncaptured on the CPU -- the step a
graph holds -- and a CPU stand-in for ``torch.cuda.CUDAGraph`` (it replays the captured step on the tensors it was
captured with, as a graph reads its captured addresses) proves the captured path: eager's tokens for every layout,
requests joining and leaving (the slots move between planned shapes inside one pool), no shape outside the plan, no
host synchronization inside a step, a second batch at once on buffers of its own, a batch beyond the plan said and
run uncaptured. The captures themselves run in tests/test_gpu.py on a card."""
from __future__ import annotations

import logging

import pytest
import torch

from magnetar.config import EngineConfig
from magnetar.config.checks import FieldError
from magnetar.engine import graphs as graphs_mod
from magnetar.engine.graphs import GraphPlan, capacities_up_to
from magnetar.engine.static import static_problem
from magnetar.parallel import local_groups
from tests.test_continuous_batch import REQUESTS, _ids, _interleaved_against
from tests.test_static_decode import LAYOUTS, _batch_tokens, _engine, _no_sync_in_steps, broken_kernel
from tests.tiny_models import tiny_model

POOL = dict(decode_graph_tokens=2048, decode_graph_batches="1,2,4")  # 1x1024, 2x1024, 4x512 ... within 2048 entries


class _Replayed:
    """A CPU stand-in for a captured CUDA graph: replay() runs the captured step again on the tensors it was captured
    with (the slots' views, the input buffers) and writes its output buffer in place -- what a graph's replay does
    with the addresses it holds."""

    replays = 0

    def __init__(self, run):
        self.run = run

    def replay(self):
        _Replayed.replays += 1
        self.run()


def _fake_record(step, slots, ids, pos, write, mempool):
    logits = step(slots, ids, pos, write).clone()

    def run():
        logits.copy_(step(slots, ids, pos, write))

    return _Replayed(run), logits


@pytest.fixture
def captured(monkeypatch):
    """Engines made in the test capture their planned shapes with the CPU stand-in."""
    monkeypatch.setattr(graphs_mod, "_can_capture", lambda device: True)
    monkeypatch.setattr(graphs_mod, "_record", _fake_record)
    _Replayed.replays = 0
    return _Replayed


def test_the_plan_pads_to_the_next_shape_within_the_pool():
    plan = GraphPlan.make((1, 2, 4, 8), max_positions=3000, tokens=4096, first=256)
    assert plan.capacities == (256, 512, 1024, 1280, 1536, 1792, 2048, 2560, 3072)  # quarter steps from 1024
    assert all(b * c <= 4096 for b, c in plan.shapes()) and (8, 512) in plan.shapes() and (8, 1024) not in plan.shapes()
    assert plan.fit(1, 300) == (1, 512)  # the next capacity
    assert plan.fit(3, 300) == (4, 512)  # the next batch size
    assert plan.fit(5, 600) is None  # 8 x 1024 exceeds the pool
    assert GraphPlan.make((1,), max_positions=None, tokens=None, first=256).capacities[-1] >= 1 << 20
    assert capacities_up_to(300, 256) == (256, 512) and capacities_up_to(32768 + 40, 256)[-2:] == (32768, 40960)


@pytest.mark.parametrize("field,value,words", [
    ("decode_graph_batches", "1,x", "comma-separated batch sizes"),
    ("decode_graph_batches", "0,2", "batch sizes >= 1"),
    ("decode_graph_tokens", -1, ">= 0 KV entries"),
    ("decode_graph_warmup_s", 0.0, "> 0 seconds"),
])
def test_bad_graph_settings_name_their_field(field, value, words):
    with pytest.raises(FieldError, match=words) as e:
        EngineConfig.create(decode_step="graph", **{field: value})
    assert e.value.field == field and f"--{field.replace('_', '-')}" in str(e.value)


def test_graph_steps_need_one_rank_per_replica():
    assert static_problem("graph", None, local_groups()) == ("graph", None)

    class Groups:
        tp_size, cp_size = 1, 2

    mode, why = static_problem("graph", None, Groups())
    assert mode == "static" and "gather and merge" in why and "outside a CUDA graph" in why


@pytest.mark.parametrize("label,flat", LAYOUTS, ids=[x[0] for x in LAYOUTS])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_graph_steps_choose_eager_tokens_uncaptured(arch, label, flat):
    # the CPU's graph step: the planned shapes, run eagerly (with and without a pool)
    model = tiny_model(arch, seed=2)
    want, _ = _batch_tokens(_engine(model, **flat))
    for extra in ({}, POOL):
        eng = _engine(model, decode_step="graph", **flat, **extra)
        got, batch = _batch_tokens(eng)
        assert (batch.decode_step, batch.why_not) == ("graph", None)
        assert "nothing is captured on cpu" in eng.decode_graphs.why_not
        assert got == want, f"{arch} {label} {extra}"


@pytest.mark.parametrize("label,flat", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_captured_steps_choose_eager_tokens(captured, label, flat):
    model = tiny_model("llama", seed=2)
    want, _ = _batch_tokens(_engine(model, **flat))
    eng = _engine(model, decode_step="graph", **flat, **POOL)
    g = eng.decode_graphs
    assert g.why_not is None and set(g.graphs) == set(g.plan.shapes()) and not g.uncaptured
    assert all(bool((p == graphs_mod.FAR).all()) for p in g.pool.pos)  # the capture's writes are undone
    got, batch = _batch_tokens(eng)
    assert got == want and captured.replays > 0


def test_captured_batch_moves_between_planned_shapes_in_one_pool(captured, monkeypatch):
    # requests join and leave between steps (sampled and greedy, a context asked twice): every step runs a planned
    # shape's graph over the pool's views; each request's tokens are its tokens alone
    model = tiny_model("llama", seed=2)
    flat = dict(method="star", cp_size=2, block_size=24, simulate=True)
    eng = _engine(model, decode_step="graph", **flat, **POOL)
    g, seen = eng.decode_graphs, []
    replay = g.replay

    def watched(slots, ids, pos, write):
        seen.append((slots.slots, slots.capacity, slots.pooled, slots.k[0].data_ptr() == g.pool.k[0].data_ptr()))
        return replay(slots, ids, pos, write)

    monkeypatch.setattr(g, "replay", watched)
    _interleaved_against(eng, _engine(model, context_cache_mb=0, **flat), "graph star")
    shapes = {s[:2] for s in seen}
    assert len(shapes) > 1 and shapes <= set(g.plan.shapes()), shapes
    assert all(pooled and same for *_, pooled, same in seen)
    assert g.holder is None  # the last request out gave the pool back


def test_a_second_batch_at_once_gets_its_own_buffers(captured):
    # the pool is one batch's at a time: a second batch meanwhile runs on buffers of its own (uncaptured), and
    # neither disturbs the other's KV
    model = tiny_model("llama", seed=2)
    ref = _engine(model)
    want, _ = _batch_tokens(ref)
    alone = ref.generate(_ids(1, 100), _ids(2, 5), max_new_tokens=6).token_ids
    eng = _engine(model, decode_step="graph", **POOL)
    first = eng.open_batch()
    rid = first.add(_ids(1, 100), _ids(2, 5), eng.sampling_params(max_new_tokens=6))[0]
    first.step()
    mine = first._batch.static
    assert mine.slots.pooled and eng.decode_graphs.holder is mine
    got, batch = _batch_tokens(eng)  # while the first batch holds the pool
    assert got == want and eng.decode_graphs.holder is mine
    while first.active:
        first.step()
    assert first.pop(rid).token_ids == alone
    assert eng.decode_graphs.holder is None


def test_a_dropped_or_eager_batch_gives_the_pool_back(captured):
    # a batch dropped while it holds the pool (an exception left it) holds it no more; one that goes eager for good
    # (a context whose KV is not finite) gives it back and keeps its tokens
    import gc

    model = tiny_model("llama", seed=2)
    alone = _engine(model).generate(_ids(1, 100), _ids(2, 5), max_new_tokens=5).token_ids
    eng = _engine(model, decode_step="graph", **POOL)
    b = eng.open_batch()
    b.add(_ids(1, 100), _ids(2, 5), eng.sampling_params(max_new_tokens=5))
    b.step()
    assert eng.decode_graphs.holder is b._batch.static
    del b
    gc.collect()
    assert eng.decode_graphs.holder is None
    b = eng.open_batch()
    rid = b.add(_ids(1, 100), _ids(2, 5), eng.sampling_params(max_new_tokens=5))[0]
    b.step()
    b._batch._to_eager("a test's reason")
    assert eng.decode_graphs.holder is None and b._batch.decode_step == "eager"
    while b.active:
        b.step()
    assert b.pop(rid).token_ids == alone


def test_a_batch_beyond_the_plan_runs_uncaptured_and_says_so(captured, caplog):
    model = tiny_model("llama", seed=2)
    want, _ = _batch_tokens(_engine(model))
    eng = _engine(model, decode_step="graph", decode_graph_tokens=512, decode_graph_batches="1")
    with caplog.at_level(logging.WARNING, logger="magnetar.engine.static"):
        got, _ = _batch_tokens(eng)
    assert got == want
    said = [r.getMessage() for r in caplog.records if "fit no planned shape" in r.getMessage()]
    assert len(said) == 1 and "--decode-graph-tokens" in said[0] and "--decode-graph-batches" in said[0]


def test_the_warm_up_is_bounded_and_a_failed_capture_runs_uncaptured(captured, monkeypatch, caplog):
    model = tiny_model("llama", seed=2)
    clock = iter(range(0, 10_000, 10))  # every look at the clock: 10 s later
    monkeypatch.setattr(graphs_mod.time, "perf_counter", lambda: next(clock))
    eng = _engine(model, decode_step="graph", decode_graph_warmup_s=25, **POOL)
    g = eng.decode_graphs
    assert 0 < len(g.graphs) < len(g.plan.shapes()) and g.uncaptured and g.warmup_s > 0
    monkeypatch.undo()

    def broken(*a, **k):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs_mod, "_can_capture", lambda device: True)
    monkeypatch.setattr(graphs_mod, "_record", broken)
    want, _ = _batch_tokens(_engine(model))
    with caplog.at_level(logging.WARNING, logger="magnetar.engine.graphs"):
        eng = _engine(model, decode_step="graph", **POOL)
    assert not eng.decode_graphs.graphs and "not permitted" in eng.decode_graphs.why_not
    assert any("run uncaptured" in r.getMessage() for r in caplog.records)
    assert _batch_tokens(eng)[0] == want


def test_a_graph_step_never_waits_for_the_device(captured, monkeypatch):
    model = tiny_model("llama", seed=2)
    want, _ = _batch_tokens(_engine(model))
    eng = _engine(model, decode_step="graph", **POOL)
    _no_sync_in_steps(monkeypatch)
    assert _batch_tokens(eng, REQUESTS)[0] == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_captured_steps_on_cuda(arch, monkeypatch):
    # the real capture: every planned shape a CUDA graph at start (FlexAttention over the pool's slots, the empty blocks
    # skipped), eager's tokens (fp32), nothing inside a step synchronizing (the driver's sync debug mode "error")
    model = tiny_model(arch, seed=2)
    flat = dict(method="star", cp_size=2, block_size=24, simulate=True, deepspeed_inference=False)
    want, _ = _batch_tokens(_engine(model, **flat), steps_between=0)
    eng = _engine(model, decode_step="graph", decode_graph_batches="1,2,4", **flat)
    g = eng.decode_graphs
    assert g.why_not is None and set(g.graphs) == set(g.plan.shapes()), g.why_not
    replays = []
    replay = g.replay
    monkeypatch.setattr(g, "replay", lambda *a: replays.append(1) or replay(*a))
    _no_sync_in_steps(monkeypatch)
    got, batch = _batch_tokens(eng, steps_between=0)
    assert batch.static.attention == "flex" and replays
    assert got == want, arch


def test_a_graph_batch_reads_its_contexts_where_the_cache_holds_them(captured):
    # a slot holds the request's own tokens only: its context is read through the pool's pointer table, which points
    # at the cached shard's own tensors (no copy); a request leaving empties its row, the last gives the pool back
    # with every row empty (no context held alive through it)
    model = tiny_model("llama", seed=2)
    eng = _engine(model, decode_step="graph", **POOL)
    handle = eng.encode(_ids(1, 700))
    b = eng.open_batch()
    rid = b.add(handle, _ids(2, 5), eng.sampling_params(max_new_tokens=4))[0]
    b.step()
    static = b._batch.static
    sl, table = static.slots, eng.decode_graphs.pool.table
    assert sl.pooled and sl.table is table and sl.capacity == 256  # 5 query tokens and a few new ones, not 700
    slot = static.owner[rid]
    for i in range(handle.shard.num_layers):
        [(k, v, pos)] = table.pieces[slot][i]
        [cached] = handle.shard.segments(i)
        assert k.data_ptr() == cached.k.data_ptr() and v.data_ptr() == cached.v.data_ptr()
        assert table.device[:, i, slot, 0].tolist()[:4] == [cached.k.data_ptr(), cached.v.data_ptr(),
                                                            cached.pos.data_ptr(), 700]
    other = b.add(_ids(3, 300), _ids(4, 5), eng.sampling_params(max_new_tokens=9))[0]
    while rid in b.active:
        b.step()
    b.pop(rid)  # the other one decodes on: the leaver's row is empty, its context no longer held through the table
    assert table.pieces[slot] is None and table.pieces[static.owner[other]] is not None
    while b.active:
        b.step()
    b.pop(other)
    assert eng.decode_graphs.holder is None and all(p is None for p in table.pieces)


def test_a_failing_context_kernel_sends_the_batch_eager_and_says_why(captured, monkeypatch, caplog):
    # the pointer kernel failing on a card (never run on one before): the captures fail (uncaptured, said), and the
    # first step that calls the kernel runs again eager, the batch eager from then on, its tokens eager's
    from magnetar.ops.backends.reference import ReferenceBackend

    calls = broken_kernel(monkeypatch, ReferenceBackend, "pointers_forward",
                          "CompilationError: at 12:8: no pointer casts here")
    model = tiny_model("llama", seed=2)
    want, _ = _batch_tokens(_engine(model))
    with caplog.at_level(logging.WARNING):
        eng = _engine(model, decode_step="graph", **POOL)
        got, batch = _batch_tokens(eng)
    assert got == want and calls
    assert eng.decode_graphs.why_not.startswith("capturing a decode graph failed (ContextKernelFailed: the torch "
                                                "context kernel failed (RuntimeError: CompilationError")
    assert batch.decode_step == "eager" and batch.static is None
    assert batch.why_not.startswith("the torch context kernel failed (RuntimeError: CompilationError: at 12:8")
    assert batch.why_not.endswith(": decode steps run eager") and "decode steps run eager" in caplog.text
