"""A rank does not outlive its launcher.

Launchers stop their ranks only when they exit in an orderly way. Observed with the ``deepspeed`` launcher
(0.19.8) and ``torchrun`` (torch 2.13) on one node:

* ``deepspeed`` is two processes: the runner (``bin/deepspeed``) starts ``python -m deepspeed.launcher.launch``,
  which starts the ranks. SIGTERM or SIGKILL to the runner kills only the runner: ``launch.py`` and every rank
  keep running (reparented). SIGTERM to ``launch.py`` terminates the ranks; SIGKILL to it leaves them running.
* ``torchrun`` starts the ranks itself. SIGTERM terminates them; SIGKILL leaves them running.

An orphaned rank holds its memory (a GPU's, on CUDA) and waits in its next collective until the timeout, or
forever outside one. :func:`watch_launcher` (called by :func:`magnetar.parallel.launcher.init_distributed`
when a launcher started the process) closes both gaps:

1. On Linux, ``prctl(PR_SET_PDEATHSIG, SIGTERM)``: the kernel sends SIGTERM to this rank when its parent dies.
   The signal is tied to the parent *thread* that created this process (launch.py and torchrun's agent start
   ranks from their main thread, so that is the launcher process); it is not inherited by processes this rank
   forks (compiler jobs, data workers) and is cleared when a set-user-ID or file-capability binary is executed.
   It covers the direct parent only, not the ``deepspeed`` runner above ``launch.py``.
2. A daemon thread that every :data:`POLL_S` seconds checks the launcher chain recorded at start: this
   process's parent, and, when that parent is ``deepspeed.launcher.launch`` started by the ``deepspeed``
   runner, the runner too (``torchrun``, ``mpirun``/``srun`` and others: the parent only). A link is broken
   when the launcher's pid is no longer the parent of the process below it (it died and the process below was
   reparented), which no pid reuse can fake. Then the thread logs one line, sends SIGTERM to this process and,
   if it is still alive :data:`GRACE_S` seconds later (a Python SIGTERM handler runs only when the main thread
   is back in Python, not while it waits inside a collective), ends it with ``os._exit(EXIT_CODE)``.

A rank that leaves this way makes ``launch.py`` stop the job (it terminates every rank once one fails); the
other ranks leave by their own watchdog, else by their collective timeout. Set ``MAGNETAR_PARENT_WATCHDOG=0``
to turn both mechanisms off (ranks then outlive a killed launcher, as upstream).

This module knows nothing about process groups or models.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

import psutil

log = logging.getLogger(__name__)

WATCHDOG_ENV = "MAGNETAR_PARENT_WATCHDOG"
POLL_S = 1.0  # how often the watchdog looks at the launcher chain
GRACE_S = 5.0  # after SIGTERM to itself, how long the watchdog waits before os._exit
EXIT_CODE = 128 + signal.SIGTERM  # the shell's status of a process ended by SIGTERM

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_chain: Optional[list[Link]] = None  # what this process's watchdog watches, once started
_lock = threading.Lock()


@dataclass(frozen=True)
class Link:
    """One launcher process and the process it must stay the parent of (this process, or a launcher below)."""

    pid: int
    child: int
    command: str  # its command line, for the log line


def watchdog_enabled() -> bool:
    """False when ``MAGNETAR_PARENT_WATCHDOG=0``; ``1`` or unset means on; any other value is a ValueError."""
    value = os.environ.get(WATCHDOG_ENV, "1").strip()
    if value not in ("0", "1", ""):
        raise ValueError(f"{WATCHDOG_ENV}={value!r}: set it to 0 (ranks may outlive their launcher) or 1 (the "
                         f"default: a rank exits when its launcher dies)")
    return value != "0"


def _cmdline(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:  # gone, a zombie, or not ours to read
        return []


def _parent_of(pid: int) -> Optional[int]:
    if pid == os.getpid():
        return os.getppid()
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None


def _is_deepspeed_launch(cmd: list[str]) -> bool:
    return any(a == "deepspeed.launcher.launch" or a.endswith(os.path.join("deepspeed", "launcher", "launch.py"))
               for a in cmd)


def _is_deepspeed_runner(cmd: list[str]) -> bool:
    # `python bin/deepspeed ...` (or its alias `ds`), or `python -m deepspeed.launcher.runner`: look only at the
    # interpreter, its flag and the script, not at the job's own arguments.
    return any(os.path.basename(a) in ("deepspeed", "ds") or a == "deepspeed.launcher.runner"
               or a.endswith(os.path.join("deepspeed", "launcher", "runner.py")) for a in cmd[:3])


def launcher_chain() -> list[Link]:
    """The launcher processes this process must not outlive, nearest first: the parent, plus the ``deepspeed``
    runner when the parent is its ``deepspeed.launcher.launch``."""
    me, parent = os.getpid(), os.getppid()
    parent_cmd = _cmdline(parent)
    chain = [Link(parent, me, " ".join(parent_cmd))]
    if _is_deepspeed_launch(parent_cmd):
        runner = _parent_of(parent)
        runner_cmd = _cmdline(runner) if runner is not None else []
        if _is_deepspeed_runner(runner_cmd):
            chain.append(Link(runner, parent, " ".join(runner_cmd)))
    return chain


def broken_link(chain: list[Link]) -> Optional[Link]:
    """The first link of ``chain`` whose launcher is gone (no longer the parent of its child), or None."""
    for link in chain:
        if _parent_of(link.child) != link.pid:
            return link
    return None


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent thread dies (Linux ``PR_SET_PDEATHSIG``);
    False (and nothing done) on other systems or when the call fails."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d); relying on the parent watchdog", ctypes.get_errno())
        return False
    return True


def _leave(link: Link, rank: str) -> None:
    log.error("launcher process %d (%s) is gone: rank %s (pid %d) exits; its peers leave by their own watchdog or "
              "their collective timeout (%s=0 keeps ranks alive)", link.pid, link.command[:120] or "?", rank,
              os.getpid(), WATCHDOG_ENV)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_S)
    os._exit(EXIT_CODE)


def _watch(chain: list[Link], rank: str) -> None:
    while True:
        link = broken_link(chain)
        if link is not None:
            _leave(link, rank)
        time.sleep(POLL_S)


def watch_launcher() -> Optional[list[Link]]:
    """Make this process exit when its launcher dies (see the module docstring); idempotent.

    Returns the launcher chain being watched, or None when ``MAGNETAR_PARENT_WATCHDOG=0``. Call it only in a
    process a launcher started (``magnetar.parallel.launcher.launched()``): it treats the parent as the launcher.
    """
    global _chain
    if not watchdog_enabled():
        return None
    with _lock:
        if _chain is not None:
            return _chain
        set_parent_death_signal(signal.SIGTERM)
        # Read after the prctl, so a parent that dies from here on is caught by one mechanism or the other. A
        # launcher that died before this call (the rank is already reparented) cannot be told from a launcher
        # running as pid 1 or as a subreaper, so it is not caught.
        _chain = launcher_chain()
        threading.Thread(target=_watch, args=(_chain, os.environ.get("RANK", "?")), name="magnetar-parent-watchdog",
                         daemon=True).start()
    log.debug("watching launcher chain %s", [(link.pid, link.command[:60]) for link in _chain])
    return _chain
