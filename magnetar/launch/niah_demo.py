"""``make demo``: one needle-in-a-haystack question answered by dense, Star, Pulsar and Ring on a real model.

    deepspeed --num_gpus 4 --module magnetar.launch.niah_demo --context-tokens 3000
    torchrun --nproc-per-node 4 -m magnetar.launch.niah_demo ...

The model (default SmolLM2-135M-Instruct) is prepared offline from its PyPI package on first use (rank 0
converts, the others wait). The haystack is Paul Graham essays with a RULER-style magic-number needle at
``--depth``; the prompt is split as in the Pulsar paper's Appendix B (instruction + context -> Phase 1,
question + assistant header -> Phase 2). ``dense`` runs on rank 0 alone (the reference); the other methods
spread the context over all ranks. Rank 0 prints each answer, whether it is right and the timings side by
side, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys

from magnetar.config import DISTRIBUTED_METHODS, METHODS
from magnetar.cli.args import parse_names
from magnetar.utils.cli import ArgumentParser, add_launcher_args, check_output_file, int_at_least, user_errors

PROG = "magnetar-demo"


def main(argv=None) -> int:
    p = ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--context-tokens", type=int_at_least(1), default=3000)
    p.add_argument("--depth", type=float, default=0.5, help="where the needle sits, 0 (start) to 1 (end)")
    p.add_argument("--seed", type=int_at_least(0), default=0)
    p.add_argument("--methods", default="dense,star,pulsar,ring")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=32)
    p.add_argument("--json-out")
    add_launcher_args(p)
    args = p.parse_args(argv)  # --help and a bad flag answer before torch is imported
    import torch.distributed as dist

    from magnetar.models import ModelNotInstalledError, check_model
    from magnetar.parallel.collectives import barrier
    from magnetar.parallel.launcher import init_distributed, launched_world_size

    with user_errors(PROG):
        methods = parse_names(args.methods, tuple(METHODS), "--methods")
        if not 0.0 <= args.depth <= 1.0:  # also refuses nan
            raise ValueError(f"--depth must be in [0, 1] (0: the needle at the start, 1: at the end), got {args.depth}")
        check_model(args.model)
        launched_world_size()  # a launcher's variable that is no int is named here, not inside torch
        if args.json_out is not None:
            check_output_file(args.json_out, flag="--json-out")

    import magnetar
    from magnetar.data.niah import INSTRUCTION, needle_prompt, score_answer
    from magnetar.models import MODELS, load_model, prepare_model

    init_distributed()
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    with user_errors(PROG, extra=(ModelNotInstalledError,)):
        if rank == 0 and args.model in MODELS:
            prepare_model(args.model)  # converts once into the cache; later runs just load
        barrier()
        model, tokenizer = load_model(args.model)
        limit = getattr(model.config, "max_position_embeddings", None)
        if limit is not None and args.context_tokens + args.max_new_tokens > limit:
            raise ValueError(f"--context-tokens {args.context_tokens} + --max-new-tokens {args.max_new_tokens} exceed "
                             f"the model's {limit} positions; lower --context-tokens")
        sample = needle_prompt(tokenizer, args.context_tokens, args.depth, seed=args.seed)
    context, query = f"{INSTRUCTION}\n\n{sample.context}", f"\n\n{sample.query}"

    rows, model_obj = [], model
    for i, method in enumerate(methods):
        cp = world if method in DISTRIBUTED_METHODS else 1
        # every rank builds every engine (group creation is collective); dense runs on rank 0 only
        engine = magnetar.init_inference(model_obj, method=method, cp_size=cp, deepspeed_inference=(i == 0),
                                         tokenizer=tokenizer)
        model_obj = engine.model
        if cp == 1 and rank != 0:
            barrier()
            continue
        with user_errors(PROG):  # the engine's checks of the request (e.g. its length) precede any compute
            res = engine.generate(context, query, max_new_tokens=args.max_new_tokens)
        if cp == 1:
            barrier()
        rows.append((method, cp, res, score_answer(res.text, sample.answer)))

    if rank == 0:
        print(f"\nNeedle: {sample.needle!r} at depth {sample.depth:.2f}; {rows[0][2].context_tokens} context tokens, "
              f"{world} rank(s), model {args.model}\n")
        head = (f"{'method':<8}{'ranks':>6}{'right':>7}{'phase-1 s':>11}{'TTFT s':>9}{'ms/token':>10}  "
                f"{'KV tokens per rank':<24} answer")
        print(head)
        for method, cp, res, ok in rows:
            dec = f"{res.decode_seconds_per_token * 1e3:.0f}" if res.decode_seconds_per_token else "-"
            kv = ",".join(str(t) for t in res.context_kv_tokens_per_rank)
            print(f"{method:<8}{cp:>6}{'yes' if ok else 'no':>7}{res.phase1_critical_path_seconds:>11.2f}"
                  f"{res.ttft_seconds:>9.2f}{dec:>10}  {kv:<24} {res.text.strip()[:60]!r}")
        summary = {"demo": "niah", "model": args.model, "world": world, "context_tokens": rows[0][2].context_tokens,
                   "answer": sample.answer, "depth": sample.depth,
                   "results": [dict(method=m, cp_size=cp, correct=ok, text=r.text,
                                    phase1_critical_path_s=r.phase1_critical_path_seconds, ttft_s=r.ttft_seconds,
                                    decode_s_per_token=r.decode_seconds_per_token,
                                    context_kv_tokens_per_rank=r.context_kv_tokens_per_rank,
                                    peak_memory_mib_per_rank=[b / 2**20 for b in r.peak_memory_bytes_per_rank])
                               for m, cp, r, ok in rows]}
        print(json.dumps(summary))
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(summary, f, indent=1)
    if dist.is_initialized():
        barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    import torch

    torch.set_grad_enabled(False)
    sys.exit(main())
