"""The GPU kit's steps as forks of one process that imported torch, transformers, DeepSpeed and Magnetar once.

A kit step is a Python command (``python -m magnetar.eval.bench ...``, ``python benchmarks/bench_decode.py ...``,
``python -c CODE``); started afresh, each spent 8-9 s of its ~11 s on this CPU importing those packages before doing
a dry run's second of work (benchmarks/gpu_check.py --dry-run: 110 s, ~85 of it imports). :class:`Forks` starts
this file once as a server: it imports the packages, then forks a child per command, which runs it as ``python``
would (``runpy``; its own session, its output to files, ``sys.argv``, ``sys.path[0]``, the caller's environment and
folder) and exits with its code. The caller gets ``(returncode, stdout, stderr)`` as from ``subprocess``, a command
past its limit killed with its process group (124, as the kit's own runner). What a library reads from the
environment when it loads (``OMP_NUM_THREADS`` for torch's OpenMP) is the server's: it starts with the caller's
environment of that moment.

Only where forking a process that imported them is sound: no thread but the main one after the imports (a lock held
by another thread would stay held in every child), and no CUDA driver loaded (a CUDA context does not survive a
fork; ``libcuda`` is loaded only when CUDA is first used, never by an import). The server checks both and refuses
otherwise (the caller then runs commands as subprocesses). A ``probe`` command must pass in a fork before any other
runs (the kit's on a GPU: a CUDA tensor made and read -- forking on a card is untried so far; where the probe fails,
every step runs afresh). ``gpu_check.py --no-fork-steps`` starts every step afresh.

Protocol (one JSON object a line): the caller writes ``{"argv", "cwd", "env", "out", "err"}``, the server answers
``{"pid"}`` once the child is forked and ``{"rc"}`` when it has exited; at start it answers ``{"ready": true}`` or
``{"ready": false, "why"}``. End of its input ends the server; so does the caller's death (its child with it).
"""
from __future__ import annotations

import ctypes
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

# What a kit step imports (measured: the dry run's steps imported nothing else heavy). Not the steps' own modules
# (runpy would then run a module already imported: a warning, and its state shared).
PRELOAD = ("torch", "torch.distributed", "transformers", "transformers.modeling_utils",
           "transformers.models.llama.modeling_llama", "deepspeed", "magnetar", "magnetar.engine", "magnetar.methods",
           "magnetar.cli", "magnetar.ops.op_builder")

_PR_SET_PDEATHSIG = 1


def _die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Linux: this process gets ``sig`` when its parent ends (no orphan outlives a killed kit)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig))
    except (OSError, AttributeError):  # not Linux: the end of the server's input still ends it
        pass


def _cuda_driver_loaded() -> bool:
    try:
        return "libcuda.so" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def _refusal() -> Optional[str]:
    """Why this process may not fork steps, or None."""
    if threading.active_count() > 1:
        return f"the imports started threads ({', '.join(t.name for t in threading.enumerate())})"
    if _cuda_driver_loaded():
        return "the imports loaded the CUDA driver (a fork would not inherit a usable CUDA context)"
    return None


