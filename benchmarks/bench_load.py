"""Host memory of loading a model on every rank: per-rank loading (by path) vs a whole model per rank (object).

    torchrun --nproc-per-node 4 benchmarks/bench_load.py --cp-size 4                        # SmolLM2, tp 1
    torchrun --nproc-per-node 3 benchmarks/bench_load.py --cp-size 1 --tp-size 3            # SmolLM2, tp 3
    torchrun --nproc-per-node 4 benchmarks/bench_load.py --model DIR --cp-size 2 --tp-size 2

``--mode path`` (default) is ``init_inference(model_name_or_folder, ...)``: each rank builds the model on the meta
device and fills its own storage from the safetensors, only its shard under TP
(``magnetar/engine/tensor_parallel.py``). ``--mode object`` is what a user doing it by hand (and Magnetar
before) gets: ``magnetar.models.load_model`` (``from_pretrained``, the whole model in host memory) on every
rank, then ``init_inference(model, ...)``, which cuts it under TP. Both runs end with one short ``generate`` so
the engine is really usable. Per rank: the host peak (``ru_maxrss``, which includes the Python/torch/transformers
baseline measured after the imports), the resident memory after the generate split into private anonymous and
file-backed pages (a mapped safetensors file: page cache shared by the ranks of a host), the load seconds and the
weight bytes the rank holds. Rank 0 prints a table,
then one JSON line. Run each mode in its own launch: ``ru_maxrss`` never goes down within a process.
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import time

import torch


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _resident_mib() -> tuple[float, float]:
    """Now: (private anonymous, file-backed) resident MiB. File-backed pages (a safetensors file mapped by the
    loader) are the page cache, shared by every rank that maps the same file; anonymous ones are this rank's."""
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return tuple(int(fields[k].split()[0]) / 1024 for k in ("RssAnon", "RssFile"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="magnetar.models name or local HF folder")
    p.add_argument("--mode", choices=("path", "object"), default="path")
    p.add_argument("--cp-size", type=int, default=1)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--method", default=None, help="default: star when cp-size > 1, else dense")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "auto"))
    args = p.parse_args(argv)

    import torch.distributed as dist
    import transformers  # noqa: F401  (the baseline includes the libraries every mode imports)

    import magnetar
    from magnetar.models import load_model, prepare_model
    from magnetar.models.registry import MODELS
    from magnetar.parallel.launcher import finish_distributed, import_deepspeed, init_distributed

    init_distributed()
    import_deepspeed()
    if args.model in MODELS:
        prepare_model(args.model)  # converted once (not part of the measurement)
    base = _rss_mib()
    t0 = time.perf_counter()
    method = args.method or ("star" if args.cp_size > 1 else "dense")
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else "auto"
    model = args.model if args.mode == "path" else load_model(args.model, dtype=dtype)[0]
    eng = magnetar.init_inference(model, method=method, cp_size=args.cp_size, tp_size=args.tp_size, dtype=args.dtype)
    load_s = time.perf_counter() - t0
    after_load = _rss_mib()
    ctx = torch.arange(2, 258) % 1000
    eng.generate(ctx, torch.tensor([5, 6, 7]), max_new_tokens=2)
    anon, file = _resident_mib()
    mine = [dist.get_rank() if dist.is_initialized() else 0, base, after_load, _rss_mib(), anon, file, load_s,
            eng.weight_bytes_per_rank[eng.groups.cp_rank * eng.groups.tp_size + eng.groups.tp_rank]]
    rows = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, mine)
    if rows[0] is not mine and dist.get_rank() != 0:
        finish_distributed()
        return 0
    print(f"model {args.model} ({args.dtype}), mode {args.mode}, tp {args.tp_size} x cp {args.cp_size} "
          f"({len(rows)} ranks), "
          f"{platform.node()}")
    print("| rank | baseline MiB | peak after load MiB | peak after generate MiB | then anon MiB | then file MiB | "
          "load s | weights MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r, b, a, g, an, fi, s, w in rows:
        print(f"| {r} | {b:.0f} | {a:.0f} | {g:.0f} | {an:.0f} | {fi:.0f} | {s:.1f} | {w / 2**20:.0f} |")
    print(json.dumps(dict(bench="load", model=args.model, dtype=args.dtype, mode=args.mode, tp=args.tp_size,
                          cp=args.cp_size,
                          platform=platform.platform(), torch=torch.__version__,
                          ranks=[dict(rank=r, baseline_mib=b, peak_after_load_mib=a, peak_after_generate_mib=g,
                                      anon_after_generate_mib=an, file_after_generate_mib=fi, load_seconds=s,
                                      weight_bytes=w) for r, b, a, g, an, fi, s, w in rows])))
    finish_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
