"""Paged decode attention (magnetar.ops.pages, cpu_decode's ``decode_attention_pages``): an eager decode step's batch in
one launch a layer -- each request's rows over its KV pages (its context, its own tokens) -- against the fp64
reference over the pages joined; None (the caller's per-part path, which keeps the exact non-finite rules) for what the
kernel cannot take and for any value that is not finite; PageByPage (a backend without paged calls: its kernel a page,
one finite check) against the same reference and rules; and Phase 2 taking a paged call exactly where the host knows
which keys the token sees, with the per-part path's states and tokens."""
from __future__ import annotations

import pytest
import torch

import magnetar.engine.phase2 as phase2
from magnetar.engine.phase2 import Phase2Context
from magnetar.ops.pages import Page, PageByPage, attend_pages, page_backend
from magnetar.ops.slots import slot_backend
from magnetar.parallel import local_groups
from tests.conftest import assert_close
from tests.reference import dense_attention_fp64
from tests.test_cpu_decode import DTYPE_PASSES, RUNS, on_pass  # noqa: F401 (on_pass: a fixture used below)
from tests.test_phase2_shared import HKV, HQ, D, L, _shard
from tests.test_static_decode import LAYOUTS, _batch_tokens, _engine
from tests.tiny_models import ARCHS, tiny_model

needs_kernel = pytest.mark.skipif(not RUNS, reason="the kernel needs x86-64 with AVX2 and FMA (elsewhere auto goes "
                                                   "page by page: tested below)")


def _pages(g, Hkv, D, dtype, lengths, capacity=0):
    """A request's pages of ``lengths`` keys, each a view of a buffer ``capacity`` entries longer (a KV store's)."""
    out = []
    for n in lengths:
        k, v = (torch.randn(1, Hkv, n + capacity, D, generator=g).to(dtype)[:, :, :n] for _ in range(2))
        out.append(Page(k, v))
    return out


def _reference(q, pages, scale):
    """fp64 (out, lse) of each request's rows over its pages joined (every key visible); no page: (0, -inf)."""
    outs, lses = [], []
    for b, request in enumerate(pages):
        if not request:
            outs.append(torch.zeros_like(q[b:b + 1], dtype=torch.float64))
            lses.append(torch.full(q[b:b + 1].shape[:3], float("-inf"), dtype=torch.float64))
            continue
        k, v = torch.cat([p[0] for p in request], 2), torch.cat([p[1] for p in request], 2)
        o, lse = dense_attention_fp64(q[b:b + 1], k, v, causal=False, scale=scale)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


@needs_kernel
@pytest.mark.parametrize("dtype,kernel_pass", DTYPE_PASSES)
@pytest.mark.parametrize("group,S", [(1, 1), (3, 1), (8, 1), (2, 4)])
@pytest.mark.usefixtures("on_pass")
def test_paged_calls_equal_the_fp64_reference(dtype, group, S, seeded):
    # pages across the kernel's 128-key blocks, views of longer buffers, an empty page (skipped), a request without
    # pages ((0, -inf)), and one whose later page holds the largest logits (the running max moves between pages)
    Hkv, D = 2, 64
    lengths = [[300, 5], [1], [], [128, 0, 129], [40, 700]]
    pages = [_pages(seeded, Hkv, D, dtype, n, capacity=17) for n in lengths]
    pages[4][1][0].mul_(3)
    q = torch.randn(len(pages), group * Hkv, S, D, generator=seeded).to(dtype)
    out, lse = attend_pages(q, pages, 0.125)
    want_out, want_lse = _reference(q, pages, 0.125)
    assert out.dtype == dtype and out.shape == q.shape and lse.dtype == torch.float32
    assert_close(out, want_out, dtype, "out")
    assert_close(lse, want_lse, dtype, "lse")
    assert torch.equal(lse[2], torch.full_like(lse[2], float("-inf"))) and not out[2].any()


