"""Registers and stack (spills) of triton_decode's kernel compiled for sm_90 without a GPU: cuobjdump on the cubins.

Run (from the repository root): TRITON_DEFAULT_FP_FUSION=1 .venv/bin/python \\
    docs/results/static_in_place_2026-12-07/triton_resources.py
"""
import os
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from magnetar.ops.backends.triton_decode import TILE, _kernel

fn = _kernel()
bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
pointers = {"QPOS", "KT", "VT", "PT", "NT", "KH", "VH"}
ints = {"window", "nsplit", "sqb", "sqh", "sqd", "sob", "soh", "sos", "slb", "slh", "sls"}
variants = (("bf16", True, 4, 4), ("bf16", False, 2, 4), ("fp32", True, 4, 4), ("bf16", True, 4, 8))
for dtype, positions, pages, warps in variants:
    sig = {n: (f"*{dtype}" if n == "Q" else "*i64" if n in pointers else "*fp32" if n in ("O", "L")
               else "fp32" if n == "scale" else "i32" if n in ints else "constexpr") for n in fn.arg_names}
    const = dict(G=4, BG=16, D=128, BD=128, BN=TILE, WINDOW=False, IEEE=dtype == "fp32", POSITIONS=positions,
                 PAGES=pages)
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps))
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    out = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "--dump-resource-usage", f.name],
                         capture_output=True, text=True).stdout
    line = [row for row in out.splitlines() if "REG" in row]
    print(dtype, "positions" if positions else "pages", pages, "warps", warps, line[0].strip() if line else out[-300:])
