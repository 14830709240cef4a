"""Profiler ranges (magnetar.utils.nvtx): balanced push/pop even when the body raises; NVTX only while Nsight is
attached or MAGNETAR_NVTX=1, through DeepSpeed's accelerator where it emits and the nvtx package otherwise;
``record_function`` only while a torch profiler runs. A ``torch.profiler`` trace of one generate (dense, star
simulated, ring on 2 gloo ranks) holds the phase ranges, nested as documented; docs/profiling.md lists exactly
the names of ``RANGES``, and every ``nvtx_range`` call of the package uses one of them with its fields."""
from __future__ import annotations

import ast
import re
import string
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import magnetar
from magnetar.utils import nvtx
from tests.dist_utils import run_distributed
from tests.tiny_models import tiny_model

REPO = Path(__file__).resolve().parents[1]
L, Q, NEW = 40, 4, 3  # context, query, generated tokens


@pytest.fixture
def recorder(monkeypatch):
    events = []
    monkeypatch.setattr(nvtx, "_EMIT", (lambda msg: events.append(("push", msg)), lambda: events.append(("pop",))))
    return events


@pytest.fixture
def nvtx_env(monkeypatch):
    """A clean NVTX environment; the module's state is re-read from the real environment afterwards."""
    monkeypatch.delenv("NVTX_INJECTION64_PATH", raising=False)
    monkeypatch.delenv("MAGNETAR_NVTX", raising=False)
    nvtx.refresh()
    yield monkeypatch
    monkeypatch.undo()
    nvtx.refresh()


def test_context_manager_balanced_on_exception(recorder):
    with pytest.raises(KeyError):
        with nvtx.nvtx_range("outer"):
            with nvtx.nvtx_range(nvtx.PHASE1_BLOCK, i=3):
                raise KeyError("boom")
    assert recorder == [("push", "outer"), ("push", "magnetar/phase1/block3"), ("pop",), ("pop",)]


def test_decorator_returns_and_propagates(recorder):
    @nvtx.nvtx_range(nvtx.PHASE2_MERGE, n=1)
    def f(x):
        if x < 0:
            raise ValueError("negative")
        return 2 * x

    assert f(3) == 6 and f.__name__ == "f"
    with pytest.raises(ValueError):
        f(-1)
    assert recorder == [("push", "magnetar/phase2/merge/layer1"), ("pop",)] * 2


def test_reentrant_instance(recorder, monkeypatch):
    r = nvtx.nvtx_range("r")
    with r:
        monkeypatch.setattr(nvtx, "_EMIT", None)  # emission stops between the two entries: the inner pushes nothing
        with r:
            pass
    assert recorder == [("push", "r"), ("pop",)]


def test_disabled_without_profiler(nvtx_env):
    assert nvtx.refresh() is False
    with nvtx.nvtx_range("x"):  # must not touch any backend
        pass
    nvtx_env.setenv("MAGNETAR_NVTX", "1")
    assert nvtx.refresh() is True  # the nvtx package is a dependency: ranges can be emitted
    with nvtx.nvtx_range("real nvtx call"):
        pass
    nvtx_env.setenv("MAGNETAR_NVTX", "0")
    nvtx_env.setenv("NVTX_INJECTION64_PATH", "/nonexistent")
    assert nvtx.refresh() is False
    nvtx_env.delenv("MAGNETAR_NVTX")
    assert nvtx.refresh() is True  # Nsight attached: on without MAGNETAR_NVTX


class _FakeAccelerator:
    def __init__(self, name):
        self.name, self.events = name, []

    def device_name(self, device_index=None):
        return self.name

    def range_push(self, msg, domain=None, category=None):
        self.events.append(("push", msg))

    def range_pop(self, domain=None):
        self.events.append(("pop",))


def test_nvtx_through_deepspeed_accelerator_where_it_emits(nvtx_env):
    import deepspeed.accelerator
    import nvtx as nvtx_package

    cuda = _FakeAccelerator("cuda")
    nvtx_env.setattr(deepspeed.accelerator, "get_accelerator", lambda: cuda)
    nvtx_env.setenv("MAGNETAR_NVTX", "1")
    assert nvtx.refresh() is True
    with pytest.raises(RuntimeError):
        with nvtx.nvtx_range(nvtx.PHASE1_RING_STEP, s=2):
            raise RuntimeError("inside")
    assert cuda.events == [("push", "magnetar/phase1/ring/step2"), ("pop",)]

    cpu = _FakeAccelerator("cpu")  # DeepSpeed's CPU accelerator's range_push is a no-op: the nvtx package instead
    nvtx_env.setattr(deepspeed.accelerator, "get_accelerator", lambda: cpu)
    assert nvtx.refresh() is True
    assert nvtx._EMIT == (nvtx_package.push_range, nvtx_package.pop_range)
    with nvtx.nvtx_range(nvtx.GENERATE):
        pass
    assert cpu.events == []

    nvtx_env.setitem(sys.modules, "deepspeed.accelerator", None)  # no DeepSpeed: the nvtx package
    assert nvtx.refresh() is True and nvtx._EMIT == (nvtx_package.push_range, nvtx_package.pop_range)
    nvtx_env.setitem(sys.modules, "nvtx", None)  # neither: off
    assert nvtx.refresh() is False