@needs_kernel
@pytest.mark.parametrize("where", ["q", "k", "v", "k inf"])
@pytest.mark.parametrize("dtype,kernel_pass", DTYPE_PASSES)
@pytest.mark.usefixtures("on_pass")
def test_a_value_that_is_not_finite_gives_the_per_part_path(where, dtype, seeded):
    # the kernel's clean flag: any non-finite score or output element -> None, so the caller applies the exact rules
    pages = [_pages(seeded, 2, 64, dtype, [50, 3]) for _ in range(3)]
    q = torch.randn(3, 6, 1, 64, generator=seeded).to(dtype)
    assert attend_pages(q, pages, 0.125) is not None
    t = {"q": q, "k": pages[1][1][0], "v": pages[1][0][1], "k inf": pages[2][0][0]}[where]
    t[0, 1, 0, 7] = float("inf") if where == "k inf" else float("nan")
    assert attend_pages(q, pages, 0.125) is None


@needs_kernel
def test_what_the_kernel_cannot_take_gives_the_per_part_path(seeded):
    pages = [_pages(seeded, 2, 64, torch.float32, [50, 3]) for _ in range(2)]
    q = torch.randn(2, 6, 1, 64, generator=seeded)
    assert attend_pages(q, pages, 0.125) is not None
    assert attend_pages(torch.randn(2, 6, 3, 64, generator=seeded), pages, 0.125) is None  # 9 rows per KV head
    assert attend_pages(q.double(), [[Page(k.double(), v.double()) for k, v, _ in p] for p in pages], 0.125) is None
    mixed = [pages[0], [Page(pages[1][0].k.bfloat16(), pages[1][0].v.bfloat16())]]
    assert attend_pages(q, mixed, 0.125) is None  # a page of another dtype
    strided = [pages[0], [Page(k.transpose(2, 3).contiguous().transpose(2, 3), v) for k, v, _ in pages[1]]]
    assert attend_pages(q, strided, 0.125) is None  # not contiguous along D
    assert attend_pages(q, [[], []], 0.125) is None  # nothing to read
    with pytest.raises(ValueError, match="one list of"):
        attend_pages(q, pages[:1], 0.125)


def test_page_backend_is_cpu_decode_where_its_op_runs_else_page_by_page():
    backend = page_backend("auto", torch.device("cpu"))
    assert isinstance(backend, PageByPage) != RUNS and (backend.name == "cpu_decode") == RUNS
    assert page_backend("cpu_decode", torch.device("cpu")).name == "cpu_decode"
    for name in ("cpu_flash", "torch"):  # a named backend without paged calls: its kernel page by page
        assert isinstance(page_backend(name, torch.device("cpu")), PageByPage)
        assert page_backend(name, torch.device("cpu")).backend == name
    # CUDA without a card to run Triton's kernel on (here): auto's kernels page by page; on a card triton_decode
    # (tests/test_pointer_attention.py's gpu test)
    cuda = page_backend("auto", torch.device("cuda"))
    assert isinstance(cuda, PageByPage) and cuda.backend == "auto"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["cpu_flash", "torch", "tiled"])
def test_page_by_page_equals_the_fp64_reference(dtype, backend, seeded):
    # each page one FULL call of the backend, a request's pages merged (every request two: ONE merge for the batch;
    # counts that differ: a merge each), a request without pages the empty state; pages whose keys are known finite
    Hkv, D = 2, 64
    for lengths in ([[300, 5], [40, 7], [1, 128]], [[300, 5], [1], [], [128, 0, 129]]):
        pages = [[Page(k, v, k_finite=i == 0) for i, (k, v, _) in enumerate(_pages(seeded, Hkv, D, dtype, n, 17))]
                 for n in lengths]
        q = torch.randn(len(pages), 3 * Hkv, 1, D, generator=seeded).to(dtype)
        out, lse = attend_pages(q, pages, 0.125, backend=backend)
        want_out, want_lse = _reference(q, pages, 0.125)
        assert out.dtype == dtype and out.shape == q.shape and lse.dtype == torch.float32
        assert_close(out, want_out, dtype, "out", f"{backend} {lengths}")
        assert_close(lse, want_lse, dtype, "lse", f"{backend} {lengths}")


