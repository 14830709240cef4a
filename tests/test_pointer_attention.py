"""A decode step's context part read through a table of addresses (magnetar.ops.pointers): the table, the torch
kernel every device runs and the Triton kernel a CUDA step (and its graph) runs -- each against the fp64 reference --
and the same Triton kernel serving an eager step's pages (magnetar.ops.pages), with the non-finite rule of
magnetar.ops.nonfinite applied in the kernel (row by row against the front end's) and its fallback when it fails.

The Triton kernel runs here through Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors, a process of its own;
float32 and float16: the interpreter computes bf16 dot products wrongly) and is compiled for sm_90 with Triton's own
ptxas (no card needed), where the ``triton`` package is installed (the test extra); on a card it runs in the GPU
kit's ``gpu`` tests (bf16 too, and replayed in a CUDA graph whose table changes between replays)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from magnetar.ops.backends import get_backend
from magnetar.ops.pointers import PAGES, PointerTable, pointer_backend
from tests.conftest import assert_close
from tests.reference import dense_attention_fp64

REPO = Path(__file__).resolve().parents[1]
HQ, HKV, D, LAYERS = 4, 2, 32, 2
CUDA = torch.cuda.is_available()


def _rows(dtype, device="cpu", seed=0):
    """Four rows' pieces per layer -- a context in an arena buffer with room to spare (its head stride is the
    buffer's), a fork (a document's piece, then its own), nothing (an idle slot), a shard at gapped positions (an
    anchor block, then its own block; Star's) cut to its last keys -- and each row's query position."""
    g = torch.Generator().manual_seed(seed)

    def kv(n, cap=None):
        cap = cap or n
        k = torch.randn(1, HKV, cap, D, generator=g).to(dtype).to(device)[:, :, :n]
        v = torch.randn(1, HKV, cap, D, generator=g).to(dtype).to(device)[:, :, :n]
        return k, v

    arena = (*kv(150, cap=300), torch.arange(150, device=device))
    doc = (*kv(100), torch.arange(100, device=device))
    turn = (*kv(37), torch.arange(100, 137, device=device))
    k, v = kv(90)
    star = (k[:, :, 10:], v[:, :, 10:], torch.cat((torch.arange(16), torch.arange(400, 474))).to(device)[10:])
    rows = [[arena], [doc, turn], [], [star]]
    return rows, torch.tensor([[150], [137], [0], [480]], device=device)


def _table(rows, device="cpu") -> PointerTable:
    table = PointerTable(LAYERS, len(rows) + 1, PAGES, HKV, device)
    for r, pieces in enumerate(rows):
        if pieces:
            table.put(r, [pieces] * LAYERS)
    table.sync()
    return table


def _want(q, q_pos, rows, window=None):
    """fp64: each row over the concatenation of its pieces, the keys a window keeps."""
    outs, lses = [], []
    for b, pieces in enumerate(rows):
        if not pieces:
            outs.append(torch.zeros(1, HQ, 1, D, dtype=torch.float64))
            lses.append(torch.full((1, HQ, 1), float("-inf"), dtype=torch.float64))
            continue
        k = torch.cat([p[0] for p in pieces], dim=2).cpu()
        v = torch.cat([p[1] for p in pieces], dim=2).cpu()
        pos = torch.cat([p[2] for p in pieces]).cpu()
        qp = int(q_pos[b, 0])
        keep = pos > qp - window if window is not None else torch.ones_like(pos, dtype=torch.bool)
        o, lse = dense_attention_fp64(q[b:b + 1].cpu(), k[:, :, keep], v[:, :, keep], q_pos=torch.tensor([qp]),
                                      k_pos=pos[keep], scale=0.2)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def _check(backend, dtype, window, device="cpu"):
    rows, q_pos = _rows(dtype, device)
    table = _table(rows, device)
    q = torch.randn(len(rows), HQ, 1, D, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    out, lse = backend.pointers_forward(q, q_pos, table, 1, 0.2, window)
    want_out, want_lse = _want(q, q_pos, rows, window)
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == (len(rows), HQ, 1, D)
    assert_close(out.cpu(), want_out, dtype, "out", f"{backend.name} window {window}")
    assert_close(lse.cpu(), want_lse, dtype, "lse", f"{backend.name} window {window}")
    assert (out[2] == 0).all() and (lse[2] == float("-inf")).all()  # an idle slot's row: the empty state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 40])
def test_torch_kernel_against_the_reference(dtype, window):
    _check(get_backend("torch"), dtype, window)


def interpreter_checks() -> None:
    """The Triton kernel against the reference under Triton's interpreter: run in a process of its own whose
    ``TRITON_INTERPRET=1`` was set before Triton was imported (the interpreter takes over ``triton.jit`` at import;
    this process may have imported Triton already)."""
    triton = get_backend("triton_decode")
    for dtype in (torch.float32, torch.float16):
        for window in (None, 40):
            _check(triton, dtype, window)
    # the table changes on the host between calls: the kernel reads what the device copy says now
    rows, q_pos = _rows(torch.float32)
    table = _table(rows)
    q = torch.randn(4, HQ, 1, D, generator=torch.Generator().manual_seed(2))
    first = triton.pointers_forward(q, q_pos, table, 0, 0.2)
    table.put(2, [rows[0]] * LAYERS)  # the idle row now reads the arena's context
    table.clear(0)
    table.sync()
    out, lse = triton.pointers_forward(q, q_pos, table, 0, 0.2)
    assert (out[0] == 0).all() and (lse[0] == float("-inf")).all()
    want_out, want_lse = _want(q[2:3], q_pos[2:3], [rows[0]])  # at position 0: the arena's first key alone
    assert_close(out[2:3], want_out, torch.float32, "out")
    assert_close(lse[2:3], want_lse, torch.float32, "lse")
    assert torch.equal(out[1], first[0][1]) and torch.equal(out[3], first[0][3])
    _pages_checks(triton)
    _nonfinite_checks(triton)
    print("interpreter checks passed")


def _pages_checks(triton, dtypes=(torch.float32, torch.float16), device="cpu") -> None:
    """An eager step's pages (every key visible) in one launch, against the fp64 reference over each row's pages."""
    from magnetar.ops.pages import Page

    for dtype in dtypes:
        rows, _ = _rows(dtype, device)
        q = torch.randn(4, HQ, 1, D, generator=torch.Generator().manual_seed(3)).to(dtype).to(device)
        pages = [[Page(k, v) for k, v, _ in pieces] for pieces in rows]
        out, lse = triton.pages_forward(q, pages, 0.2)
        far = torch.tensor([[10 ** 6]] * 4)  # every key visible
        want_out, want_lse = _want(q, far, rows)
        assert_close(out.cpu(), want_out, dtype, "out", "pages")
        assert_close(lse.cpu(), want_lse, dtype, "lse", "pages")
    assert triton.pages_forward(q[:, :, :0], pages, 0.2) is None  # no query token: not its call
    assert triton.pages_forward(q, [[], [], [], []], 0.2) is None  # no page at all: the caller's path
    if device == "cpu":  # a kernel failing on a card: said once, its calls page by page from then on
        from magnetar.ops.backends.triton_decode import TritonDecodeBackend

        broken = TritonDecodeBackend()

        def fail(*a, **k):
            raise RuntimeError("CompilationError: no pointer casts here")

        broken._launch = fail
        out, lse = broken.pages_forward(q, pages, 0.2)
        assert broken._pages_broken.startswith("RuntimeError: CompilationError")
        assert_close(out.cpu(), want_out, dtype, "out", "page by page")
        assert_close(lse.cpu(), want_lse, dtype, "lse", "page by page")


def _nonfinite_checks(triton) -> None:
    """magnetar.ops.nonfinite's rule, row by row as the front end applies it: +-inf or NaN in q or in a key the row
    sees -> (NaN, NaN); in a value it sees -> out NaN, lse finite; a key or value it does not see changes nothing."""
    from magnetar.ops import attention_with_lse
    from magnetar.ops.pages import Page

    g = torch.Generator().manual_seed(4)
    n = 70
    q = torch.randn(5, HQ, 1, D, generator=g)
    ks = [torch.randn(1, HKV, n, D, generator=g) for _ in range(5)]
    vs = [torch.randn(1, HKV, n, D, generator=g) for _ in range(5)]
    q[0, 1, 0, 3] = float("nan")  # row 0: q
    ks[1][0, 0, 20, 5] = float("-inf")  # row 1: a key it sees
    vs[2][0, 1, 33, 0] = float("inf")  # row 2: a value it sees
    ks[3][0, 0, 65, 1] = float("nan")  # row 3: a key after its position (positions: unseen)
    vs[3][0, 1, 66, 2] = float("nan")  # and its value
    q_pos = torch.tensor([[100], [100], [100], [60], [100]])
    pos = torch.arange(n)
    table = PointerTable(1, 5, PAGES, HKV, "cpu")
    for b in range(5):
        table.put(b, [[(ks[b], vs[b], pos)]])
    table.sync()
    got = triton.pointers_forward(q, q_pos, table, 0, 0.2)
    paged = triton.pages_forward(q[:3], [[Page(ks[b], vs[b])] for b in range(3)], 0.2)
    for b in range(5):
        want = attention_with_lse(q[b:b + 1], ks[b], vs[b], q_pos=q_pos[b], k_pos=pos, scale=0.2)
        for (o, l), what in ((got, "table"), (paged, "pages")):
            if what == "pages" and b >= 3:
                continue
            assert torch.equal(o[b:b + 1].isnan(), want[0].isnan()), (what, b)
            assert torch.equal(l[b:b + 1].isnan(), want[1].isnan()), (what, b)
            finite = ~want[0].isnan()
            assert_close(o[b:b + 1][finite], want[0][finite], torch.float32, "out", f"{what} row {b}")
    assert got[0][0, 1].isnan().all() and got[0][0, [0, 2, 3]].isfinite().all()  # the NaN query head alone
    assert got[0][1, :2].isnan().all() and got[0][1, 2:].isfinite().all()  # the heads reading that KV head
    assert got[0][2, 2:].isnan().all() and got[1][2].isfinite().all()  # a value: out NaN, lse finite
    assert got[0][3].isfinite().all()  # what row 3 does not see reached nothing


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="the triton package is not installed (it comes with torch's CUDA wheels)")
def test_triton_kernel_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(filter(None, (
        str(REPO), os.environ.get("PYTHONPATH")))))
    run = subprocess.run([sys.executable, "-c", "from tests.test_pointer_attention import interpreter_checks; "
                          "interpreter_checks()"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "interpreter checks passed" in run.stdout, run.stdout + run.stderr[-3000:]


def test_the_table_holds_what_it_points_at_and_says_what_it_cannot_take():
    rows, _ = _rows(torch.float32)
    table = _table(rows)
    k, v, pos = rows[0][0]
    assert table.device[:, 0, 0, 0].tolist() == [k.data_ptr(), v.data_ptr(), pos.data_ptr(), 150, 300 * D, 300 * D]
    assert table.device[3, 1, 1].tolist() == [100, 37, 0, 0] and table.device[3, 0, 2].tolist() == [0] * PAGES
    assert table.pieces[0][1][0][0] is k  # held: not freed while a kernel may read it
    table.clear(0)
    assert table.pieces[0] is None and table.device[3, 0, 0, 0] == 150  # on the device after the next sync only
    table.sync()
    assert table.device[3, 0, 0].tolist() == [0] * PAGES
    # a piece laid out otherwise (not consecutive along the sequence) is copied, and held
    kt = torch.randn(1, HKV, D, 20).transpose(2, 3)
    table.put(0, [[(kt, kt, torch.arange(20))]] * LAYERS)
    held = table.pieces[0][0][0][0]
    assert held is not kt and held.stride(2) == D and torch.equal(held, kt)
    with pytest.raises(ValueError, match=r"5 pieces at layer 0, the table holds 4: join them first"):
        table.put(1, [[rows[0][0]] * 5] * LAYERS)
    with pytest.raises(ValueError, match="3 KV heads"):
        table.put(1, [[(torch.zeros(1, 3, 4, D), torch.zeros(1, 3, 4, D), torch.arange(4))]] * LAYERS)
    with pytest.raises(ValueError, match="1 layers' pieces for a table of 2 layers"):
        table.put(1, [rows[0]])


def test_which_kernel_a_step_reads_its_contexts_with():
    # CUDA: Triton's where it runs; a CPU step reads pages -- unless a graph holds it (the torch kernel, the table);
    # a backend named with a pointer kernel is taken
    assert pointer_backend("auto", "cpu", required=False) is None
    assert pointer_backend("auto", "cpu", required=True).name == "torch"
    assert pointer_backend("torch", "cpu", required=False).name == "torch"
    assert pointer_backend("cpu_decode", "cpu", required=False) is None
    triton = get_backend("triton_decode")
    assert triton.validate(None) and "pointer tables" in triton.validate(None)[0]  # never an ordinary call's kernel
    with pytest.raises(ValueError, match="serves only decode steps' paged calls and pointer tables"):
        triton.forward(None)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="the triton package is not installed (it comes with torch's CUDA wheels)")
def test_triton_kernel_compiles_for_hopper(tmp_path, monkeypatch):
    # no card here, but Triton compiles for one without it (its own ptxas): the kernel's variants the engine launches
    # -- bf16 through the table (positions, a window), bf16 pages, fp32 through the table -- to sm_90 cubins, in a cache
    # of the test's own (nothing reused). The lent image's Triton 3.6 compiled all 18 variants too (docs/results.md)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from magnetar.ops.backends.triton_decode import TILE, _kernel

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 here: the kernel is the interpreter's, nothing to compile")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # its default, said (Triton 3.9 warns when unset)
    fn = _kernel()
    pointers = {"QPOS", "KT", "VT", "PT", "NT", "KH", "VH"}
    ints = {"window", "nsplit", "sqb", "sqh", "sqd", "sob", "soh", "sos", "slb", "slh", "sls"}
    for dtype, positions, window, pages in (("bf16", True, True, 4), ("bf16", False, False, 2),
                                            ("fp32", True, False, 4)):
        signature = {n: (f"*{dtype}" if n == "Q" else "*i64" if n in pointers else "*fp32" if n in ("O", "L")
                         else "fp32" if n == "scale" else "i32" if n in ints else "constexpr") for n in fn.arg_names}
        constants = dict(G=4, BG=16, D=128, BD=128, BN=TILE, WINDOW=window, IEEE=dtype == "fp32",
                         POSITIONS=positions, PAGES=pages)
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants),
                                  target=GPUTarget("cuda", 90, 32))
        assert compiled.asm["cubin"] and compiled.metadata.name == "decode_pages"
        assert compiled.metadata.shared <= 227 * 1024, (dtype, compiled.metadata.shared)  # an H100 SM's most


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_kernel_on_cuda_and_in_a_graph(dtype):
    from magnetar.ops.pages import page_backend

    backend = pointer_backend("auto", "cuda", required=True)
    assert backend.name == "triton_decode" and page_backend("auto", torch.device("cuda")) is backend
    _check(backend, dtype, None, "cuda")
    _check(backend, dtype, 40, "cuda")
    _pages_checks(backend, (dtype,), "cuda")  # the eager step's pages
    # captured once, replayed over a table that changed on the host: the graph reads the contexts of now
    rows, q_pos = _rows(dtype, "cuda")
    table = PointerTable(LAYERS, 4, PAGES, HKV, "cuda")
    q = torch.randn(4, HQ, 1, D, device="cuda").to(dtype)
    backend.pointers_forward(q, q_pos, table, 0, 0.2)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = backend.pointers_forward(q, q_pos, table, 0, 0.2)
    for r, pieces in enumerate(rows):
        if pieces:
            table.put(r, [pieces] * LAYERS)
    table.sync()
    graph.replay()
    want_out, want_lse = _want(q, q_pos, rows)
    assert_close(out.cpu(), want_out, dtype, "out", "replayed")
    assert_close(lse.cpu(), want_lse, dtype, "lse", "replayed")

