"""Static and compiled decode steps (``runtime.decode_step``, magnetar/engine/static.py): the same tokens as eager
decoding -- every supported architecture (sliding windows, GQA / MQA, Gemma's scale), dense / Star / Pulsar over
simulated and real ranks, requests joining and leaving between steps, a batch against each request alone -- the slot
attention against the fp64 reference, a decode policy (sparse decoding, LuKA) running eager with the reason said, a
context whose KV is not finite sending the batch back to eager, and a compile failure falling back to static."""
from __future__ import annotations

import copy

import pytest
import torch

import magnetar
from magnetar.engine.static import static_problem
from magnetar.ops.backends import get_backend
from magnetar.ops.slots import FAR, slot_backend, slot_backends
from magnetar.parallel import local_groups
from tests.conftest import assert_close
from tests.dist_utils import run_distributed
from tests.reference import dense_attention_fp64
from tests.test_continuous_batch import REQUESTS, _ids, _interleaved_against
from tests.tiny_models import ARCHS, tiny_model

CUDA = torch.cuda.is_available()


def _engine(model, **flat):
    return magnetar.init_inference(copy.deepcopy(model), timeout_s=60, **flat)


def _batch_tokens(eng, requests=REQUESTS, steps_between=1):
    """Every request of ``requests`` through one batch, joining one after another ``steps_between`` steps apart;
    ``(tokens per request, the DecodeBatch)``."""
    batch = eng.open_batch()
    rids = []
    for cs, cl, qs, ql, kw in requests:
        rids.append(batch.add(_ids(cs, cl), _ids(qs, ql), eng.sampling_params(**kw))[0])
        for _ in range(steps_between):
            batch.step()
    while batch.active:
        batch.step()
    inner = batch._batch
    return [batch.pop(r).token_ids for r in rids], inner


@pytest.mark.parametrize("case", ["causal", "window", "empty rows", "gqa"])
def test_slot_attention_equals_the_reference(case):
    g = torch.Generator().manual_seed(1)
    B, Hq, Hkv, C, D = 3, 4, 2, 40, 16
    if case == "gqa":
        Hq, Hkv = 8, 1
    q = torch.randn(B, Hq, 1, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, Hkv, C, D, generator=g, dtype=torch.float64) for _ in range(2))
    fill = [40, 17, 0 if case == "empty rows" else 5]
    k_pos = torch.full((B, C), FAR, dtype=torch.long)
    for b, n in enumerate(fill):  # gapped, unsorted positions, as Star's anchor and Pulsar's summaries keep
        k_pos[b, :n] = torch.randperm(3 * C, generator=g)[:n]
    q_pos = torch.tensor([[3 * C], [2 * C], [C]])
    window = 30 if case == "window" else None
    # every backend that owns a decode kernel, each against fp64 (cpu_decode: its op's masked pass where the CPU runs
    # it, torch's math where not -- tests/test_cpu_decode.py says which)
    assert slot_backends() == ["cpu_decode", "flex", "torch"]
    for impl in (get_backend(name).slot_forward for name in slot_backends()):
        out, lse = impl(q.float(), k.float(), v.float(), q_pos, k_pos, 0.25, window)
        for b in range(B):
            keep = torch.arange(fill[b])  # the slot's entries; a window keeps those after q_pos - window
            if window is not None:
                keep = keep[k_pos[b, keep] > q_pos[b, 0] - window]
            ref_o, ref_l = dense_attention_fp64(q[b:b + 1], k[b:b + 1, :, keep], v[b:b + 1, :, keep], q_pos=q_pos[b],
                                                k_pos=k_pos[b, keep], scale=0.25)
            assert_close(out[b:b + 1], ref_o, torch.float32, "out", f"{impl.__name__} {case} row {b}")
            assert_close(lse[b:b + 1], ref_l, torch.float32, "lse", f"{impl.__name__} {case} row {b}")
        if case == "empty rows":
            assert (out[2] == 0).all() and (lse[2] == float("-inf")).all()