@pytest.mark.parametrize("where", ["q", "k", "v", "k inf", "k -inf", "known-finite page's v"])
def test_page_by_page_gives_the_per_part_path_for_a_value_that_is_not_finite(where, seeded):
    # "k -inf": every row reading it has q > 0 there, so its score is -inf and the kernel's output stays finite -- the
    # rule (a non-finite key makes the rows that see it NaN) needs the keys read
    pages = [[Page(k, v, k_finite=i == 0) for i, (k, v, _) in enumerate(_pages(seeded, 2, 64, torch.float32, [50, 3]))]
             for _ in range(3)]
    q = torch.randn(3, 6, 1, 64, generator=seeded)
    q[..., 7] = q[..., 7].abs() + 0.1
    assert attend_pages(q, pages, 0.125, backend="cpu_flash") is not None
    t = {"q": q, "k": pages[1][1].k, "v": pages[1][1].v, "k inf": pages[2][1].k, "k -inf": pages[2][1].k,
         "known-finite page's v": pages[0][0].v}[where]
    t[0, 1, 0, 7] = {"k inf": float("inf"), "k -inf": float("-inf")}.get(where, float("nan"))
    assert attend_pages(q, pages, 0.125, backend="cpu_flash") is None


def _step(seeded, monkeypatch, *, starts=True, context_start=0, window=None, nan=False, gapped=False):
    """One layer of a decode step of three requests over distinct contexts through Phase2Context.attend; returns
    (out, the attention_with_lse calls it made, the positions, the shards, the stores of own tokens, q). ``gapped``:
    request 1's context at every other position (Star's anchor and block, Pulsar's summaries keep theirs)."""
    shards = [_shard(seeded, L + 9 * b, context_start).view() for b in range(3)]
    if gapped:
        shards[1].layers[0].pos = torch.arange(L + 9) * 2 - L - 9
    gens = [_shard(seeded, 2 + b, L + 9 * b) for b in range(3)]
    positions = torch.tensor([[L + 9 * b + 2 + b] for b in range(3)])  # each request's new token, after its own
    q = torch.randn(3, HQ, 1, D, generator=seeded)
    k, v = torch.randn(3, HKV, 1, D, generator=seeded), torch.randn(3, HKV, 1, D, generator=seeded)
    if nan:
        v[1, 0, 0, 3] = float("nan")  # request 1's new token's value: its rows of KV head 0 turn NaN
    calls = []
    real = phase2.attention_with_lse
    monkeypatch.setattr(phase2, "attention_with_lse", lambda *a, **kw: calls.append(a[1].shape) or real(*a, **kw))
    ctx = Phase2Context(positions, shards, gens, [1, 1, 1], local_groups(), "auto",
                        starts=positions[:, 0].tolist() if starts else None)
    out = ctx.attend(0, q, k, v, scale=D ** -0.5, window=window)
    return out, calls, positions, shards, gens, q


def _want(b, positions, shards, gens, q, window=None):
    c, g = shards[b].layers[0], gens[b].layers[0]  # g holds the new token now (appended by attend)
    keys, values, pos = torch.cat((c.k, g.k), 2), torch.cat((c.v, g.v), 2), torch.cat((c.pos, g.pos))
    if window is not None:
        keep = pos > positions[b, 0] - window
        keys, values, pos = keys[:, :, keep], values[:, :, keep], pos[keep]
    return dense_attention_fp64(q[b:b + 1], keys, values, q_pos=positions[b], k_pos=pos, scale=D ** -0.5)[0]


@needs_kernel
@pytest.mark.parametrize("window", [None, 30, 4, 1])
def test_a_decode_step_reads_each_requests_pages_in_one_call(window, seeded, monkeypatch):
    # under a sliding window, the part of each store the window keeps: a context's last keys (30), only own tokens (4:
    # request 2's five own tokens cut too), the token alone (1)
    out, calls, positions, shards, gens, q = _step(seeded, monkeypatch, window=window)
    assert calls == []  # no per-part call: the batch went to the paged kernel
    assert all(gens[b].tokens() == 3 + b for b in range(3))  # the new token stored once
    for b in range(3):
        assert_close(out[b:b + 1], _want(b, positions, shards, gens, q, window).float(), torch.float32, "out",
                     f"window {window}: request {b}")


