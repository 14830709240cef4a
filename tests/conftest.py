"""Shared test policy: one tolerance table, error reports with max and mean error, shared fixtures."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

# Hypothesis (tests/test_router.py; Schemathesis runs on it) keeps a cache where it runs: not in the checkout
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(__import__("tempfile").gettempdir(),
                                                                   "magnetar-tests-hypothesis"))

# Keep the suite inside 2 CPU cores, and keep DeepSpeed from JIT-building its shm comm op (~65 s). Under
# pytest-xdist (`make test` runs two workers, one per core) each worker computes on one thread: two workers of two
# threads each would fight over the cores.
os.environ.setdefault("MAGNETAR_DISABLE_DS_SHM", "1")
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2 // _WORKERS or 1, torch.get_num_threads())))


@dataclass(frozen=True)
class Tol:
    """Elementwise bound ``|actual - expected| <= atol + rtol * |expected|`` (torch.allclose's form)."""

    atol: float
    rtol: float = 0.0


# Every tolerance of the suite: one entry per kind of comparison, per dtype of the inputs for "out" and "lse".
TOLERANCES = {
    # Attention / merge outputs and lse against the fp64 reference (tests/reference.py). Outputs of a
    # softmax-weighted average are O(1); bf16 carries 8 mantissa bits (eps 7.8e-3), fp16 11 bits (eps 9.8e-4).
    # lse is float32 always but is computed from low-precision q.k products, so its error scales with |q.k| --
    # tests with extreme logits compare against the reference evaluated on the *rounded* inputs, which keeps
    # these bounds meaningful. float64 inputs: lse is float32 by contract and merges accumulate in float32,
    # so fp32-level bounds.
    "out": {
        torch.float64: Tol(1e-6, 1e-6),
        torch.float32: Tol(2e-5, 2e-5),
        torch.float16: Tol(2e-3, 2e-3),
        torch.bfloat16: Tol(1.6e-2, 1.6e-2),
    },
    "lse": {
        torch.float64: Tol(1e-6, 1e-6),
        torch.float32: Tol(2e-5, 2e-5),
        torch.float16: Tol(2e-3, 1e-3),
        torch.bfloat16: Tol(1.6e-2, 4e-3),
    },
    # An exact engine path (dense, ring, one-block star, full-budget pulsar / sparse / LuKA) against Hugging
    # Face's forward of a tiny fp32 model (dense, or with the written-out sparse-prefill attention): first-token
    # logits and token log-probs, both O(1)-O(10).
    "logits": Tol(1e-4),
    "perplexity": Tol(0.0, 1e-4),  # the same, as exp(-mean log-prob)
    # The runner's summed NLL over 31 tokens of the real 4-bit SmolLM2 against its own HF forward.
    "real_model_nll": Tol(0.0, 1e-3),
    # One fp32 computation run two ways that differ only in the order of reductions: spread vs single rank,
    # batched vs one at a time, simulated vs real ranks, a keep-everything policy vs none, score_variants vs a
    # separate score.
    "same_computation": Tol(1e-5),
    # The mean KL (nats) between an exact method's fp32 answer distributions and dense's: float reordering alone
    # (a few 1e-7 on the tiny models; an approximate method gives 1e-5 and up).
    "kl_exact": Tol(2e-6),
    # A small fp32 computation against its formula written out in fp64 or an exact identity (LuKA's
    # clustered attention and masses, sparse selections, head-averaged probabilities, rotations, losses).
    "fp32": Tol(1e-5),
    # A scalar fp32 loss against its terms written out in fp64 (relative: the KL of the test is ~0.5).
    "loss": Tol(0.0, 1e-5),
    # The same few fp32 operations as the library's, in another order (torch.allclose's defaults).
    "fp32_reorder": Tol(1e-8, 1e-5),
    # Attention mass accumulated over up to ~100 queries (sums of probabilities, O(1)-O(100)).
    "mass": Tol(1e-4, 1e-5),
    # A metric a training run stored against the same metric recomputed from a fresh collection.
    "recomputed_metric": Tol(0.0, 1e-4),
    # A float64 formula against its hand computation (IDF, BM25, confidence intervals, probability sums).
    "fp64": Tol(1e-12),
    # The cost model's exact FLOP counts against the paper's closed form (Eq. 6: "within 0.1%").
    "paper_formula": Tol(0.0, 1e-3),
    # Ties a top-k may break either way: head-averaged probabilities (in [0, 1]) and indexer scores (ReLU, O(1)).
    "topk_tie_probs": Tol(1e-6),
    "topk_tie_scores": Tol(1e-5),
    # An approximation must change the result by more than this, so the test that compares it can fail.
    "differs": Tol(1e-3),
}


def tolerance(what: str, dtype: torch.dtype | None = None) -> Tol:
    """The table's entry ``what`` (for the per-dtype entries, its row for ``dtype``)."""
    if what not in TOLERANCES:
        raise KeyError(f"no tolerance {what!r} in tests/conftest.py TOLERANCES; add one (known: {sorted(TOLERANCES)})")
    entry = TOLERANCES[what]
    if isinstance(entry, Tol):
        return entry
    if dtype not in entry:
        raise KeyError(f"tolerance {what!r} is per dtype: pass one of {list(entry)}, got {dtype}")
    return entry[dtype]


def _f64(x) -> torch.Tensor:
    """A tensor, a number or a (nested) list as a float64 CPU tensor (numbers are not rounded to float32)."""
    return x.detach().double().cpu() if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.float64)