def _run_as_python(argv: list[str]) -> int:
    """Run ``python argv...`` in this (forked) process; its exit code."""
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 -- as python: the traceback on stderr (from the step's code on), exit 1
        import traceback

        kind, e, tb = sys.exc_info()
        traceback.print_exception(kind, e, tb.tb_next)
        return 1


def _child(req: dict) -> int:
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the server's handler is not the step's (SIGPIPE stays ignored,
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as python leaves it)
    _die_with_parent()
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    err = os.open(req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for fd, to in ((null, 0), (out, 1), (err, 2)):
        os.dup2(fd, to)
        os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    return _run_as_python(req["argv"])


def serve(preload=PRELOAD) -> int:
    """The server's loop (this file run as a script); returns in a child with the child's exit code."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the imports or the server print goes to stderr, never into the protocol
    _die_with_parent(signal.SIGTERM)
    current = {"pid": None}

    def end(signum, frame):
        if current["pid"] is not None:
            try:
                os.killpg(current["pid"], signal.SIGKILL)
            except OSError:
                pass
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, end)
    t = time.monotonic()
    try:
        for name in preload:
            importlib.import_module(name)
    except BaseException as e:  # noqa: BLE001 -- said to the caller, who then runs commands afresh
        proto.write(json.dumps(dict(ready=False, why=f"importing {name}: {type(e).__name__}: {e}")) + "\n")
        return 0
    why = _refusal()
    proto.write(json.dumps(dict(ready=why is None, why=why, seconds=round(time.monotonic() - t, 2))) + "\n")
    if why is not None:
        return 0
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            proto.close()
            sys.stdin = open(os.devnull)
            return _child(req)
        current["pid"] = pid
        proto.write(json.dumps(dict(pid=pid)) + "\n")
        _, status = os.waitpid(pid, 0)
        current["pid"] = None
        proto.write(json.dumps(dict(rc=os.waitstatus_to_exitcode(status))) + "\n")
    return 0


class Forks:
    """The caller's side: made, it starts the server (``python`` this file, with ``env`` in ``cwd``); then
    :meth:`run` runs commands of the form ``[sys.executable, ...]`` through it. ``ready`` is False (``why`` says
    why) when the server refused or failed; the caller then runs commands itself."""

    def __init__(self, env: dict, cwd: Path, stderr, preload=PRELOAD, probe: Optional[list[str]] = None):
        self.cwd, self.ready, self.why, self.seconds = Path(cwd), False, None, None
        self._env, self._probe = dict(env), probe  # probe: a command a fork must pass before any other runs
        self._tmp = tempfile.TemporaryDirectory(prefix="magnetar-forks-")
        code = f"import sys; sys.path[0] = {str(Path(__file__).parent)!r}; import step_forks; " \
               f"sys.exit(step_forks.serve({tuple(preload)!r}))"
        self._buf = b""
        # torch.cuda.is_available() (DeepSpeed's accelerator check at import) asks NVML, not the CUDA runtime, which
        # would load the driver and make the server refuse to fork; the steps get ``env`` as it is
        env = dict(env, PYTORCH_NVML_BASED_CUDA_CHECK="1")
        self._proc = subprocess.Popen([sys.executable, "-c", code], cwd=cwd, env=env, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=stderr, bufsize=0)

    def wait_ready(self, timeout: float) -> bool:
        """Whether the server imported everything and may fork (within ``timeout`` seconds), and its forks pass the
        probe (a GPU run's: a CUDA tensor made and read in a fork) when one was given."""
        if self.ready or self.why is not None:
            return self.ready
        msg = self._read(timeout)
        if msg is None:
            self.why = f"the server was not ready within {timeout:.0f} s"
        else:
            self.ready, self.why, self.seconds = bool(msg.get("ready")), msg.get("why"), msg.get("seconds")
        if self.ready and self._probe is not None:
            rc, out, err = self.run(self._probe, 60, self._env)
            if rc != 0:
                said = ((err.strip() or out.strip()).splitlines() or ["no output"])[-1][-300:]  # the error's line
                self.ready, self.why = False, f"a forked probe failed (exit {rc}: {said})"
        if not self.ready:
            self.close()
        return self.ready

    def can_run(self, cmd: list[str]) -> bool:
        return cmd[:1] == [sys.executable] and len(cmd) > 1 and cmd[1:3] != ["-m", "pip"]

    def run(self, cmd: list[str], timeout: float, env: dict) -> tuple[int, str, str]:
        """``(returncode, stdout, stderr)`` of ``cmd`` forked from the server; past ``timeout`` its process group
        is killed and the return code is 124 (as :meth:`Kit.run`'s)."""
        out, err = Path(self._tmp.name) / "out", Path(self._tmp.name) / "err"
        self._proc.stdin.write(json.dumps(dict(argv=cmd[1:], cwd=str(self.cwd), env=env, out=str(out),
                                               err=str(err))).encode() + b"\n")
        t = time.monotonic()
        started = self._read(30)
        if started is None or "pid" not in started:
            raise RuntimeError(f"the step server did not start {cmd[1:3]}: {started}")
        pid, killed = started["pid"], False
        done = self._read(max(0.0, timeout - (time.monotonic() - t)))
        if done is None:
            killed = True
            for kill in (os.killpg, os.kill):  # the child may not have its own group yet
                try:
                    kill(pid, signal.SIGKILL)
                    break
                except ProcessLookupError:
                    continue
            done = self._read(30)
        if done is None or "rc" not in done:
            raise RuntimeError(f"the step server did not report the end of {cmd[1:3]}")
        text = [p.read_text(errors="replace") if p.exists() else "" for p in (out, err)]
        if killed:
            return 124, text[0], text[1] + f"\n(killed at its time limit, {timeout:.0f} s)"
        return done["rc"], text[0], text[1]

    def _read(self, timeout: float) -> Optional[dict]:
        """The server's next message, or None when none came within ``timeout`` (or it ended). Read off the pipe's
        descriptor with a buffer of this object's own: a buffered reader could hold the next message where
        ``select`` does not see it."""
        deadline = time.monotonic() + timeout
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()
            except OSError:
                pass
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._tmp.cleanup()


if __name__ == "__main__":
    sys.exit(serve(tuple(sys.argv[1:]) or PRELOAD))
