"""Named profiler ranges for Nsight Systems (NVTX) and ``torch.profiler``, from one exception-safe helper
that costs ~nothing when no profiler runs.

Usage::

    with nvtx_range(PHASE1_BLOCK, i=3):        # "magnetar/phase1/block3"
        ...

    @nvtx_range(SCORE)
    def score(...): ...

Every range the engine opens is one of the templates of :data:`RANGES` (``magnetar/<phase>/<step>``, fields in
braces), filled from the keyword arguments only when the range is emitted. docs/profiling.md lists the same
table (tests/test_nvtx.py compares the two, and checks every ``nvtx_range`` call of the package uses one).

Two sinks, each on only while its profiler is:

* **NVTX** (Nsight Systems) when Nsight is attached (it sets ``NVTX_INJECTION64_PATH``) or ``MAGNETAR_NVTX=1``;
  ``MAGNETAR_NVTX=0`` turns it off. Emitted through DeepSpeed's accelerator ``range_push``/``range_pop`` where
  they emit something (the CUDA accelerator: ``torch.cuda.nvtx``), else through the ``nvtx`` package (works
  without CUDA: Nsight traces CPU processes too). Both use NVTX's default domain, so a capture range is the bare
  name (``--nvtx-capture=magnetar/generate``). The environment is read at import; :func:`refresh` re-reads it.
* **torch.profiler** (``record_function``) while a torch profiler is running
  (``torch._C._autograd._profiler_enabled()``: the autograd profiler's own state, so profilers started outside
  Python, e.g. on demand, count too), so CPU users see the same names in a ``torch.profiler`` trace.

With neither on, entering a range is a check of each. The pops run in ``__exit__``, so an exception inside a
range never leaves a stack unbalanced (DeepSpeed's ``instrument_w_nvtx`` pushes and pops around the call without
``finally``).
"""
from __future__ import annotations

import functools
import os
from typing import Callable, Optional

import torch
from torch.autograd import profiler as _torch_profiler

# ---- the range names (templates; docs/profiling.md has the same table) ----
GENERATE = "magnetar/generate"
SCORE = "magnetar/score"
PHASE1 = "magnetar/phase1"
PHASE1_BLOCK = "magnetar/phase1/block{i}"
PHASE1_LAYER = "magnetar/phase1/layer{n}"
PHASE1_RING_STEP = "magnetar/phase1/ring/step{s}"
PHASE1_PREFILL_SPARSE = "magnetar/phase1/prefill_sparse/layer{n}"
PHASE1_LUKA_MASS = "magnetar/phase1/luka_mass/layer{n}"
PHASE2_QUERY = "magnetar/phase2/query"
PHASE2_DECODE_STEP = "magnetar/phase2/decode/step{t}"
PHASE2_SCORE = "magnetar/phase2/score"
PHASE2_LAYER = "magnetar/phase2/layer{n}"
PHASE2_GATHER = "magnetar/phase2/gather/layer{n}"
PHASE2_MERGE = "magnetar/phase2/merge/layer{n}"
PHASE2_SAMPLE = "magnetar/phase2/sample"
FORWARD_LAYER = "magnetar/forward/layer{n}"
ATTENTION = "magnetar/attention/{backend}"
ALL_GATHER_STATES = "magnetar/comm/all_gather_states"