def test_flex_slot_kernel_skips_each_slots_empty_blocks_exactly(monkeypatch):
    # on CUDA the slot kernel lists each slot's key blocks only up to its last filled entry (a graph step's slots are
    # padded to a planned capacity: the padding is not read); forced on the CPU here: every block holding an entry is
    # listed, none past the last, and the call stays exact (the CPU's eager kernel applies the rule, not the skipping)
    from magnetar.ops.backends import flex

    monkeypatch.setattr(flex, "SKIP_EMPTY_ON", ("cpu",))
    g = torch.Generator().manual_seed(3)
    B, Hq, Hkv, C, D = 4, 4, 2, 3 * flex.SKIP_BLOCK, 16
    q = torch.randn(B, Hq, 1, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, Hkv, C, D, generator=g, dtype=torch.float64) for _ in range(2))
    k_pos = torch.full((B, C), FAR, dtype=torch.long)
    kept = [torch.arange(C), torch.arange(130), torch.arange(0), torch.cat([torch.arange(5), torch.arange(200, 260)])]
    for b, idx in enumerate(kept):  # full, one block and a bit, empty, a hole then entries in the second block
        k_pos[b, idx] = torch.randperm(4 * C, generator=g)[:len(idx)]
    q_pos = torch.full((B, 1), 4 * C)
    blocks = flex._filled_blocks(k_pos, 1)
    assert blocks.kv_num_blocks.view(-1).tolist() == [3, 2, 0, 3]
    listed = blocks.to_dense()[:, 0, 0].bool()  # (B, key blocks)
    for b, idx in enumerate(kept):
        holds = torch.zeros(C // flex.SKIP_BLOCK, dtype=torch.bool)
        holds[idx // flex.SKIP_BLOCK] = True
        assert bool((listed[b] | ~holds).all()), f"slot {b}: a block holding entries is not listed"
    out, lse = flex.slot_attention_flex(q.float(), k.float(), v.float(), q_pos, k_pos, 0.25)
    for b, idx in enumerate(kept):
        if not len(idx):
            assert (out[b] == 0).all() and (lse[b] == float("-inf")).all()
            continue
        ref_o, ref_l = dense_attention_fp64(q[b:b + 1], k[b:b + 1, :, idx], v[b:b + 1, :, idx], q_pos=q_pos[b],
                                            k_pos=k_pos[b, idx], scale=0.25)
        assert_close(out[b:b + 1], ref_o, torch.float32, "out", f"skipping flex row {b}")
        assert_close(lse[b:b + 1], ref_l, torch.float32, "lse", f"skipping flex row {b}")


def test_slot_attention_keeps_nan():
    # a NaN in q or in a key a row sees makes the row NaN (never a finite number); in a key it cannot see, nothing
    B, H, C, D = 1, 2, 8, 16
    q, k, v = torch.randn(B, H, 1, D), torch.randn(B, H, C, D), torch.randn(B, H, C, D)
    k_pos, q_pos = torch.arange(C)[None], torch.tensor([[5]])
    for impl in (get_backend(name).slot_forward for name in ("torch", "cpu_decode")):
        kk = k.clone()
        clean, _ = impl(q, kk, v, q_pos, k_pos, 0.25)
        kk[0, 0, 3, 0] = float("nan")  # seen by the query (position 3 <= 5)
        kk[0, 1, 7, 0] = float("nan")  # position 7: not seen
        out, lse = impl(q, kk, v, q_pos, k_pos, 0.25)
        assert out[0, 0].isnan().all() and lse[0, 0].isnan().all()
        assert torch.equal(out[0, 1], clean[0, 1])


LAYOUTS = [("dense", dict(method="dense")),
           ("star", dict(method="star", cp_size=2, block_size=24, simulate=True)),
           ("pulsar", dict(method="pulsar", cp_size=2, sink_size=4, chunk_size=8, summary_budget=0.25, simulate=True))]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("label,flat", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_static_steps_choose_eager_tokens(arch, label, flat):
    model = tiny_model(arch, seed=2)
    want, eager = _batch_tokens(_engine(model, **flat))
    got, static = _batch_tokens(_engine(model, decode_step="static", **flat))
    assert (eager.decode_step, static.decode_step, static.why_not) == ("eager", "static", None)
    assert got == want, f"{arch} {label}"


def test_static_batch_equals_each_request_alone():
    # requests join and leave between steps (interleaved), sampled and greedy, one context asked twice (a cache hit)
    model = tiny_model("llama", seed=2)
    flat = dict(method="star", cp_size=2, block_size=24, simulate=True)
    _interleaved_against(_engine(model, decode_step="static", **flat), _engine(model, context_cache_mb=0, **flat),
                         "static star")


def test_static_slots_shrink_as_requests_leave_and_tokens_stay():
    model = tiny_model("llama", seed=2)
    flat = dict(method="star", cp_size=2, block_size=24, simulate=True)
    _shrinking(_engine(model, decode_step="static", **flat), _engine(model, context_cache_mb=0, **flat))


def _shrinking(eng, ref):
    """4 requests of different lengths leave one by one: the slots repack into fewer once twice too many (every
    step computes every slot's row), and the last one out frees them; each request keeps its one-at-a-time tokens."""
    reqs = [(i + 1, 90 + 10 * i, 10 + i, 4, dict(max_new_tokens=2 + 3 * i)) for i in range(4)]
    want = [ref.generate(_ids(cs, cl), _ids(qs, ql), **kw).token_ids for cs, cl, qs, ql, kw in reqs]
    batch = eng.open_batch()
    rids = [batch.add(_ids(cs, cl), _ids(qs, ql), eng.sampling_params(**kw))[0] for cs, cl, qs, ql, kw in reqs]
    static, got, slots = batch._batch.static, {}, []
    while batch.active:
        batch.step()
        for rid in batch.finished:
            got[rid] = batch.pop(rid).token_ids
        slots.append(None if static.slots is None else static.slots.slots)
    assert [got[r] for r in rids] == want
    assert slots[0] == 4 and 1 in slots and slots[-1] is None, slots


def test_compiled_steps_choose_eager_tokens():
    # one compile (torch.compile, inductor on CPU): 4 requests in 4 slots of one capacity, Star over 2 ranks
    model = tiny_model("llama", seed=2)
    flat = dict(method="star", cp_size=2, block_size=24, simulate=True)
    want, _ = _batch_tokens(_engine(model, **flat), steps_between=0)
    got, compiled = _batch_tokens(_engine(model, decode_step="compiled", **flat), steps_between=0)
    assert (compiled.decode_step, compiled.why_not, compiled.static.fallback) == ("compiled", None, None)
    assert compiled.static._compiled is not None and compiled.static.attention == "torch"
    assert got == want


def test_compile_failure_falls_back_to_static_and_says_why(monkeypatch, caplog):
    def broken(fn, **kw):
        def call(*a, **k):
            raise RuntimeError("no compiler here")
        return call

    monkeypatch.setattr(torch, "compile", broken)
    model = tiny_model("qwen3", seed=2)
    want, _ = _batch_tokens(_engine(model, method="dense"))
    with caplog.at_level("WARNING", logger="magnetar.engine.static"):
        got, batch = _batch_tokens(_engine(model, method="dense", decode_step="compiled"))
    assert got == want
    assert batch.static.fallback == "torch.compile failed (RuntimeError: no compiler here)"
    assert "decode steps run static" in caplog.text


def broken_kernel(monkeypatch, cls, method: str, message: str) -> list:
    """``cls.method`` made to raise ``RuntimeError(message)`` -- a kernel failing on a card; the list each call
    appends to."""
    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise RuntimeError(message)

    monkeypatch.setattr(cls, method, staticmethod(broken))
    return calls


@pytest.mark.parametrize("mode", ["static", "graph"])
def test_a_failing_flex_slot_kernel_falls_back_to_torchs_and_says_why(mode, monkeypatch, caplog):
    # the compiled FlexAttention slot kernel (a graph step's on CUDA) failing on a card: the step runs again with
    # torch's slot kernel, says why once, and the tokens stay eager's
    from magnetar.ops.backends.flex import FlexAttentionBackend

    calls = broken_kernel(monkeypatch, FlexAttentionBackend, "slot_forward",
                          "NoValidChoicesError: no kernel lowers here")
    model = tiny_model("llama", seed=2)
    want, _ = _batch_tokens(_engine(model, method="dense"))
    with caplog.at_level("WARNING", logger="magnetar.engine.static"):
        got, batch = _batch_tokens(_engine(model, method="dense", decode_step=mode, attention_backend="flex"))
    assert got == want and len(calls) == 1
    assert batch.static.fallback.startswith("the flex slot kernel failed (RuntimeError: NoValidChoicesError")
    assert caplog.text.count("decode steps use torch's slot kernel") == 1


def test_policies_run_eager_and_say_why():
    model = tiny_model("llama", seed=2)
    for extra, name in ((dict(sparse_policy="quest", sparse_budget=24, page_size=8), "Quest"),
                        (dict(luka_mode="lined", luka_page_size=8, luka_recent=8, luka_compress_every=2), "Luka")):
        flat = dict(method="star", cp_size=2, block_size=24, simulate=True, **extra)
        want, _ = _batch_tokens(_engine(model, **flat))
        got, batch = _batch_tokens(_engine(model, decode_step="compiled", **flat))
        assert got == want and batch.decode_step == "eager" and batch.static is None
        assert "chooses each token's KV per request and step: decode steps run eager" in batch.why_not
        assert name.lower() in batch.why_not.lower()


def test_tensor_parallel_compiled_runs_static():
    class TP:
        tp_size = 2

    assert static_problem("compiled", None, TP()) == ("static", "tensor parallelism's all-reduce inside the layers "
                                                                "is not compiled: decode steps run static (batched, "
                                                                "uncompiled)")
    assert static_problem("static", None, TP()) == ("static", None)
    assert static_problem("compiled", None, local_groups()) == ("compiled", None)
    with pytest.raises(ValueError, match="decode_step.*choose one of eager, static, compiled"):
        magnetar.init_inference(tiny_model("llama"), decode_step="fast")


def test_a_context_kv_not_finite_sends_the_batch_back_to_eager():
    # Mistral's 24-token window: a NaN in the value of the context's first entry is seen by no decode step, so eager
    # decodes as if it were not there; one slot-attention call would multiply it by 0 (NaN): the batch goes eager,
    # keeping the generated KV the slots held so far
    model = tiny_model("mistral", seed=2)
    ctx, q1, q2 = _ids(1, 96), _ids(10, 4), _ids(11, 5)
    ref = _engine(model, method="dense")
    want = [ref.generate(ctx, q, max_new_tokens=6).token_ids for q in (q1, q2)]
    eng = _engine(model, method="dense", decode_step="static")
    batch = eng.open_batch()
    a, _ = batch.add(_ids(2, 70), q1, eng.sampling_params(max_new_tokens=6))  # a clean context: static
    batch.step()
    assert batch._batch.decode_step == "static"
    handle = eng.encode(ctx)
    with torch.inference_mode():  # the KV is made in inference mode
        handle.shard.layers[0].v[0, 0, 0, 0] = float("nan")
    b, _ = batch.add(handle, q2, eng.sampling_params(max_new_tokens=6))
    inner = batch._batch
    assert inner.decode_step == "eager" and inner.static is None
    assert inner.why_not.startswith("a context's KV is not finite (request 1)")
    while batch.active:
        batch.step()
    assert batch.pop(b).token_ids == want[1]
    assert batch.pop(a).token_ids == ref.generate(_ids(2, 70), q1, max_new_tokens=6).token_ids


def _two_rank_worker(rank, world):
    with pytest.MonkeyPatch.context() as mp:  # the CP gather and merge inside a step: no host sync either
        _no_sync_in_steps(mp)
        _two_rank_checks(rank)


def _two_rank_checks(rank):
    model = tiny_model("qwen3", seed=3)
    flat = dict(method="pulsar", cp_size=2, sink_size=4, chunk_size=8, summary_budget=0.25)
    _interleaved_against(_engine(model, decode_step="static", **flat), _engine(model, context_cache_mb=0, **flat),
                         f"[rank {rank}] static pulsar")
    # the slots repack alike on both ranks (the gathered rows stay the same requests)
    _shrinking(_engine(model, decode_step="static", **flat), _engine(model, context_cache_mb=0, **flat))


def test_static_steps_on_two_ranks():
    run_distributed(_two_rank_worker, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["static", "compiled"])
def test_decode_steps_on_cuda(arch, mode, monkeypatch):
    # fp32 on the GPU: static (math) and compiled (CUDA graphs, FlexAttention over the slots) choose eager's tokens;
    # a static step runs under the driver's sync debug mode "error" (magnetar.utils.sync.host_syncs)
    model = tiny_model(arch, seed=2)
    if mode == "static":
        _no_sync_in_steps(monkeypatch)
    flat = dict(method="star", cp_size=2, block_size=24, simulate=True, deepspeed_inference=False)
    want, _ = _batch_tokens(_engine(model, **flat), steps_between=0)
    got, batch = _batch_tokens(_engine(model, decode_step=mode, **flat), steps_between=0)
    assert batch.decode_step == mode and batch.static.slots.k[0].is_cuda
    if mode == "compiled" and arch == "llama":
        assert batch.static.fallback is None and batch.static.attention == "flex"
    assert got == want, f"{arch} {mode} (fallback: {batch.static.fallback})"


def test_static_logits_check_follows_check_finite(monkeypatch):
    # as eager steps: non-finite logits raise only under runtime.check_finite (off: the run decodes on, unchecked);
    # the check rides on the step's one read of the device (the tokens')
    from magnetar.engine.finite import NonFiniteError
    from magnetar.engine.static import StaticDecode

    model = tiny_model("llama")
    monkeypatch.setattr(StaticDecode, "_run", lambda self, ids, *a: torch.full((ids.shape[0], 256), float("nan")))
    for check in (True, False):  # Engine.generate's batch (not isolated: non-finite logits raise)
        eng = _engine(model, method="dense", decode_step="static", check_finite=check)
        if check:
            with pytest.raises(NonFiniteError, match=r"non-finite logits in Phase 2 \(decode step 1; static decode"):
                eng.generate(_ids(1, 40), _ids(2, 3), max_new_tokens=4)
        else:
            assert len(eng.generate(_ids(1, 40), _ids(2, 3), max_new_tokens=4).token_ids) == 4
    # a served batch (isolated): the request fails alone, saying so
    eng = _engine(model, method="dense", decode_step="static")
    batch = eng.open_batch()
    rid, _ = batch.add(_ids(1, 40), _ids(2, 3), eng.sampling_params(max_new_tokens=4))
    [event] = batch.step()
    assert event.rid == rid and event.stop_reason == "nonfinite" and "static decode step" in event.error
    assert StaticDecode(model, local_groups(), "cpu", "static", pages=lambda *a: None)._model_heads() == (2, 16)


def _no_sync_in_steps(monkeypatch):
    """Every static step's device part (StaticDecode._run: the forward over the slots, the contexts read through a
    pointer table, the CP gather and merge) runs where a host synchronization raises. The context part is the
    pointer table's, as on CUDA (there Triton's kernel; here the torch one over the same table): read as pages -- the
    CPU's uncaptured steps -- it reads the device on the host as an eager step does."""
    from magnetar.engine import static
    from magnetar.utils.sync import host_syncs

    run, pick = static.StaticDecode._run, static.pointer_backend
    monkeypatch.setattr(static, "pointer_backend", lambda name, device, required: pick(name, device, True))

    def guarded(self, *args, **kwargs):
        with host_syncs("error"):
            return run(self, *args, **kwargs)

    monkeypatch.setattr(static.StaticDecode, "_run", guarded)


def test_a_static_step_never_waits_for_the_device_and_a_batch_step_reads_it_once(monkeypatch):
    # issue 47: nothing inside a step synchronizes with the host (.item(), .tolist(), .cpu(), bool(t), nonzero, a
    # boolean-mask index raise there; on CUDA the driver's sync debug mode too), for every layout, with requests
    # joining and leaving, greedy and sampled; a step of greedy and sampled requests then reads the device ONCE (their
    # tokens and finite flags together), where it read once per request and once more for the check
    from magnetar.utils.sync import HostSyncError, host_syncs

    with pytest.raises(HostSyncError, match=r"host synchronization \(item\)"):
        with host_syncs("error"):
            torch.ones(2).sum().item()
    with host_syncs("count") as seen:
        t = torch.arange(4)
        t[t > 1], bool(t.sum()), t.to(torch.float32) + 1  # noqa: B018 -- only the first two read the device
    assert seen.calls == ["boolean-mask index", "bool"]
    _no_sync_in_steps(monkeypatch)
    model = tiny_model("llama", seed=2)
    for label, flat in LAYOUTS:
        want, _ = _batch_tokens(_engine(model, **flat))
        got, batch = _batch_tokens(_engine(model, decode_step="static", **flat))
        assert batch.decode_step == "static" and got == want, label
    eng = _engine(model, method="dense", decode_step="static")
    batch = eng.open_batch()
    for i in range(3):
        batch.add(_ids(i, 50 + 10 * i), _ids(10 + i, 4), eng.sampling_params(max_new_tokens=4))
    for i, extra in enumerate((dict(top_p=0.9), dict(top_k=20))):  # sampled ones are drawn on the device too
        batch.add(_ids(3 + i, 60), _ids(13 + i, 4), eng.sampling_params(max_new_tokens=4, temperature=0.8, seed=i,
                                                                         **extra))
    for _ in range(2):
        with host_syncs("count") as seen:
            batch.step()
        assert seen.calls == ["tolist"], seen.calls


def test_design_doc_attention_backend_runs_the_decode_step(tmp_path, monkeypatch):
    """docs/design.md's example attention backend, taken from the doc as written and registered with its one line:
    a static decode step runs its slot kernel (and Phase 1 / the query its ``forward``), choosing eager's tokens."""
    import re
    from pathlib import Path

    from magnetar.ops import backends

    doc = (Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, re.S)
    code = next(b for b in blocks if b.startswith("# magnetar/ops/backends/exact64.py"))
    line = next(b for b in blocks if b.startswith("# magnetar/ops/backends/__init__.py")).splitlines()[1]
    (tmp_path / "exact64_plugin.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert line == 'register_backend("exact64", _lazy(".exact64", "Exact64Backend"))'
    monkeypatch.setitem(backends._REGISTRY, "exact64", lambda: __import__("exact64_plugin").Exact64Backend())
    monkeypatch.delitem(backends._INSTANCES, "exact64", raising=False)
    calls = {"forward": 0, "slot_forward": 0}
    plugin = backends.get_backend("exact64")
    for name in calls:
        inner = getattr(plugin, name)

        def counted(*a, _inner=inner, _name=name, **kw):
            calls[_name] += 1
            return _inner(*a, **kw)
        monkeypatch.setattr(plugin, name, counted)
    assert "exact64" in slot_backends() and slot_backend("exact64", "cpu", compiled=False) is plugin
    # no slot kernel: auto's choice (on a CPU, cpu_decode's masked pass where its op runs)
    assert slot_backend("cpu_flash", "cpu", compiled=False) is slot_backend("auto", "cpu", compiled=False)
    model = tiny_model("llama", seed=2)
    want, _ = _batch_tokens(_engine(model))
    got, static = _batch_tokens(_engine(model, decode_step="static", attention_backend="exact64"))
    assert static.static.attention == "exact64" and calls["slot_forward"] > 0 and calls["forward"] > 0
    assert got == want
