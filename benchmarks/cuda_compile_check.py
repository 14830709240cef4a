"""Compile Magnetar's CUDA ops on a machine without a GPU, as the GPU kit's ``ops_build`` step builds them on a card
(``make gpu-check-image`` runs it under the lent image's torch): nvcc for ``TORCH_CUDA_ARCH_LIST`` (default 9.0,
Hopper), each op's builder as the loader calls it, the library imported. Nothing runs on a device.

    TORCH_EXTENSIONS_DIR=/tmp/cuext python benchmarks/cuda_compile_check.py

The builders refuse without a visible device (``torch.cuda.is_available()``): this script alone says there is one
(and that it is a 9.0 card) for the build's sake. It needs ``nvcc`` (``CUDA_HOME``) and the CUDA headers torch's
include (cuSPARSE, cuBLAS: where the toolkit here lacks them, the ``nvidia-*`` wheels torch's CUDA build pulled in
hold them: ``CPATH=.../site-packages/nvidia/cu13/include``). Exit 0 when every op built and imported.
"""
from __future__ import annotations

import os
import sys
import time


def main() -> int:
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    import torch

    if torch.version.cuda is None:
        print(f"cuda_compile_check: torch {torch.__version__} is a CPU build (no CUDA headers): run it with a CUDA "
              f"build of torch (make gpu-check-image's venv)", file=sys.stderr)
        return 2
    arch = os.environ["TORCH_CUDA_ARCH_LIST"].split(";")[0].split()[0]
    major, minor = (int(x) for x in arch.rstrip("a+PTX").split(".")[:2])
    torch.cuda.is_available = lambda: True  # compile only: the builders refuse without a device
    torch.cuda.get_device_capability = lambda *a, **k: (major, minor)
    from magnetar.ops import op_builder

    failed = []
    for cls in (op_builder.MergeStatesCUDABuilder, op_builder.HammingCUDABuilder):
        t = time.perf_counter()
        try:
            module = cls().jit_load(verbose=False)
            print(f"{cls.NAME}: built for sm_{major}{minor} and imported in {time.perf_counter() - t:.1f} s "
                  f"({module.__file__})", flush=True)
        except Exception as e:  # the build log's tail names the failing include or line
            failed.append(cls.NAME)
            print(f"{cls.NAME}: FAILED after {time.perf_counter() - t:.1f} s: {type(e).__name__}: {str(e)[-2000:]}",
                  flush=True)
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}); "
          + (f"failed: {', '.join(failed)}" if failed else "every CUDA op compiled"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