@pytest.mark.parametrize("window", [None, 30, 4, 1])
def test_without_paged_calls_a_decode_step_makes_full_calls_over_the_keys_it_sees(window, seeded, monkeypatch):
    # a backend without pages (every CUDA one today): each request's two calls are over the keys its token sees, of
    # the FULL kind without positions -- the front end reads none of them to classify a call (a host synchronization
    # each on a GPU) -- with the same states
    monkeypatch.setattr(phase2, "attend_pages", lambda *a, **kw: None)
    seen = []
    real = phase2.attention_with_lse

    def spy(q, k, v, **kw):
        seen.append((kw.get("causal", True), kw.get("q_pos"), kw.get("window")))
        return real(q, k, v, **kw)

    monkeypatch.setattr(phase2, "attention_with_lse", spy)
    out, _, positions, shards, gens, q = _step(seeded, monkeypatch, window=window)
    assert len(seen) == 6 and all(c == (False, None, None) for c in seen), seen
    for b in range(3):
        assert_close(out[b:b + 1], _want(b, positions, shards, gens, q, window).float(), torch.float32, "out",
                     f"window {window}: request {b}")


@needs_kernel
@pytest.mark.parametrize("paged", [True, False])
def test_requests_on_a_shared_context_read_only_their_own_tokens_as_pages(paged, seeded, monkeypatch):
    # requests 0 and 2 ask about one document (Phase2Context._shared_context: one call over it for both); the paged
    # call then holds their own tokens only -- and request 1's context and own tokens --, each merged with its part.
    # Without paged calls, every call -- the shared one too -- is of the FULL kind, without positions
    monkeypatch.setattr(phase2, "SHARED_MIN_KEYS", L)  # a document of L keys counts as long here
    if not paged:
        monkeypatch.setattr(phase2, "attend_pages", lambda *a, **kw: None)
    doc, other = _shard(seeded, L), _shard(seeded, L + 9)
    shards = [doc.view(), other.view(), doc.view()]
    gens = [_shard(seeded, n, start) for n, start in ((3, L), (5, L + 9), (7, L))]
    positions = torch.tensor([[L + 3], [L + 14], [L + 7]])
    q = torch.randn(3, HQ, 1, D, generator=seeded)
    k, v = torch.randn(3, HKV, 1, D, generator=seeded), torch.randn(3, HKV, 1, D, generator=seeded)
    calls = []
    real = phase2.attention_with_lse
    monkeypatch.setattr(phase2, "attention_with_lse",
                        lambda *a, **kw: calls.append((a[1].shape, kw.get("causal", True))) or real(*a, **kw))
    ctx = Phase2Context(positions, shards, gens, [1, 1, 1], local_groups(), "auto", starts=positions[:, 0].tolist())
    out = ctx.attend(0, q, k, v, scale=D ** -0.5)
    if paged:  # the shared document's one call; the rest paged
        assert calls == [(torch.Size([1, HKV, L, D]), False)], calls
    else:  # that call, request 1's context, each request's own tokens
        assert len(calls) == 5 and not any(causal for _, causal in calls), calls
    for b in range(3):
        assert gens[b].tokens() == (4, 6, 8)[b]
        assert_close(out[b:b + 1], _want(b, positions, shards, gens, q).float(), torch.float32, "out", f"request {b}")


@needs_kernel
@pytest.mark.parametrize("why", ["no starts", "gapped positions under a window", "a key after the token", "a NaN"])
def test_phase2_takes_the_per_part_path_where_pages_would_not_hold(why, seeded, monkeypatch):
    kw = {"no starts": {"starts": False}, "gapped positions under a window": {"window": 30, "gapped": True},
          "a key after the token": {"context_start": L + 30}, "a NaN": {"nan": True}}[why]
    out, calls, positions, shards, gens, q = _step(seeded, monkeypatch, **kw)
    assert len(calls) == 6, calls  # a context call and an own-token call per request
    assert all(gens[b].tokens() == 3 + b for b in range(3))  # stored once, also after the paged call said None
    for b in range(3):
        want = _want(b, positions, shards, gens, q, kw.get("window"))
        if why == "a NaN" and b == 1:  # the exact rule: the rows reading the NaN value are NaN, the others not
            assert torch.isnan(out[1, :3]).all() and torch.isfinite(out[1, 3:]).all()
            continue
        rows = out[b:b + 1]
        if why == "a key after the token":  # the context's keys follow the token: only its own tokens are visible
            assert torch.isfinite(rows).all()
        assert_close(rows, want.float(), torch.float32, "out", f"{why}: request {b}")


