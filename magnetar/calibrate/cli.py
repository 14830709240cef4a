"""``magnetar-calibrate``: train the small learned parts of Magnetar's methods on a frozen model.

    magnetar-calibrate spotlight --model smollm2-135m-instruct --data essays --out hashes/smollm2-spotlight.pt
    magnetar-calibrate spotlight --hash lsh --out hashes/smollm2-lsh-trained.pt     # the linear baseline, trained
    magnetar-calibrate indexer --model smollm2-135m-instruct --data essays --d-idx 128 --out indexers/smollm2.pt

``spotlight`` trains Spotlight Attention's MLP hash (one per layer and KV head) with the ranking loss on
queries/keys collected from real text (see :mod:`magnetar.calibrate.spotlight`), prints the retrieval IoU with the
oracle before and after, and writes hash weights that the engine loads with
``--sparse-policy spotlight --hash-path FILE``. Interrupted runs resume.

``indexer`` distils sparse prefill's head-collapsed indexer (one per global attention layer) from the oracle's
head-averaged dense attention with the KL loss, backbone frozen, teacher rows streamed a few layers at a time
(see :mod:`magnetar.calibrate.indexer`); prints per layer the held-out validation KL and the recall of the
oracle's top-k support before and after, and writes an indexer file that the engine loads with
``--prefill-policy indexer --prefill-indexer-path FILE``. Interrupted runs resume.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

from magnetar.calibrate.configs import IndexerTrainConfig, TrainConfig
from magnetar.utils.cli import ArgumentParser, check_output_file, int_at_least, user_errors

PROG = "magnetar-calibrate"

CORPORA = ("essays", "shakespeare")


def corpus_texts(name: str) -> list[str]:
    from magnetar.data import texts

    if name == "essays":
        return texts.paul_graham_essays()
    if name == "shakespeare":
        return list(texts.shakespeare_works().values())
    raise ValueError(f"unknown corpus {name!r}; choose one of {CORPORA}")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("spotlight", help="train the Spotlight (MLP) or LSH hash functions")
    s.add_argument("--model", default="smollm2-135m-instruct")
    s.add_argument("--data", choices=CORPORA, default="essays", help="text the queries/keys are collected from")
    s.add_argument("--out", required=True, help="hash weights file to write (and resume)")
    s.add_argument("--hash", dest="kind", choices=("mlp", "lsh"), default="mlp")
    s.add_argument("--threads", type=int_at_least(1), help="torch CPU threads")
    defaults = TrainConfig()
    for f in fields(TrainConfig):
        if f.name in ("kind", "betas"):
            continue
        s.add_argument("--" + f.name.replace("_", "-"), type=type(getattr(defaults, f.name)),
                       default=getattr(defaults, f.name))
    i = sub.add_parser("indexer", help="distil the sparse-prefill head-collapsed indexer (KL to the oracle)")
    i.add_argument("--model", default="smollm2-135m-instruct")
    i.add_argument("--data", choices=CORPORA, default="essays", help="text the teacher rows are collected from")
    i.add_argument("--out", required=True, help="indexer weights file to write (and resume)")
    i.add_argument("--threads", type=int_at_least(1), help="torch CPU threads")
    i.add_argument("--device", default="cpu", help="device of the frozen model and the training (cpu, cuda)")
    i.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="dtype of the frozen model (the indexer trains in float32)")
    i.add_argument("--cache-dir", help="collect once and keep every layer's teacher data here (fp16 inputs; "
                                       "disk: layers x sequences x (seq_len x hidden x 2 + rows x seq_len x 4) "
                                       "bytes); default: recollect a few layers at a time in memory")
    defaults = IndexerTrainConfig()
    for f in fields(IndexerTrainConfig):
        kw = {"choices": (64, 128, 256)} if f.name == "d_idx" else \
            {"choices": ("constant", "cosine")} if f.name == "lr_schedule" else {}
        i.add_argument("--" + f.name.replace("_", "-"), type=type(getattr(defaults, f.name)),
                       default=getattr(defaults, f.name), **kw)
    return p


def check_args(args):
    """The training config of the flags, after every check that needs no model (ValueError naming the flag)."""
    import torch

    from magnetar.models import check_model

    check_model(args.model)
    check_output_file(args.out, flag="--out", make_parents=True)
    if args.what == "spotlight":
        return TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)})
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise ValueError(f"--device {args.device!r} is not a device (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: CUDA is not available here; use --device cpu")
    if args.cache_dir is not None and Path(args.cache_dir).exists() and not Path(args.cache_dir).is_dir():
        raise ValueError(f"--cache-dir {args.cache_dir} is a file; give a directory")
    return IndexerTrainConfig(**{f.name: getattr(args, f.name) for f in fields(IndexerTrainConfig)})


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from magnetar.models import ModelNotInstalledError

    with user_errors(PROG):
        cfg = check_args(args)
    if args.what == "indexer":
        return _indexer(args, cfg)
    import torch

    from magnetar.calibrate.spotlight import calibrate
    from magnetar.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    with user_errors(PROG, extra=(ModelNotInstalledError,)):
        model, tokenizer = load_model(args.model)
    bank = calibrate(model, tokenizer, corpus_texts(args.data), args.out, cfg)
    before, after = bank.meta["iou_before"], bank.meta["iou_after"]
    layers = sorted(after)
    print(f"\nretrieval IoU with the oracle top-{100 * (1 - cfg.pruning):g}% ({cfg.held_out} held-out sequences of "
          f"{cfg.seq_len} tokens, {cfg.queries} queries each)")
    print("| layer | before | after |\n|---|---|---|")
    for layer in layers:
        print(f"| {layer} | {before[layer]:.3f} | {after[layer]:.3f} |")
    mb, ma = (sum(d[layer] for layer in layers) / len(layers) for d in (before, after))
    print(f"| **mean** | **{mb:.3f}** | **{ma:.3f}** |")
    print(json.dumps({"kind": cfg.kind, "out": args.out, "iou_before": round(mb, 4), "iou_after": round(ma, 4),
                      "layers": len(layers)}))
    return 0


def _indexer(args, cfg) -> int:
    import torch

    from magnetar.calibrate.indexer import calibrate_indexer, metrics_table
    from magnetar.calibrate.spotlight import text_sequences
    from magnetar.models import ModelNotInstalledError, load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    with user_errors(PROG, extra=(ModelNotInstalledError,)):
        model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    seqs = text_sequences(tokenizer, corpus_texts(args.data), cfg.seq_len, cfg.sequences + cfg.held_out)
    bank = calibrate_indexer(model, seqs, args.out, cfg, cache_dir=args.cache_dir)
    table, means = metrics_table(bank)
    print("\n" + table)
    print(json.dumps({"kind": "indexer", "out": args.out, "model": args.model, "data": args.data, "d_idx": cfg.d_idx,
                      "topk": cfg.topk, "b_sel": cfg.b_sel, "layers": len(bank.trained_layers),
                      **{m: round(v, 4) for m, v in means.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
