"""``magnetar-eval``: run evaluation suites over methods and lengths, resumably, on one or many ranks.

    python -m magnetar.eval --suite ruler --methods dense,star,pulsar,ring --lengths 4k --samples 10 --out runs/r4k
    deepspeed --num_gpus 4 --module magnetar.eval --suite niah --methods star,pulsar,ring --lengths 8k --out runs/n8k
    python -m magnetar.eval --report --out runs/r4k           # markdown table + PNG plots from the JSONL

Every (suite, task, method, length, sample) item is generated deterministically from the seed, answered by
the engine, scored, and appended by rank 0 to ``OUT/results.jsonl``; a rerun skips what is already there, so
an interrupted run resumes. Context-parallel methods use all launched ranks (``--cp`` overrides);
``dense`` and ``streaming`` run on rank 0 while the others wait. Engine options pass through (``--block-size``,
``--scorer``, ``--summary-budget`` ...) and are part of each item's key, so runs with other options do not
collide.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from magnetar.config import EngineConfig, add_cli_args
from magnetar.launch.distributed import add_launcher_args, init_distributed
from magnetar.parallel.collectives import barrier

SUITES = ("ruler", "niah", "babilong")
CP_METHODS = ("ring", "star", "pulsar")
NIAH_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def parse_length(text: str) -> int:
    t = text.strip().lower()
    return int(float(t[:-1]) * 1024) if t.endswith("k") else int(t)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="magnetar-eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--suite", choices=SUITES, default="ruler")
    p.add_argument("--tasks", help="comma-separated subset of the suite's tasks (default: all)")
    p.add_argument("--methods", default="dense,star,pulsar,ring")
    p.add_argument("--lengths", default="4k", help="e.g. 2k,4k,8k (k = 1024 tokens)")
    p.add_argument("--samples", type=int, default=10, help="samples per task (niah: per depth)")
    p.add_argument("--data-seed", type=int, default=0, help="seed of the generated samples (--seed is the sampling seed)")
    p.add_argument("--cp", type=int, help="cp_size for ring/star/pulsar (default: the world size)")
    p.add_argument("--out", required=True, help="output directory (results.jsonl, report.md, plots)")
    p.add_argument("--report", action="store_true", help="only write the report from OUT/results.jsonl")
    add_cli_args(p)
    add_launcher_args(p)
    return p


def suite_tasks(suite: str) -> tuple[str, ...]:
    if suite == "ruler":
        from magnetar.eval.ruler import TASKS

        return TASKS
    if suite == "niah":
        return ("niah",)
    from magnetar.eval import babilong

    return tuple(babilong.TASKS)


def make_sample(suite: str, task: str, tokenizer, length: int, index: int, seed: int):
    """The sample and its extra key fields (niah: depth)."""
    if suite == "ruler":
        from magnetar.eval.ruler import ruler_sample

        return ruler_sample(task, tokenizer, length, seed=seed * 100003 + index), {}
    if suite == "niah":
        from magnetar.data.niah import INSTRUCTION, needle_prompt
        from magnetar.eval.ruler import EvalSample

        depth = NIAH_DEPTHS[index % len(NIAH_DEPTHS)]
        s = needle_prompt(tokenizer, length, depth, seed=seed * 100003 + index)
        return EvalSample(task="niah", context=f"{INSTRUCTION}\n\n{s.context}", query=f"\n\n{s.query}",
                          answers=(s.answer,), answer_prefix="", metric="all", max_new_tokens=32,
                          metadata={"depth": depth}), {"depth": depth}
    from magnetar.eval import babilong

    return babilong.babilong_sample(task, tokenizer, length, seed=seed * 100003 + index), {}


def score_sample(suite: str, sample, prediction: str) -> float:
    if suite == "babilong":
        from magnetar.eval import babilong

        return babilong.score_babilong(prediction, sample.answers, question=sample.metadata["question"],
                                       task=sample.task)
    from magnetar.eval.ruler import score

    return score(sample, prediction)


def config_key(config: EngineConfig) -> str:
    """A short stable hash of the engine options that change answers (not the timeout)."""
    d = config.to_dict()
    d["parallel"].pop("timeout_s", None)
    return hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:10]


def item_key(suite, task, method, length, index, cfg_key) -> str:
    return f"{suite}/{task}/{method}/{length}/{index}/{cfg_key}"


def load_done(path: Path) -> set[str]:
    done = set()
    if path.exists():
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        done.add(json.loads(line)["key"])
                    except (json.JSONDecodeError, KeyError):
                        continue  # a line cut by an interrupted write: redo that item
    return done


def _broadcast_obj(obj):
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def encode(tokenizer, sample) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase-1 and Phase-2 ids (Pulsar App. B split), with RULER's answer prefix after the assistant header."""
    from magnetar.engine.template import split_prompt

    p = split_prompt(tokenizer, sample.context, sample.query)
    q = p.query_ids
    if sample.answer_prefix:
        extra = tokenizer(" " + sample.answer_prefix if not getattr(tokenizer, "chat_template", None)
                          else sample.answer_prefix, add_special_tokens=False)["input_ids"]
        q = torch.cat((q, torch.tensor(extra, dtype=torch.long)))
    return p.context_ids, q


