"""Loading a JIT-built op never waits forever (hardening issue, item 1): a stale torch build lock left by a
killed process is removed, and a build held by a live process is waited for a bounded time, then the op counts
as unavailable (callers fall back to torch) with a warning that names the lock."""
from __future__ import annotations

import fcntl
import shutil
import signal
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from magnetar.ops.jit import LOCK_TIMEOUT_ENV, LazyOp, build_directory
from tests.conftest import repo_pythonpath


# A builder whose jit_load does what torch's cpp_extension.load does with its lock file, and nothing else.
FAKE_BUILDER = '''
import types
from torch.utils.file_baton import FileBaton
from magnetar.ops.jit import build_directory


class FakeBuilder:
    name = "magnetar_lock_test_op"
    error_log = None
    loads = 0

    def is_compatible(self, verbose=False):
        return True

    def jit_load(self, verbose=False):
        FakeBuilder.loads += 1
        baton = FileBaton(str(build_directory(self.name) / "lock"))
        if baton.try_acquire():
            baton.release()
        else:
            baton.wait()  # torch waits here, with no timeout, while the lock file exists
        return types.SimpleNamespace(op=lambda: 1)
'''


def _env(tmp_path: Path, **extra) -> dict:
    return dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), PYTHONPATH=repo_pythonpath(), **extra)


