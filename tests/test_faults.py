"""Faults of a multi-process job (hardening issue, "Processes" and "What it must show"): a rank killed in
Phase 1 or in Phase 2 makes the launcher exit non-zero within the collective timeout + 10 s with no process of
the job left; a killed launcher takes every rank with it (``magnetar.parallel.lifetime``). The stale op lock is
tests/test_op_lock.py.

Each job is ``magnetar.launch.run`` (through tests/fault_script.py, which injects the fault) on 2 CPU ranks of
a tiny llama with a byte-level tokenizer, under the real ``torchrun`` / ``deepspeed`` launchers of this venv.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from magnetar.parallel import lifetime
from magnetar.parallel.launcher import init_distributed
from tests.conftest import repo_pythonpath
from tests.dist_utils import free_port
from tests.tiny_models import save_tiny

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 20  # the jobs' collective timeout (--timeout-s) where a dead peer must be noticed
HANG_TIMEOUT_S = 300  # where nothing but the launcher watchdog may end the job
STARTUP_S = 240  # until the fault fires: two ranks import torch, transformers and deepspeed on a busy machine
LEFT_S = lifetime.POLL_S + lifetime.GRACE_S + 10  # a killed launcher's ranks must be gone by then
CONTEXT = "The quick brown fox jumps over the lazy dog. " * 12


def _launcher(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        pytest.skip(f"the {name} launcher is not installed")
    return found


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny llama saved with a byte-level tokenizer (256 ids = its vocabulary), loadable by ``--model``."""
    out = tmp_path_factory.mktemp("tiny-llama")
    save_tiny(out, "llama")
    return out