@pytest.fixture
def record_calls(monkeypatch):
    """The names of every ``record_function`` entered under ``magnetar/`` (the real one still runs)."""
    calls = []
    real = torch.autograd.profiler.record_function

    class Spy(real):
        def __enter__(self):
            if self.name.startswith("magnetar/"):
                calls.append(self.name)
            return super().__enter__()

    monkeypatch.setattr(torch.autograd.profiler, "record_function", Spy)
    return calls


def test_record_function_only_while_a_torch_profiler_runs(nvtx_env, record_calls):
    with nvtx.nvtx_range(nvtx.SCORE):
        pass
    assert record_calls == []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with pytest.raises(ZeroDivisionError):
            with nvtx.nvtx_range(nvtx.PHASE2_DECODE_STEP, t=4):
                with nvtx.nvtx_range(nvtx.ATTENTION, backend="sdpa"):
                    1 / 0
    assert record_calls == ["magnetar/phase2/decode/step4", "magnetar/attention/sdpa"]
    events = {e.name: e for e in prof.events()}
    inner = events["magnetar/attention/sdpa"]
    assert inner.cpu_parent is not None and inner.cpu_parent.name == "magnetar/phase2/decode/step4"
    with nvtx.nvtx_range(nvtx.SCORE):  # the profiler stopped: no more record_function
        pass
    assert len(record_calls) == 2


def _ids(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (L,), generator=g), torch.randint(0, 256, (Q,), generator=g)


def _ancestors(event) -> list[str]:
    names, e = [], event.cpu_parent
    while e is not None:
        names.append(e.name)
        e = e.cpu_parent
    return names


def _check_generate_trace(events, *, layers: int, blocks: int, phase1_runs: int, ring_steps: int = 0,
                          cp_ranks: int = 1) -> None:
    """The ranges of one ``generate`` of NEW tokens: counts per name and nesting (a decode layer's gather and
    merge only over more than one CP rank: one rank's state is the result)."""
    ours = [e for e in events if e.name.startswith("magnetar/")]
    counts = Counter(e.name for e in ours)
    forwards = NEW  # the query, then NEW - 1 decode steps
    assert counts[nvtx.GENERATE] == 1, counts
    assert counts[nvtx.PHASE1] == phase1_runs, counts
    assert sum(c for name, c in counts.items() if re.fullmatch(r"magnetar/phase1/block\d+", name)) == blocks, counts
    assert counts[nvtx.PHASE2_QUERY] == 1, counts
    for t in range(1, NEW):
        assert counts[nvtx.PHASE2_DECODE_STEP.format(t=t)] == 1, (t, counts)
    for n in range(layers):
        assert counts[nvtx.PHASE1_LAYER.format(n=n)] == blocks, (n, counts)
        assert counts[nvtx.PHASE2_LAYER.format(n=n)] == forwards, (n, counts)
        for name in (nvtx.PHASE2_GATHER, nvtx.PHASE2_MERGE):
            assert counts[name.format(n=n)] == (forwards if cp_ranks > 1 else 0), (name, n, counts)
    for s in range(ring_steps):
        assert counts[nvtx.PHASE1_RING_STEP.format(s=s)] == blocks * layers, (s, counts)
    for e in ours:
        up = _ancestors(e)
        if e.name.startswith("magnetar/phase1/layer"):
            assert up[0].startswith("magnetar/phase1/block") and up[1:3] == [nvtx.PHASE1, nvtx.GENERATE], (e.name, up)
        if e.name.startswith("magnetar/phase1/ring/"):
            assert up[0].startswith("magnetar/phase1/layer"), (e.name, up)
        n = re.fullmatch(r"magnetar/phase2/(?:gather|merge)/layer(\d+)", e.name)
        if n:
            assert up[0] == nvtx.PHASE2_LAYER.format(n=n.group(1)), (e.name, up)
            assert up[-1] == nvtx.GENERATE and (nvtx.PHASE2_QUERY in up or any(
                a.startswith("magnetar/phase2/decode/step") for a in up)), (e.name, up)


