"""``python -m magnetar.ops``: the fused-op report, DeepSpeed's ``ds_report`` for Magnetar's ops.

One row per op builder of :data:`magnetar.ops.op_builder.ALL_OPS` (CPU and CUDA builds of the merge and the
Hamming op, the CPU sparse prefill op):

* ``compatible`` -- ``builder.is_compatible()``: a JIT build can work on this machine (else the reason is shown);
* ``prebuilt`` -- installed by ``DS_BUILD_MAGNETAR_OPS=1 pip install`` and usable (built against this torch from
  the sources now shipped); a prebuild that is not usable is shown with the reason;
* ``JIT-cached`` -- a JIT build of this checkout's op name exists under torch's extensions folder (reused unless
  a source or flag changed).

Then the versions that decide all three: torch (and its CUDA), DeepSpeed, CUDA_HOME / nvcc, the C++ compiler,
the extensions folder and the prebuilt-ops record. ``--json`` prints the same as one JSON object. Builds nothing.
"""
from __future__ import annotations

import contextlib
import json
import shutil
import sys
from dataclasses import asdict, dataclass
from typing import Optional

from magnetar.utils.cli import ArgumentParser

PROG = "python -m magnetar.ops"


@dataclass(frozen=True)
class OpRow:
    op: str  # the builder's NAME
    device: str  # "cpu" or "cuda"
    compatible: bool
    prebuilt: bool
    jit_cached: bool
    notes: tuple[str, ...]  # why incompatible; why a prebuild is not used; where the JIT build is


def op_rows() -> list[OpRow]:
    """The report's rows, one per op builder."""
    from deepspeed.ops.op_builder.builder import CUDAOpBuilder

    from magnetar.ops.jit import jit_cached
    from magnetar.ops.op_builder import ALL_OPS

    rows = []
    for name, cls in ALL_OPS.items():
        builder = cls()
        compatible = bool(builder.is_compatible(verbose=False))
        status = builder.prebuilt_status()
        cached = jit_cached(builder.name)
        notes = []
        if not compatible:
            notes.append(f"incompatible: {builder.error_log or 'no reason given'}")
        if status.recorded and not status.usable:
            notes.append(f"prebuild not used: {status.reason}")
        if cached is not None:
            notes.append(f"JIT build: {cached}")
        rows.append(OpRow(name, "cuda" if isinstance(builder, CUDAOpBuilder) else "cpu", compatible, status.usable,
                          cached is not None, tuple(notes)))
    return rows


def environment() -> dict[str, Optional[str]]:
    """What the op builds depend on, as strings (None: absent)."""
    import deepspeed
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    from magnetar.ops.jit import extensions_root
    from magnetar.ops.op_builder import PREBUILT_RECORD, _cxx_compiler

    compiler = _cxx_compiler()
    return {
        "attention (auto)": _attention_choice(),
        "python": sys.version.split()[0],
        "torch": str(torch.__version__),
        "torch CUDA": torch.version.cuda,
        "CUDA device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "deepspeed": deepspeed.__version__,
        "CUDA_HOME": CUDA_HOME,
        "nvcc": shutil.which("nvcc"),
        "C++ compiler": shutil.which(compiler.split()[0]) if compiler.strip() else None,
        "torch extensions dir": str(extensions_root()),
        "prebuilt ops record": str(PREBUILT_RECORD) if PREBUILT_RECORD.is_file() else None,
    }


def _attention_choice() -> str:
    """The auto order, and what ``auto`` picks here for a bf16 causal prefill, a decode call (one token over every
    key; cpu_decode's pass named), a general position mask, and a decode step's paged batch (cpu_decode on a CPU,
    triton_decode on CUDA where Triton runs, else page by page)."""
    import torch

    from magnetar.ops.backends import AUTO_ORDER, select_backend
    from magnetar.ops.call import CAUSAL_BOTTOM_RIGHT, FULL, POSITIONS, AttentionCall

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.zeros(1, 4, 8, 64, dtype=torch.bfloat16, device=dev)
    kv = torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16, device=dev)
    picks = []
    for what, kind, pos, rows in (("causal", CAUSAL_BOTTOM_RIGHT, None, q), ("decode", FULL, None, q[:, :, -1:]),
                                  ("position mask", POSITIONS, torch.arange(8, device=dev).flip(0), q)):
        try:
            name = select_backend(AttentionCall(rows, kv, kv, pos, pos, 0.125, kind)).name
        except ValueError as e:
            picks.append(f"{what}: none ({e})")
            continue
        if name == "cpu_decode":  # its bf16 pass on this CPU
            from magnetar.ops.backends.cpu_decode import DECODE_ATTENTION_OP

            name += " (AVX-512 BF16 pass)" if DECODE_ATTENTION_OP.load("cpu").avx512_bf16() else " (AVX2 pass)"
        picks.append(f"{what}: {name}")
    from magnetar.ops.pages import PageByPage, page_backend

    paged = page_backend("auto", torch.device(dev))
    picks.append(f"a decode step's pages: {'page by page' if isinstance(paged, PageByPage) else paged.name}")
    from magnetar.ops.backends import list_backends
    from magnetar.ops.backends.measured import preferred

    try:
        first = preferred(torch.device(dev), list_backends)
    except ValueError as e:  # MAGNETAR_ATTENTION_ORDER names an unknown backend
        first, picks = (), [*picks, str(e)]
    order = [*first, *(n for n in AUTO_ORDER if n not in first)]
    return f"{' > '.join(order)}; on {dev} bf16 auto picks {', '.join(picks)}"


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def format_report(rows: list[OpRow], env: dict[str, Optional[str]]) -> str:
    width = max(len(r.op) for r in rows)
    rule = "-" * (width + 44)
    lines = [rule, "Magnetar fused ops (DS_BUILD_MAGNETAR_OPS=1 pip install --no-build-isolation . prebuilds them)",
             rule, f"{'op':{width}s}  device  compatible  prebuilt  JIT-cached"]
    for r in rows:
        lines.append(f"{r.op:{width}s}  {r.device:6s}  {_yes(r.compatible):10s}  {_yes(r.prebuilt):8s}  "
                     f"{_yes(r.jit_cached)}")
        lines += [f"{'':{width}s}    {note}" for note in r.notes]
    lines.append(rule)
    key_width = max(len(k) for k in env)
    lines += [f"{k + ' ':.<{key_width + 4}} {v if v is not None else '(none)'}" for k, v in env.items()]
    lines.append(rule)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog=PROG, description="Report Magnetar's fused ops: compatible, prebuilt, JIT-cached.")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    # DeepSpeed logs to stdout (its handler takes sys.stdout when first imported, here): keep stdout the report's
    with contextlib.redirect_stdout(sys.stderr):
        rows, env = op_rows(), environment()
    if args.json:
        print(json.dumps({"ops": [asdict(r) for r in rows], "environment": env}))
    else:
        print(format_report(rows, env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