def _start(launcher: str, fault: str, model: Path, tmp: Path, timeout_s: int) -> subprocess.Popen:
    """Start the 2-rank job with ``fault`` (tests/fault_script.py); its output goes to ``tmp/job.log``. Every
    process of the job carries ``tmp`` in its arguments (``--json-out``), see :func:`_job_processes`."""
    port = str(free_port())
    if launcher == "torchrun":
        cmd = [_launcher("torchrun"), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", port]
    else:
        cmd = [_launcher("deepspeed"), "--num_gpus", "2", "--master_addr", "127.0.0.1", "--master_port", port]
    cmd += [str(REPO / "tests" / "fault_script.py"), "--model", str(model), "--method", "star", "--block-size", "64",
            "--context", CONTEXT, "--query", "Who jumps?", "--max-new-tokens", "4", "--timeout-s", str(timeout_s),
            "--json-out", str(tmp / "result.json")]
    env = {k: v for k, v in os.environ.items() if k not in (lifetime.WATCHDOG_ENV, "RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=repo_pythonpath(), OMP_NUM_THREADS="1", MAGNETAR_FUSED_MERGE="0",  # no JIT op build
               MAGNETAR_TEST_FAULT=fault, MAGNETAR_TEST_FAULT_DIR=str(tmp))
    with open(tmp / "job.log", "wb") as log:  # the job holds its own copy of the descriptor
        # its own session: whatever the test leaves, the finally clause of the test can find and end
        return subprocess.Popen(cmd, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _job_processes(tmp: Path) -> list[psutil.Process]:
    """Live processes (zombies excluded) whose arguments name ``tmp``: the launcher(s) and ranks of one job."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and any(str(tmp) in a for a in p.info["cmdline"] or ()):
            found.append(p)
    return found


def _wait_gone(procs: list[psutil.Process], seconds: float) -> list[psutil.Process]:
    """Wait until every process of ``procs`` has exited (or is a zombie); returns those still alive."""
    deadline = time.monotonic() + seconds
    while True:
        alive = []
        for p in procs:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _describe(procs: list[psutil.Process]) -> str:
    lines = []
    for p in procs:
        try:
            lines.append(f"  pid {p.pid} (parent {p.ppid()}): {' '.join(p.cmdline())[:160]}")
        except psutil.Error:
            lines.append(f"  pid {p.pid}: gone")
    return "\n".join(lines)


def _log(tmp: Path) -> str:
    return (tmp / "job.log").read_text(errors="replace")[-4000:]


def _wait_for(paths: list[Path], job: subprocess.Popen, tmp: Path) -> None:
    deadline = time.monotonic() + STARTUP_S
    while not all(p.exists() for p in paths):
        assert job.poll() is None, f"the job exited ({job.returncode}) before its fault fired:\n{_log(tmp)}"
        assert time.monotonic() < deadline, f"the fault did not fire within {STARTUP_S} s:\n{_log(tmp)}"
        time.sleep(0.2)


def _end(job: subprocess.Popen, tmp: Path) -> None:
    """Kill what the test leaves of its job (only processes of this job: its session and its ``tmp``)."""
    for p in _job_processes(tmp):
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    if job.poll() is None:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()


@pytest.mark.timeout(STARTUP_S + TIMEOUT_S + 60)
@pytest.mark.parametrize("launcher, phase, call", [
    pytest.param("torchrun", "1", 1, id="torchrun-phase1"),  # rank 1 dies at its first Phase-1 forward
    pytest.param("deepspeed", "2", 2, id="deepspeed-phase2"),  # rank 1 dies in the first decode step
])
def test_a_killed_rank_ends_the_job(model_dir, tmp_path, launcher, phase, call):
    job = _start(launcher, f"kill:{phase}:1:{call}", model_dir, tmp_path, TIMEOUT_S)
    try:
        _wait_for([tmp_path / "kill.1"], job, tmp_path)
        killed_at = time.monotonic()
        try:
            rc = job.wait(timeout=TIMEOUT_S + 10)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{launcher} still runs {TIMEOUT_S + 10} s after rank 1 was killed in Phase {phase}:\n"
                        f"{_describe(_job_processes(tmp_path))}\n{_log(tmp_path)}")
        assert rc != 0, f"{launcher} exited 0 after rank 1 was killed in Phase {phase}:\n{_log(tmp_path)}"
        left = _wait_gone(_job_processes(tmp_path), 5)
        assert not left, f"processes of the job outlive {launcher}:\n{_describe(left)}"
        assert not (tmp_path / "result.json").exists(), "rank 0 wrote a result although its peer died"
        print(f"{launcher} exited {rc} {time.monotonic() - killed_at:.1f} s after rank 1 was killed in Phase {phase}")
    finally:
        _end(job, tmp_path)


@pytest.mark.timeout(STARTUP_S + LEFT_S + 60)
@pytest.mark.parametrize("launcher, sig", [
    # upstream, launch.py and the ranks stay; the local runner has no handler, so SIGKILL does the same
    pytest.param("deepspeed", signal.SIGTERM, id="deepspeed-SIGTERM"),
    pytest.param("torchrun", signal.SIGKILL, id="torchrun-SIGKILL"),  # upstream, the ranks stay (SIGTERM: gone)
])
def test_a_killed_launcher_takes_every_rank_with_it(model_dir, tmp_path, launcher, sig):
    # Rank 1 hangs in the first decode step; rank 0 waits for it in a collective whose timeout (300 s) is far
    # beyond the bound, so only the launcher watchdog can end the ranks in time.
    job = _start(launcher, "hang:2:1:2", model_dir, tmp_path, HANG_TIMEOUT_S)
    try:
        _wait_for([tmp_path / "hang.1", tmp_path / "ready.0"], job, tmp_path)
        time.sleep(1.0)  # rank 0 is in the decode step's collective by now
        tree = [psutil.Process(job.pid)] + psutil.Process(job.pid).children(recursive=True)
        ranks = {int((tmp_path / f).read_text()) for f in ("hang.1", "ready.0")}
        assert ranks <= {p.pid for p in tree}, f"ranks {ranks} are not in the launcher's tree:\n{_describe(tree)}"
        recorded = _describe(tree)
        job.send_signal(sig)
        killed_at = time.monotonic()
        left = _wait_gone(list({p.pid: p for p in tree + _job_processes(tmp_path)}.values()), LEFT_S)
        assert not left, (f"{LEFT_S:.0f} s after {sig.name} to {launcher} (pid {job.pid}) these processes of the job "
                          f"still run:\n{_describe(left)}\nthe job's tree when the launcher was killed:\n{recorded}")
        if launcher == "deepspeed":  # the ranks watched the runner, launch.py's parent, and saw it go
            log = (tmp_path / "job.log").read_text(errors="replace")
            assert f"launcher process {job.pid} " in log, log[-4000:]
        print(f"{sig.name} to {launcher}: its {len(tree)} processes gone in {time.monotonic() - killed_at:.1f} s\n"
              f"{recorded}")
    finally:
        _end(job, tmp_path)


def test_no_watchdog_without_a_launcher(monkeypatch):
    """One process, no launcher variables: nothing is watched (the parent is a shell or pytest)."""
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert init_distributed() is False
    assert lifetime._chain is None
    assert "magnetar-parent-watchdog" not in [t.name for t in threading.enumerate()]


def test_the_watchdog_sees_a_live_parent_and_a_gone_one():
    assert lifetime.broken_link(lifetime.launcher_chain()) is None  # pytest's parent is alive
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = lifetime.Link(pid=dead.pid, child=os.getpid(), command="exited")
    assert lifetime.broken_link([gone]) == gone


@pytest.mark.parametrize("value, on", [("0", False), ("1", True), ("", True)])
def test_the_opt_out_variable(monkeypatch, value, on):
    monkeypatch.setenv(lifetime.WATCHDOG_ENV, value)
    assert lifetime.watchdog_enabled() is on


def test_a_bad_opt_out_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(lifetime.WATCHDOG_ENV, "no")
    with pytest.raises(ValueError, match=f"{lifetime.WATCHDOG_ENV}='no'.*set it to 0"):
        lifetime.watchdog_enabled()