@needs_kernel
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("label,flat", LAYOUTS[:2], ids=[x[0] for x in LAYOUTS[:2]])
def test_eager_steps_over_pages_choose_the_per_part_paths_tokens(arch, label, flat, monkeypatch):
    # the engine's eager decode steps (a batch joining and leaving) take the paged call and choose the tokens the
    # per-part path (two calls and a merge per request) chooses -- windowed layers too (Gemma-3's local ones, every one
    # of Mistral's): their pages are what the window keeps
    model = tiny_model(arch, seed=2)
    paged = []
    real = phase2.attend_pages
    monkeypatch.setattr(phase2, "attend_pages", lambda *a, **kw: paged.append(real(*a, **kw)) or paged[-1])
    got, batch = _batch_tokens(_engine(model, **flat))
    assert batch.decode_step == "eager" and paged and all(r is not None for r in paged), f"{arch} {label}"
    monkeypatch.setattr(phase2, "attend_pages", lambda *a, **kw: None)
    want, _ = _batch_tokens(_engine(model, **flat))
    assert got == want, f"{arch} {label}"


@needs_kernel
def test_an_eager_step_over_pages_reads_the_device_once(monkeypatch):
    # the per-part path read the device twice a call (the mask's classification, the finite check) and once more for
    # the tokens; a paged step reads it once: the batch's tokens and finite flags (each context's last position is
    # read at its first step and remembered)
    from magnetar.utils.sync import host_syncs
    from tests.test_continuous_batch import _ids

    eng = _engine(tiny_model("llama", seed=2), method="dense")
    batch = eng.open_batch()
    for i in range(3):
        batch.add(_ids(i, 50 + 10 * i), _ids(10 + i, 4), eng.sampling_params(max_new_tokens=5))
    batch.step()
    for _ in range(2):
        with host_syncs("count") as seen:
            batch.step()
        assert seen.calls == ["tolist"], seen.calls