def _errors(actual, expected, tol: Tol, label: str):
    """``(err, bound, got, want)`` over the finite entries (float64, flat) after the shape/NaN/inf checks."""
    a, e = _f64(actual), _f64(expected)
    assert a.shape == e.shape, f"{label}: shape {tuple(a.shape)} != expected {tuple(e.shape)}"
    assert not torch.isnan(a).any(), f"{label}: result contains NaN"
    inf_a, inf_e = torch.isinf(a), torch.isinf(e)
    assert torch.equal(inf_a, inf_e) and torch.equal(a[inf_a], e[inf_e]), (
        f"{label}: infinities differ ({int(inf_a.sum())} in result, {int(inf_e.sum())} expected)"
    )
    fa, fe = a[~inf_a], e[~inf_e]
    return (fa - fe).abs(), tol.atol + tol.rtol * fe.abs(), fa, fe


def _report(err, bound, fa, fe, tol: Tol, label: str) -> str:
    worst = int(torch.argmax(err - bound))
    return (f"{label}: max abs err {err.max().item():.3e}, mean {err.mean().item():.3e}, worst at flat index "
            f"{worst}: got {fa[worst].item():.6g}, expected {fe[worst].item():.6g} (atol {tol.atol:g}, rtol "
            f"{tol.rtol:g})")


def repo_pythonpath() -> str:
    """``PYTHONPATH`` for a test's subprocess: this checkout first, then whatever the caller's had (the GPU kit puts
    the packages the image lacks on it, ``.gpu-site``; a user may install that way too) -- never replaced."""
    return os.pathsep.join([str(Path(__file__).resolve().parents[1]), *filter(None, [os.environ.get("PYTHONPATH")])])


def spy_json_writes(monkeypatch, module, path, seen: list) -> None:
    """Each ``write_json_line`` ``module`` makes (a benchmark's ``--json-out``, rewritten as rows come) still written,
    and the file's content read back right after into ``seen`` -- what a caller killing the run would find."""
    import json

    write = module.write_json_line

    def spy(target, record):
        write(target, record)
        seen.append(json.loads(Path(path).read_text()))

    monkeypatch.setattr(module, "write_json_line", spy)


def load_benchmark(name: str):
    """The script ``benchmarks/<name>.py`` as a module (the folder is not a package): its functions and ``main``. The
    folder goes on ``sys.path`` as it does for the script run (scripts import their siblings: ``bench_threads``)."""
    import importlib.util

    folder = Path(__file__).resolve().parents[1] / "benchmarks"
    if str(folder) not in sys.path:
        sys.path.append(str(folder))
    path = folder / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_close(actual, expected, dtype: torch.dtype | None = None, what: str = "out", msg: str = ""):
    """Assert ``actual ~= expected`` (tensors or numbers) under the table's tolerance ``what`` (for "out" and
    "lse", its row for ``dtype``); infinities must match exactly, NaN never passes.

    The failure message prints the max and mean absolute error and where the max is.
    """
    tol = tolerance(what, dtype)
    label = f"{msg} {what}" + (f" ({dtype})" if dtype is not None else "")
    err, bound, fa, fe = _errors(actual, expected, tol, label)
    if fa.numel() and not bool((err <= bound).all()):
        raise AssertionError(_report(err, bound, fa, fe, tol, label))