def test_a_stale_torch_lock_is_removed_and_the_load_completes(tmp_path):
    (tmp_path / "fake_builder.py").write_text(FAKE_BUILDER)
    script = textwrap.dedent("""
        import logging, sys
        sys.path.insert(0, sys.argv[1])
        from fake_builder import FakeBuilder
        from magnetar.ops.jit import LazyOp, build_directory
        lock = build_directory(FakeBuilder.name) / "lock"
        lock.write_text("")  # what a rank killed while building leaves behind
        op = LazyOp("test", lambda dtype: FakeBuilder(), ("op",))
        print("loaded", op.load("cpu").op(), "stale lock left:", lock.exists())
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=_env(tmp_path), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "loaded 1 stale lock left: False" in proc.stdout
    assert "removing the stale build lock" in proc.stderr and str(tmp_path / "ext") in proc.stderr


def test_a_build_held_by_a_live_process_times_out_to_the_fallback(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv(LOCK_TIMEOUT_ENV, "0.3")
    calls = []

    class Builder:
        name = "magnetar_lock_test_held"
        error_log = None

        def is_compatible(self, verbose=False):
            return True

        def jit_load(self, verbose=False):
            calls.append(1)

    held = build_directory(Builder.name) / "magnetar.lock"
    fd = os.open(held, os.O_CREAT | os.O_RDWR)
    os.write(fd, b"4242")
    fcntl.flock(fd, fcntl.LOCK_EX)  # another process building right now (flock conflicts per open file)
    try:
        op = LazyOp("held op", lambda dtype: Builder(), ("op",))
        assert op.available("cpu") is False
    finally:
        os.close(fd)
    reason = op.unavailable_reason("cpu")
    assert not calls, "jit_load must not run while another process holds the build"
    assert str(held) in reason and "pid 4242" in reason and LOCK_TIMEOUT_ENV in reason
    assert str(held) in caplog.text and "torch implementation is used" in caplog.text
    with pytest.raises(RuntimeError, match="held op op is unavailable"):
        op.load("cpu")


def test_a_bad_lock_timeout_names_the_variable(monkeypatch):
    from magnetar.ops.jit import lock_timeout_s

    monkeypatch.setenv(LOCK_TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=f"{LOCK_TIMEOUT_ENV}='soon' is not a number of seconds"):
        lock_timeout_s()


def test_the_fused_merge_loads_past_a_stale_lock_in_its_real_build_directory():
    """The real op, in a fresh process: a stale lock in its cache directory no longer hangs the run."""
    from magnetar.ops.op_builder import MergeStatesBuilder

    lock = build_directory(MergeStatesBuilder().name) / "lock"
    lock.write_text("")
    script = ("import torch; from magnetar.ops.merge import merge_states; "
              "o, l = merge_states(torch.zeros(2, 1, 1, 3, 4), torch.zeros(2, 1, 1, 3)); "
              "from magnetar.ops.fused_merge import fused_merge_available; "
              "print('fused', fused_merge_available('cpu'))")
    proc = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=repo_pythonpath()),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert not lock.exists() and "fused True" in proc.stdout


def test_the_engine_loads_its_ops_at_start_not_inside_a_request(monkeypatch):
    """A first build inside a request kept the other rank waiting in the Phase-2 gather until its timeout (CI,
    fresh build cache); the engine now builds or loads every op it will use in init_inference."""
    import magnetar
    from magnetar.ops import fused_merge
    from magnetar.ops.backends.cpu_decode import DECODE_ATTENTION_OP
    from magnetar.ops.rms_norm import RMS_NORM_OP
    from magnetar.ops.rotary import ROTARY_OP
    from magnetar.ops.small_gemm import SMALL_GEMM_OP
    from magnetar.sparse.codes import HAMMING_OP
    from tests.tiny_models import tiny_model

    asked = []
    for name, op in (("merge", fused_merge._op), ("hamming", HAMMING_OP), ("decode", DECODE_ATTENTION_OP),
                     ("small_gemm", SMALL_GEMM_OP), ("rms_norm", RMS_NORM_OP), ("rotary", ROTARY_OP)):
        monkeypatch.setattr(op, "_get", lambda device, name=name: asked.append((name, str(device))))
    magnetar.init_inference(tiny_model("llama"), deepspeed_inference=False, method="dense")
    # the norms' and the rotary embedding's ops first
    assert asked == [("rms_norm", "cpu"), ("rotary", "cpu"), ("merge", "cpu"), ("decode", "cpu")], asked
    asked.clear()
    magnetar.init_inference(tiny_model("llama"), deepspeed_inference=False, method="dense", sparse_policy="lsh",
                            sparse_budget=8)
    assert asked == [("rms_norm", "cpu"), ("rotary", "cpu"), ("merge", "cpu"), ("decode", "cpu"), ("hamming", "cpu")
                     ], asked
    asked.clear()
    magnetar.init_inference(tiny_model("llama"), deepspeed_inference=False, method="dense", dtype="bfloat16")
    # bf16: its products' op too
    assert asked == [("rms_norm", "cpu"), ("rotary", "cpu"), ("merge", "cpu"), ("decode", "cpu"),
                     ("small_gemm", "cpu")], asked
    asked.clear()
    monkeypatch.setenv("MAGNETAR_FUSED_MERGE", "0")  # the torch merge: nothing to build
    magnetar.init_inference(tiny_model("llama"), deepspeed_inference=False, method="dense",
                            attention_backend="cpu_flash")  # another backend than cpu_decode: not its op either
    assert asked == [("rms_norm", "cpu"), ("rotary", "cpu")], asked  # its norms' and rotary embedding's ops only
    asked.clear()
    # but a static step's slots on a CPU are read by cpu_decode's kernel whatever backend serves the eager calls
    magnetar.init_inference(tiny_model("llama"), deepspeed_inference=False, method="dense",
                            attention_backend="cpu_flash", decode_step="static")
    assert asked == [("rms_norm", "cpu"), ("rotary", "cpu"), ("decode", "cpu")], asked


# -- a build that was not completed (issue 28, item 3) ---------------------------------------------------------
# A builder whose jit_load does what torch's does for a build it finds in its cache: load the library in the build
# folder (here a plain C library with a large data segment, built with gcc the first time), with dlopen.
C_BUILDER = '''
import ctypes, subprocess
from magnetar.ops.jit import build_directory


class CBuilder:
    name = "magnetar_cut_build_test_op"
    error_log = None

    def is_compatible(self, verbose=False):
        return True

    def jit_load(self, verbose=False):
        folder = build_directory(self.name)
        lib = folder / (self.name + ".so")
        if not lib.exists():
            (folder / "op.c").write_text("int answer(void) { return 42; }\\nint table[200000] = {1};\\n")
            subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(folder / "op.c")], check=True)
        return ctypes.CDLL(str(lib))
'''
LOAD_C_OP = """
import sys
sys.path.insert(0, sys.argv[1])
from c_builder import CBuilder
from magnetar.ops.jit import LazyOp
print("answer", LazyOp("cut-test", lambda dtype: CBuilder(), ("answer",)).load("cpu").answer())
"""


def _load_c_op(tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LOAD_C_OP, str(tmp_path)], env=_env(tmp_path), capture_output=True,
                          text=True, timeout=300)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build the test library")
def test_a_build_that_was_not_completed_is_rebuilt_not_loaded(tmp_path):
    """A library cut short with a valid ELF header (a full disk, a killed copy) made every later run die of SIGBUS
    with no message. Now the load finds it incomplete -- cut (with or without the build record of a completed
    build: the ELF structure tells), or the same size with other bytes (the record's sha256 tells) --, says so,
    rebuilds it and runs."""
    from magnetar.ops.jit import BUILT_RECORD, library_problem

    (tmp_path / "c_builder.py").write_text(C_BUILDER)
    first = _load_c_op(tmp_path)
    assert first.returncode == 0 and "answer 42" in first.stdout, first.stderr
    folder = tmp_path / "ext" / "magnetar_cut_build_test_op"
    lib = folder / "magnetar_cut_build_test_op.so"
    assert (folder / BUILT_RECORD).exists() and library_problem(lib) is None
    whole = lib.read_bytes()
    for damage, why in (("cut, with its build record", "cut short"), ("cut, no build record", "cut short"),
                        ("other bytes, same size", "sha256 differ")):
        if damage.startswith("cut"):
            lib.write_bytes(whole[: len(whole) // 2])
            if damage.endswith("no build record"):
                (folder / BUILT_RECORD).unlink()
            assert "cut short" in library_problem(lib)
            if damage.endswith("its build record"):  # the premise: loading it as it is dies of SIGBUS
                crash = subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(lib)!r})"],
                                       capture_output=True, timeout=60)
                assert crash.returncode == -signal.SIGBUS, crash
        else:
            data = bytearray(whole)
            data[-100:] = b"\0" * 100
            lib.write_bytes(bytes(data))
            assert library_problem(lib) is None  # the ELF structure is whole: only the record can tell
        again = _load_c_op(tmp_path)
        assert again.returncode == 0 and "answer 42" in again.stdout, (damage, again.stderr)
        assert "the cached build of the cut-test op was not completed" in again.stderr and why in again.stderr, \
            (damage, again.stderr)
        assert (folder / BUILT_RECORD).exists() and library_problem(lib) is None, damage
        whole = lib.read_bytes()


def test_library_problem_reads_headers_only():
    from magnetar.ops.jit import library_problem

    here = Path(sys.executable).resolve()
    assert library_problem(here) is None  # the python binary: a whole ELF file
    assert "not an ELF" in library_problem(Path(__file__))


def test_staged_sources_are_absolute_under_a_relative_extensions_dir(tmp_path, monkeypatch):
    # DeepSpeed's builders read a relative source path against DeepSpeed's own folder: a relative TORCH_EXTENSIONS_DIR
    # (`TORCH_EXTENSIONS_DIR=runs/ext`) made every JIT build fail with "no such file .../deepspeed/ops/runs/ext/..."
    from magnetar.ops import op_builder

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "rel_ext")
    staged = op_builder.staged_sources()
    assert staged.is_absolute() and staged.parent == (tmp_path / "rel_ext").resolve()
    assert sorted(p.name for p in staged.iterdir()) == sorted(p.name for p in op_builder.CSRC_DIR.iterdir()
                                                              if p.is_file())
    assert all(Path(s).is_absolute() for s in op_builder.DecodeAttentionBuilder().sources())