@needs_kernel
def test_the_paged_call_is_an_attention_range_inside_the_layers(monkeypatch):
    # docs/profiling.md: every attention kernel call is a magnetar/attention/{backend} range (Nsight, the kit's ncu
    # step, benchmarks/profile_decode.py's split) -- the paged one too, inside its layer's range
    from torch.profiler import ProfilerActivity, profile

    from tests.test_continuous_batch import _ids

    eng = _engine(tiny_model("llama", seed=2), method="dense")
    batch = eng.open_batch()
    for i in range(2):
        batch.add(_ids(i, 50), _ids(10 + i, 4), eng.sampling_params(max_new_tokens=4))
    batch.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        batch.step()
    ranges = [e for e in prof.events() if e.name == "magnetar/attention/cpu_decode"]
    assert len(ranges) == 2, [e.name for e in prof.events() if e.name.startswith("magnetar/")]  # one a layer
    assert all(e.cpu_parent is not None and e.cpu_parent.name.startswith("magnetar/phase2/layer") for e in ranges)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_backend_without_paged_calls_serves_eager_steps_page_by_page(arch, monkeypatch):
    # attention_backend "cpu_flash" (as every CUDA backend today): the decode steps make no attention_with_lse call --
    # PageByPage calls the kernel per page and checks the batch once -- and choose the per-part path's tokens
    model = tiny_model(arch, seed=2)
    calls = []
    real = phase2.attention_with_lse
    monkeypatch.setattr(phase2, "attention_with_lse", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    got, batch = _batch_tokens(_engine(model, method="dense", attention_backend="cpu_flash"))
    assert calls and all(shape[2] > 1 for shape in calls), calls  # only the queries' forwards (S > 1)
    monkeypatch.setattr(phase2, "attend_pages", lambda *a, **kw: None)
    want, _ = _batch_tokens(_engine(model, method="dense", attention_backend="cpu_flash"))
    assert got == want, arch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_page_by_page_on_cuda(dtype, seeded, monkeypatch):
    # auto on CUDA: PageByPage over the card's kernels (flash / cuDNN for bf16, flex / tiled for fp32) against the fp64
    # reference; then the engine's eager steps on the card choose the per-part path's tokens with one host read a layer
    from magnetar.utils.sync import host_syncs

    pages = [[Page(k.cuda(), v.cuda(), k_finite=i == 0)
              for i, (k, v, _) in enumerate(_pages(seeded, 2, 64, dtype, n, 9))] for n in ([700, 5], [129, 1], [])]
    q = torch.randn(3, 6, 1, 64, generator=seeded).to(dtype).cuda()
    assert isinstance(page_backend("auto", q.device), PageByPage)
    out, lse = attend_pages(q, pages, 0.125)
    want_out, want_lse = _reference(q.cpu(), [[Page(p.k.cpu(), p.v.cpu()) for p in r] for r in pages], 0.125)
    assert_close(out.cpu(), want_out, dtype, "out", "cuda")
    assert_close(lse.cpu(), want_lse, dtype, "lse", "cuda")
    model = tiny_model("llama", seed=2)
    got, batch = _batch_tokens(_engine(model, method="dense", deepspeed_inference=False))
    assert torch.device(batch.device).type == "cuda"
    eng = _engine(model, method="dense", deepspeed_inference=False)
    b = eng.open_batch()
    for i in range(2):
        b.add(torch.randint(0, 256, (60,), generator=seeded), torch.randint(0, 256, (4,), generator=seeded),
              eng.sampling_params(max_new_tokens=4))
    b.step()
    with host_syncs("count") as seen:
        b.step()
    assert len(seen.calls) <= model.config.num_hidden_layers + 1, seen.calls  # one a layer, one for the tokens
    monkeypatch.setattr(phase2, "attend_pages", lambda *a, **kw: None)
    want, _ = _batch_tokens(_engine(model, method="dense", deepspeed_inference=False))
    assert got == want


@pytest.mark.parametrize("order,paged", [("cpu_flash", False), ("cpu_decode,cpu_flash", True),
                                         ("flash_attn,cpu_flash", False), ("flash_attn,sdpa_flash", True)])
def test_auto_pages_follow_the_users_attention_order(order, paged, monkeypatch):
    # MAGNETAR_ATTENTION_ORDER puts its backends first for auto: where its first one serving the CPU is not
    # cpu_decode, an eager step's batch goes page by page over auto's choices (which follow the order), not to
    # cpu_decode's paged kernel; CUDA-only names do not count on a CPU
    monkeypatch.setenv("MAGNETAR_ATTENTION_ORDER", order)
    backend = page_backend("auto", torch.device("cpu"))
    assert isinstance(backend, PageByPage) == (not (paged and RUNS)), (order, backend.name)


@pytest.mark.parametrize("order,slot", [("cpu_flash", "torch"), ("cpu_decode,cpu_flash", "cpu_decode"),
                                        ("flash_attn,tiled", "torch"), ("flash_attn,sdpa_flash", "cpu_decode"),
                                        ("flex,cpu_decode", "flex"), ("torch", "torch")])
def test_auto_slots_follow_the_users_attention_order(order, slot, monkeypatch):
    # the static step's kernel follows the order as the eager step's paged calls do: its first backend serving the
    # CPU, if not cpu_decode, runs the slots -- through its own slot kernel, else torch's float32 math
    monkeypatch.setenv("MAGNETAR_ATTENTION_ORDER", order)
    want = slot if slot != "cpu_decode" or RUNS else "torch"
    assert slot_backend("auto", "cpu", compiled=False).name == want, order
    assert slot_backend("auto", "cpu", compiled=True).name == "torch"  # compiled on a CPU: the compiler's math
