"""Compile triton_decode's kernel for sm_90 without a GPU (Triton's own ptxas): every variant the engine launches.

Run (from the repository root): TRITON_DEFAULT_FP_FUSION=1 [PYTHONPATH=<a Triton 3.6 target dir>] \
    .venv/bin/python docs/results/static_in_place_2026-12-07/triton_aot.py
"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from magnetar.ops.backends.triton_decode import _kernel, TILE

fn = _kernel()
names = fn.arg_names
print("triton", triton.__version__)
ok = 0
for dt in ("bf16", "fp32", "fp16"):
    for positions, window in ((True, False), (True, True), (False, False)):
        for pages in (1, 4):
            sig = {}
            for n in names:
                if n in ("Q",):
                    sig[n] = f"*{dt}"
                elif n in ("QPOS", "KT", "VT", "PT", "NT", "KH", "VH"):
                    sig[n] = "*i64"
                elif n in ("O", "L"):
                    sig[n] = "*fp32"
                elif n == "scale":
                    sig[n] = "fp32"
                elif n in ("window", "nsplit", "sqb", "sqh", "sqd", "sob", "soh", "sos", "slb", "slh", "sls"):
                    sig[n] = "i32"
                else:
                    sig[n] = "constexpr"
            const = dict(G=4, BG=16, D=128, BD=128, BN=TILE, WINDOW=window, IEEE=dt == "fp32", POSITIONS=positions,
                         PAGES=pages)
            src = ASTSource(fn=fn, signature=sig, constexprs=const)
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32))
            ok += 1
            print(dt, "positions" if positions else "pages", "window" if window else "", pages, "ok:",
                  k.metadata.name, "shared memory", k.metadata.shared,
                  "bytes; cubin", len(k.asm.get("cubin", b"")), "bytes")
print("compiled", ok)