def items(args, tasks, lengths, methods) -> Iterator[tuple[str, int, str, int]]:
    for method in methods:
        for length in lengths:
            for task in tasks:
                for index in range(args.samples * (len(NIAH_DEPTHS) if args.suite == "niah" else 1)):
                    yield method, length, task, index


def run(args) -> int:
    import magnetar
    from magnetar.models import load_model, prepare_model

    out = Path(args.out)
    tasks = tuple(t.strip() for t in args.tasks.split(",")) if args.tasks else suite_tasks(args.suite)
    unknown = set(tasks) - set(suite_tasks(args.suite))
    if unknown:
        raise SystemExit(f"unknown {args.suite} task(s) {sorted(unknown)}; choose from {suite_tasks(args.suite)}")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    lengths = [parse_length(x) for x in args.lengths.split(",")]

    init_distributed()
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        prepare_model(args.model) if not os.path.isdir(args.model) else None
    barrier()
    model, tokenizer = load_model(args.model)
    results_path = out / "results.jsonl"
    done = _broadcast_obj(load_done(results_path) if rank == 0 else None)

    base = EngineConfig.from_cli(argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "method"}))
    todo = []
    for method, length, task, index in items(args, tasks, lengths, methods):
        cp = (args.cp or world) if method in CP_METHODS else 1
        cfg = base.replace(method=method, cp_size=cp)
        key = item_key(args.suite, task, method, length, index, config_key(cfg))
        if key not in done:
            todo.append((method, length, task, index, cfg, key))
    bar = None
    if rank == 0:
        from tqdm import tqdm

        print(f"{len(todo)} items to run ({len(done)} already in {results_path})", flush=True)
        bar = tqdm(total=len(todo), unit="item", dynamic_ncols=True)

    engines, model_obj = {}, model
    for method, length, task, index, cfg, key in todo:
        ck = config_key(cfg)
        if ck not in engines:  # every rank builds every engine (group creation is collective)
            engines[ck] = magnetar.init_inference(model_obj, cfg, tokenizer=tokenizer,
                                                  deepspeed_inference=not engines)
            model_obj = engines[ck].model
        engine = engines[ck]
        runs_here = cfg.parallel.cp_size > 1 or rank == 0
        if runs_here:
            sample, extra = make_sample(args.suite, task, tokenizer, length, index, args.data_seed)
            ctx_ids, q_ids = encode(tokenizer, sample)
            t0 = time.perf_counter()
            res = engine.generate(ctx_ids, q_ids, max_new_tokens=sample.max_new_tokens)
            if rank == 0:
                record = {"key": key, "suite": args.suite, "task": task, "method": method, "length": length,
                          "index": index, **extra, "score": score_sample(args.suite, sample, res.text),
                          "prediction": res.text, "answers": list(sample.answers),
                          "context_tokens": res.context_tokens, "cp_size": cfg.parallel.cp_size,
                          "phase1_critical_path_s": res.phase1_critical_path_seconds, "ttft_s": res.ttft_seconds,
                          "decode_s_per_token": res.decode_seconds_per_token, "wall_s": time.perf_counter() - t0,
                          "config": cfg.to_dict()}
                with open(results_path, "a") as f:
                    f.write(json.dumps(record) + "\n")
        if cfg.parallel.cp_size == 1 and world > 1:
            barrier()  # the other ranks wait for rank 0's single-rank item
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    barrier()
    if rank == 0:
        from magnetar.eval.report import write_report

        print(write_report(out))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.report:
        from magnetar.eval.report import write_report

        print(write_report(Path(args.out)))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