def assert_differs(actual, expected, what: str = "differs", msg: str = ""):
    """Assert ``actual`` is NOT close to ``expected`` under the table's tolerance ``what``: the guard that an
    approximation really changes the result, so the test that compares it can fail. Prints max and mean error."""
    tol = tolerance(what)
    label = f"{msg} {what}"
    a, e = _f64(actual), _f64(expected)
    assert a.shape == e.shape, f"{label}: shape {tuple(a.shape)} != expected {tuple(e.shape)}"
    err = (a - e).abs()
    bound = tol.atol + tol.rtol * e.abs()
    if not bool((err > bound).any()):
        raise AssertionError("should differ, but " + _report(err, bound, a.flatten(), e.flatten(), tol, label))


@pytest.fixture
def seeded():
    torch.manual_seed(0)
    return torch.Generator().manual_seed(0)


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: on tiny tensors one thread is faster than two that synchronise on every
    op (by 100x when the machine's other core is busy). Use with ``pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def smollm2_path():
    """SmolLM2-135M-Instruct prepared from its PyPI package (its folder); skips only when the package is not
    installed (``ModelNotInstalledError``, whose message has the pip command). Any other error fails."""
    from magnetar.models import ModelNotInstalledError, prepare_model

    try:
        return prepare_model("smollm2-135m-instruct")
    except ModelNotInstalledError as e:
        pytest.skip(f"model not installed: {e}")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    """SmolLM2-135M-Instruct's real tokenizer (see ``smollm2_path`` for when it skips)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path))


# The CPU ops JIT-built in the background while the first tests run (a fresh clone builds eight, ~1 min of one
# core): the tests that need one find it built, or wait on the build's lock (magnetar.ops.jit) as they would for
# any other process's build. One make-job, so the other core stays the tests'. MAGNETAR_TEST_PREBUILD=0: off.
_PREBUILD = """
from magnetar.ops import fused_merge
from magnetar.ops.backends.cpu_decode import DECODE_ATTENTION_OP
from magnetar.prefill.oracle import SPARSE_ATTENTION_OP
from magnetar.sparse.codes import HAMMING_OP
from magnetar.ops.small_gemm import SMALL_GEMM_OP
from magnetar.ops.rms_norm import RMS_NORM_OP
from magnetar.ops.rotary import ROTARY_OP
from magnetar.ops.backends.cpu_amx import AMX_ATTENTION_OP
for op in (fused_merge._op, DECODE_ATTENTION_OP, RMS_NORM_OP, ROTARY_OP, SMALL_GEMM_OP, HAMMING_OP,
           SPARSE_ATTENTION_OP, AMX_ATTENTION_OP):
    op.available("cpu")
"""
_PREBUILD_KEY = pytest.StashKey[subprocess.Popen]()


def pytest_sessionstart(session):
    worker = hasattr(session.config, "workerinput")  # an xdist worker: the controller started the builds
    if os.environ.get("MAGNETAR_TEST_PREBUILD", "1") != "0" and not session.config.option.collectonly and not worker:
        session.config.stash[_PREBUILD_KEY] = subprocess.Popen(
            [sys.executable, "-c", _PREBUILD], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env=dict(os.environ, MAX_JOBS="1", OMP_NUM_THREADS="1"), start_new_session=True)


def pytest_sessionfinish(session):
    proc = session.config.stash.get(_PREBUILD_KEY, None)
    if proc is not None and proc.poll() is None:  # a short run (-k) ends before the builds: they stop with it
        os.killpg(proc.pid, signal.SIGKILL)  # the compiler under it too (a cut build is redone on its next load)
        proc.wait()