RANGES: dict[str, str] = {  # template -> what the range spans
    GENERATE: "Engine.generate / generate_batch: Phase 1 of every request, then Phase 2 and decoding",
    SCORE: "Engine.score / score_variants: Phase 1, then the teacher-forced continuation",
    PHASE1: "one rank's Phase 1 of one request (simulated ranks: each in turn)",
    PHASE1_BLOCK: "the model forward of plan segment i (Star/Pulsar block i with its prefix; ring: the rank's shard)",
    PHASE1_LAYER: "the Phase-1 attention of layer n (through the method: local, ring, sparse prefill)",
    PHASE1_RING_STEP: "ring attention over the KV shard held at step s (its exchange runs beside it, unranged)",
    PHASE1_PREFILL_SPARSE: "sparse prefill's attention of layer n (indexer and top-k support)",
    PHASE1_LUKA_MASS: "the attention mass the segment's queries gave each kept key of layer n (LuKA)",
    PHASE2_QUERY: "the query's forward and the first token's choice and broadcast (time to first token)",
    PHASE2_DECODE_STEP: "decode step t (t = 1 makes the second generated token): one forward, choice, broadcast",
    PHASE2_SCORE: "one chunk of the teacher-forced continuation (perplexity)",
    PHASE2_LAYER: "the Phase-2 attention of layer n: local parts, gather and merge",
    PHASE2_GATHER: "the packed all-gather of every rank's (out, lse) of layer n",
    PHASE2_MERGE: "the merge of the gathered states of layer n",
    PHASE2_SAMPLE: "choosing the next token of every request of a forward, its broadcast and log-probabilities",
    FORWARD_LAYER: "the attention of layer n in a forward outside the phases (calibration)",
    ATTENTION: "one attention kernel call (backend: sdpa, cpu_flash, flash_attn, tiled, ...)",
    ALL_GATHER_STATES: "the collective of magnetar.parallel.all_gather_states alone",
}

# DeepSpeed accelerators whose range_push/range_pop emit something: the others' (cpu, xpu, hpu, npu, mps in
# DeepSpeed 0.19) are no-ops, so ranges go to the nvtx package instead.
_EMITTING_ACCELERATORS = ("cuda",)


def _accelerator_emitter() -> Optional[tuple[Callable, Callable]]:
    try:
        from deepspeed.accelerator import get_accelerator  # lazily: importing DeepSpeed takes seconds
    except ImportError:
        return None
    accel = get_accelerator()
    if accel.device_name() not in _EMITTING_ACCELERATORS:
        return None
    return accel.range_push, accel.range_pop


def _nvtx_package_emitter() -> Optional[tuple[Callable, Callable]]:
    try:
        import nvtx
    except ImportError:
        return None
    return nvtx.push_range, nvtx.pop_range


def _backend() -> Optional[tuple[Callable, Callable]]:
    flag = os.environ.get("MAGNETAR_NVTX")
    if flag == "0":
        return None
    if flag != "1" and not os.environ.get("NVTX_INJECTION64_PATH"):
        return None
    return _accelerator_emitter() or _nvtx_package_emitter()


_EMIT = _backend()
_profiling = torch._C._autograd._profiler_enabled  # True while a torch (autograd/Kineto) profiler records


def enabled() -> bool:
    """Whether NVTX ranges are emitted in this process (torch.profiler ranges follow the profiler)."""
    return _EMIT is not None


def refresh() -> bool:
    """Re-read the environment (e.g. after setting ``MAGNETAR_NVTX``); returns :func:`enabled`."""
    global _EMIT
    _EMIT = _backend()
    return enabled()


class nvtx_range:
    """Context manager and decorator for one range named ``name`` (a template of :data:`RANGES`) with its
    ``fields`` filled in: an NVTX range and a ``torch.profiler`` ``record_function``, each while its profiler
    is on."""

    __slots__ = ("name", "fields", "_open")

    def __init__(self, name: str, **fields):
        self.name, self.fields = name, fields
        self._open = []  # per open entry (re-entrant use): None, or (NVTX pop or None, record_function or None)

    @property
    def message(self) -> str:
        return self.name.format(**self.fields) if self.fields else self.name

    def __enter__(self):
        emit = _EMIT
        if emit is None and not _profiling():
            self._open.append(None)
            return self
        msg, pop, rf = self.message, None, None
        if emit is not None:
            emit[0](msg)
            pop = emit[1]  # pop with the emitter that pushed, even if refresh() runs in between
        if _profiling():
            try:
                rf = _torch_profiler.record_function(msg)
                rf.__enter__()
            except BaseException:
                if pop is not None:
                    pop()
                raise
        self._open.append((pop, rf))
        return self

    def __exit__(self, exc_type, exc, tb):
        opened = self._open.pop()
        if opened is not None:
            pop, rf = opened
            try:
                if rf is not None:
                    rf.__exit__(exc_type, exc, tb)
            finally:
                if pop is not None:
                    pop()
        return False  # never swallow the exception

    def __call__(self, fn: Callable) -> Callable:
        name, fields = self.name, self.fields

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with nvtx_range(name, **fields):
                return fn(*args, **kwargs)

        return wrapper
