"""Distributed demo of Magnetar's primitives, run by ``make demo`` under the ``deepspeed`` launcher.

    deepspeed --num_gpus 2 --module magnetar.launch.demo --seq-len 4096      # 2 ranks (CPU ranks use gloo)
    torchrun --nproc-per-node 2 -m magnetar.launch.demo

Every rank holds a shard of one long sequence's q/k/v (SmolLM2-135M's attention geometry: 9 query heads,
3 KV heads, head dim 64). It runs

1. exact context-parallel prefill with ring attention over zigzag shards, and
2. a Star/Pulsar-style Phase 2: one decode query attends each rank's local KV shard, then the partial
   ``(out, lse)`` are gathered in one collective and merged,

and checks both against dense attention over the whole sequence computed on one rank. Rank 0 prints a table
and a final JSON line. The engine issue replaces this with the real model job.
"""
from __future__ import annotations

import json
import time

from magnetar.utils.cli import ArgumentParser, add_launcher_args, int_at_least


def _timed(fn, group=None):
    import torch.distributed as dist

    from magnetar.parallel.collectives import barrier

    if dist.is_initialized():
        barrier(group)  # start every rank's clock together
    t0 = time.perf_counter()
    res = fn()
    return res, time.perf_counter() - t0


def main(argv=None):
    p = ArgumentParser(prog="magnetar-ops-demo", description="Ring attention + distributed (out, lse) merge demo")
    p.add_argument("--seq-len", type=int_at_least(1), default=4096)
    p.add_argument("--heads", type=int_at_least(1), default=9)
    p.add_argument("--kv-heads", type=int_at_least(1), default=3)
    p.add_argument("--head-dim", type=int_at_least(1), default=64)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    add_launcher_args(p)
    args = p.parse_args(argv)
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    import torch  # after the flags: --help and a bad flag answer without it
    import torch.distributed as dist

    from magnetar.ops import attention_with_lse, merge_states
    from magnetar.parallel import (all_gather_states, contiguous_indices, init_groups, ring_attention, shard,
                                   zigzag_indices)
    from magnetar.parallel.collectives import barrier
    from magnetar.parallel.launcher import device_for_rank, init_distributed

    init_distributed()
    groups = init_groups(cp_size=dist.get_world_size() if dist.is_initialized() else 1)
    device = device_for_rank()
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    W, r, S = groups.cp_size, groups.cp_rank, args.seq_len

    g = torch.Generator().manual_seed(0)  # identical global tensors on every rank
    q = torch.randn(1, args.heads, S + 1, args.head_dim, generator=g).to(device, dtype)
    k = torch.randn(1, args.kv_heads, S, args.head_dim, generator=g).to(device, dtype)
    v = torch.randn(1, args.kv_heads, S, args.head_dim, generator=g).to(device, dtype)
    q_ctx, q_dec = q[:, :, :S], q[:, :, S:]

    # warm-up: loads the fused merge op (JIT build on first use, cached afterwards) outside the timings
    merge_states(torch.zeros(2, 1, 1, 1, 1, device=device, dtype=dtype), torch.zeros(2, 1, 1, 1, device=device))

    # 1. ring attention prefill over zigzag shards
    idx = zigzag_indices(S, W, r).to(device)
    (ring_out, _), t_ring = _timed(lambda: ring_attention(
        shard(q_ctx, idx, 2), shard(k, idx, 2), shard(v, idx, 2), group=groups.cp_group, q_pos=idx, k_pos=idx,
        timeout=groups.timeout), groups.cp_group)
    # 2. Phase-2-style decode: local attention over the contiguous shard, one gather, one merge
    cidx = contiguous_indices(S, W, r).to(device)
    q_pos = torch.tensor([S], device=device)

    def phase2():
        out, lse = attention_with_lse(q_dec, shard(k, cidx, 2), shard(v, cidx, 2), q_pos=q_pos, k_pos=cidx)
        outs, lses = all_gather_states(out, lse, groups.cp_group, timeout=groups.timeout)
        return merge_states(outs, lses)

    (dec_out, _), t_dec = _timed(phase2, groups.cp_group)

    # dense references on every rank (each checks its own piece)
    (dense_ctx, _), t_dense = _timed(lambda: attention_with_lse(q_ctx, k, v))
    dense_dec, _ = attention_with_lse(q_dec, k, v, q_pos=q_pos)
    err_ring = (ring_out.float() - shard(dense_ctx, idx, 2).float()).abs().max().item()
    err_dec = (dec_out.float() - dense_dec.float()).abs().max().item()

    rows = [(r, t_ring, t_dec, err_ring, err_dec, t_dense)]
    if dist.is_initialized():
        gathered = [None] * W
        dist.all_gather_object(gathered, rows[0], group=groups.cp_group)
        rows = gathered
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    ok = all(er < tol and ed < tol for _, _, _, er, ed, _ in rows)
    if r == 0:
        print(f"\nMagnetar ops demo: {W} rank(s), {S} tokens, Hq={args.heads} Hkv={args.kv_heads} D={args.head_dim} "
              f"{args.dtype} on {device}")
        print(f"{'rank':>4} {'ring prefill s':>15} {'phase-2 ms':>11} {'ring max err':>13} {'merge max err':>14} "
              f"{'dense 1-rank s':>15}")
        for rk, tr, td, er, ed, tdn in rows:
            print(f"{rk:>4} {tr:>15.3f} {td * 1e3:>11.2f} {er:>13.2e} {ed:>14.2e} {tdn:>15.3f}")
        print("ring attention and the distributed merge match dense attention" if ok else "MISMATCH vs dense")
        print(json.dumps({"demo": "ops", "world": W, "seq_len": S, "dtype": args.dtype, "ok": ok,
                          "ring_prefill_s_critical_path": max(x[1] for x in rows),
                          "dense_prefill_s": rows[0][5], "phase2_ms": max(x[2] for x in rows) * 1e3,
                          "max_err_ring": max(x[3] for x in rows), "max_err_merge": max(x[4] for x in rows)}))
    if dist.is_initialized():
        barrier(groups.cp_group, timeout=groups.timeout)
        dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
