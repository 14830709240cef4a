"""``magnetar.launch.run`` with one fault injected on one rank -- test-only, started by tests/test_faults.py
under a launcher (``torchrun ... tests/fault_script.py RUN-ARGS``).

``MAGNETAR_TEST_FAULT=KIND:PHASE:RANK:CALL`` picks the fault: on global rank RANK, at the CALL-th forward of the
model's decoder inside the engine's Phase PHASE (1 or 2; Phase 2's first forward is the query, the second the first
decode step), KIND happens:

* ``kill``: the rank SIGKILLs itself (no traceback, no cleanup: as an OOM kill or a lost node);
* ``hang``: the rank sleeps for good, so its peers wait in their next collective.

With ``MAGNETAR_TEST_FAULT_DIR`` set, the faulty rank first writes its pid to ``DIR/KIND.RANK`` and every other
rank writes ``DIR/ready.RANK`` as it enters that phase.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import magnetar.engine.encode as encode_module
import magnetar.engine.engine as engine_module
from magnetar.launch import run


def _arm(kind: str, phase: str, rank: int, call: int) -> None:
    # Phase 1 runs in the encoder (run_phase1(model, ...)); Phase 2 in the engine's one decode driver (Engine._run)
    if phase == "1":
        owner, name, model_of = encode_module, "run_phase1", lambda args: args[0]
    else:
        owner, name, model_of = engine_module.Engine, "_run", lambda args: args[0].model
    original = getattr(owner, name)
    me = int(os.environ["RANK"])
    mark_dir = os.environ.get("MAGNETAR_TEST_FAULT_DIR")

    def mark(what: str) -> None:
        if mark_dir:
            with open(os.path.join(mark_dir, f"{what}.{me}"), "w") as f:
                f.write(str(os.getpid()))

    def faulty(*args, **kwargs):
        if me != rank:
            mark("ready")
            return original(*args, **kwargs)
        calls = 0

        def hook(module, inputs):
            nonlocal calls
            calls += 1
            if calls != call:
                return
            mark(kind)
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            while True:
                time.sleep(60)

        # on the decoder: Phase 1 calls it directly, Phase 2 through the LM head's model
        handle = model_of(args).get_decoder().register_forward_pre_hook(hook)
        try:
            return original(*args, **kwargs)
        finally:
            handle.remove()

    setattr(owner, name, faulty)


if __name__ == "__main__":
    kind, phase, rank, call = os.environ["MAGNETAR_TEST_FAULT"].split(":")
    if kind not in ("kill", "hang") or phase not in ("1", "2"):
        raise ValueError(f"MAGNETAR_TEST_FAULT={os.environ['MAGNETAR_TEST_FAULT']!r}: want kill|hang:1|2:RANK:CALL")
    _arm(kind, phase, int(rank), int(call))
    sys.exit(run.main())