@pytest.mark.parametrize("flat, blocks, phase1_runs", [
    (dict(method="dense"), 1, 1),
    (dict(method="star", cp_size=2, simulate=True), 2, 2),  # one block per simulated rank, each rank's Phase 1
])
def test_torch_profiler_trace_of_generate_has_the_phase_ranges(nvtx_env, record_calls, flat, blocks, phase1_runs):
    model = tiny_model("llama")
    eng = magnetar.init_inference(model, deepspeed_inference=False, context_cache_mb=0, **flat)  # Phase 1 twice
    ctx, q = _ids()
    plain = eng.generate(ctx, q, max_new_tokens=NEW)
    assert record_calls == [], "record_function entered with no profiler running"
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        traced = eng.generate(ctx, q, max_new_tokens=NEW)
    assert traced.token_ids == plain.token_ids
    _check_generate_trace(prof.events(), layers=model.config.num_hidden_layers, blocks=blocks,
                          phase1_runs=phase1_runs)


def _ring_worker(rank, world):
    model = tiny_model("llama")
    eng = magnetar.init_inference(model, deepspeed_inference=False, method="ring", cp_size=world)
    ctx, q = _ids()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        eng.generate(ctx, q, max_new_tokens=NEW)
    events = prof.events()
    _check_generate_trace(events, layers=model.config.num_hidden_layers, blocks=1, phase1_runs=1, ring_steps=world,
                          cp_ranks=world)
    gathers = [e for e in events if e.name == nvtx.ALL_GATHER_STATES]  # the collective, inside each layer's gather
    assert len(gathers) == NEW * model.config.num_hidden_layers
    assert all(e.cpu_parent.name.startswith("magnetar/phase2/gather/layer") for e in gathers)


def test_torch_profiler_trace_of_ring_on_two_ranks():
    run_distributed(_ring_worker, 2)


def _doc_names() -> list[str]:
    text = (REPO / "docs" / "profiling.md").read_text(encoding="utf-8")
    return re.findall(r"^\| `(magnetar/[^`]*)` \|", text, flags=re.M)


def test_docs_list_exactly_the_range_names():
    names = _doc_names()
    assert len(names) == len(set(names)), f"docs/profiling.md lists a range twice: {names}"
    assert set(names) == set(nvtx.RANGES), (f"docs/profiling.md and magnetar.utils.nvtx.RANGES differ: only in the "
                                            f"docs {sorted(set(names) - set(nvtx.RANGES))}, only in the code "
                                            f"{sorted(set(nvtx.RANGES) - set(names))}")


def _fields(template: str) -> set[str]:
    return {f for _, f, _, _ in string.Formatter().parse(template) if f}


def test_every_range_call_uses_a_documented_template_with_its_fields():
    """Names are filled in only while a profiler runs, so a wrong field would fail only then: check statically."""
    constants = {k: v for k, v in vars(nvtx).items() if isinstance(v, str) and v in nvtx.RANGES}
    assert set(constants.values()) == set(nvtx.RANGES)
    used, problems = set(), []
    for path in sorted((REPO / "magnetar").rglob("*.py")):
        if path.name == "nvtx.py" and path.parent.name == "utils":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            where = f"{path.relative_to(REPO)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Assign) and any(getattr(t, "attr", getattr(t, "id", None)) == "layer_range"
                                                    for t in node.targets):
                name = getattr(node.value, "id", None)
                if isinstance(node.value, ast.Constant) and node.value.value is None:
                    continue  # a context without per-layer ranges (a compiled step's: magnetar_attention skips them)
                if name not in constants or _fields(constants[name]) != {"n"}:
                    problems.append(f"{where}: layer_range must be a RANGES template with field n")
                else:
                    used.add(constants[name])
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "nvtx_range"):
                continue
            first = node.args[0] if node.args else None
            kw = {k.arg for k in node.keywords}
            if isinstance(first, ast.Attribute) and first.attr == "layer_range":
                ok = kw == {"n"}
            elif isinstance(first, ast.Name) and first.id in constants:
                ok = kw == _fields(constants[first.id])
                used.add(constants[first.id])
            else:
                ok = False
            if not ok:
                problems.append(f"{where}: nvtx_range({ast.unparse(node)[11:-1]}) is not a RANGES template with "
                                f"its fields")
    assert not problems, "\n".join(problems)
    assert used == set(nvtx.RANGES), f"templates no call opens: {sorted(set(nvtx.RANGES) - used)}"
