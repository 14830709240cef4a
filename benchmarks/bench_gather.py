"""The per-layer gather of Phase 2 alone: gloo's all-gather against the shared-memory one (``parallel.shm_gather``).

    torchrun --nproc-per-node 2 benchmarks/bench_gather.py            # 2 CPU ranks, 1 thread each

Each rank runs ``--steps`` decode-like steps of ``--layers`` layers: per layer ~1 ms of matmuls (``--work``
SmolLM2-sized MLP projections of one token) and one ``all_gather_states`` of a batch-1 state (9 heads x 64 dims);
first the work alone, then with gloo's gather, then through shared memory, twice each (alternated). Prints ms per
step (rank 0), then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--work", type=int, default=6, help="matmuls of one token by a 1536 x 576 weight per layer")
    args = p.parse_args()
    torch.set_num_threads(1)
    timeout = timedelta(seconds=60)
    dist.init_process_group("gloo", timeout=timeout)
    from magnetar.parallel import all_gather_states, shm

    group = dist.new_group(list(range(dist.get_world_size())), timeout=timeout)
    w, x = torch.randn(1536, 576), torch.randn(1, 576)
    out, lse = torch.randn(1, 9, 1, 64), torch.randn(1, 9, 1)

    def step(gather: bool) -> None:
        for _ in range(args.layers):
            for _ in range(args.work):
                torch.nn.functional.linear(x, w)
            if gather:
                all_gather_states(out, lse, group, timeout=timeout)

    rows = {}
    for label in ("work only", "gloo", "shared memory", "gloo", "shared memory"):
        if label == "shared memory":
            shm.enable(group, timeout)
        else:
            shm.disable_all()
        for _ in range(3):
            step(label != "work only")
        dist.monitored_barrier(group, timeout=timeout)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step(label != "work only")
        ms = 1000 * (time.perf_counter() - t0) / args.steps
        rows.setdefault(label, []).append(round(ms, 1))
    if dist.get_rank() == 0:
        print(f"| {dist.get_world_size()} ranks, {args.layers} layers | ms per step (runs) |\n|---|---|")
        for label, runs in rows.items():
            print(f"| {label} | {', '.join(f'{r:.1f}' for r in runs)} |")
        print(json.dumps(dict(bench="gather", ranks=dist.get_world_size(), layers=args.layers, ms_per_step=rows)))
    shm.disable_all()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
