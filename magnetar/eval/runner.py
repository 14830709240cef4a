"""``magnetar-eval``: run evaluation suites over methods and lengths, resumably, on one or many ranks.

    python -m magnetar.eval --suite ruler --methods dense,star,pulsar,ring --lengths 4k --samples 10 --out runs/r4k
    deepspeed --num_gpus 4 --module magnetar.eval --suite niah --methods star,pulsar,ring --lengths 8k --out runs/n8k
    python -m magnetar.eval --report --out runs/r4k           # markdown table + PNG plots from the JSONL
    python -m magnetar.eval --report --out runs/n8k --with runs/r4k --tasks niah_single_1,...  # runs joined
    deepspeed --num_gpus 2 --module magnetar.eval --suite ruler --simulate-ranks 4 --out runs/r4k   # 2 workers

Every (suite, task, method, length, sample) item is generated deterministically from the seed, answered by
the engine, scored, and appended by rank 0 to ``OUT/results.jsonl``; a rerun skips what is already there, so
an interrupted run resumes. Context-parallel methods use all launched ranks (``--cp`` overrides);
``dense`` and ``streaming`` run on rank 0 while the others wait. Engine options pass through (``--block-size``,
``--scorer``, ``--summary-budget`` ...) and are part of each item's key, so runs with other options do not
collide.

Resume and bad lines: a results line that is not a complete record (a write cut short by a killed run, a
hand edit) is moved to ``<file>.rejected`` with a warning naming the file and line, and its item runs
again; records are appended after a newline, so a cut line never swallows the next record (see
:mod:`magnetar.eval.results`). ``--out`` is checked before any model is loaded: a path that cannot be created
as a directory, or a results file that cannot be appended to, stops the run with an error naming it.
``--timeout-s`` bounds every wait of the run (a rank waiting for rank 0's single-rank item too), except the
end of a dealt run, which waits up to 6 hours for the slowest process.

``--simulate-ranks W``: every process stands in for W CP ranks (the engine's ``simulate`` option: each rank's
Phase 1 in turn, Phase 2 over their joined KV -- the same answers as W real ranks, without collectives), so
no device idles in a collective and none decodes a token that another is decoding too. Under a launcher the
items are then dealt round-robin to the processes (data parallel), each appending to its own
``results.rank<N>.jsonl``; the report and the resume read every ``results*.jsonl`` of ``--out``.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

from magnetar.config import METHODS, EngineConfig, add_cli_args
from magnetar.config.registry import METHOD_OPTIONS, POLICY_FIELDS
from magnetar.eval.common import check_attention_backend, check_cp_size, parse_length, parse_lengths, parse_names
from magnetar.eval.results import append_records, lock_output, set_aside_bad_lines, unlock_output, write_problem
from magnetar.eval.suite import SUITES, get_suite, sample_seed
from magnetar.utils.cli import ArgumentParser, add_launcher_args, check_input_file, fail, user_errors

# torch, the engine and the process groups are imported where they run: the flags, their errors and a report
# (--report) come without them
if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="magnetar-eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="a magnetar.models name, a local HF folder or a Hub id org/name (default %(default)s)")
    p.add_argument("--revision", help="--model's Hub revision: a branch, tag or commit hash (default main)")
    p.add_argument("--trust-remote-code", action="store_true", help="let --model run its own modelling code")
    p.add_argument("--suite", choices=tuple(SUITES), default="ruler")
    p.add_argument("--tasks", help="comma-separated subset of the suite's tasks (default: all)")
    p.add_argument("--methods", default="dense,star,pulsar,ring")
    p.add_argument("--lengths", default="4k", help="e.g. 2k,4k,8k (k = 1024 tokens)")
    p.add_argument("--samples", type=int, default=10, help="samples per task (niah: per depth; ppl: windows)")
    p.add_argument("--target-tokens", type=int, default=256,
                   help="ppl: tokens scored per window (the window slides by this much)")
    p.add_argument("--data-seed", type=int, default=0,
                   help="seed of the generated samples (--seed is the sampling seed)")
    p.add_argument("--cp", type=int, help="cp_size for ring/star/pulsar (default: the world size)")
    p.add_argument("--simulate-ranks", type=int, metavar="W",
                   help="each process stands in for W CP ranks; launched processes split the items (see above)")
    p.add_argument("--batch", type=int, default=1, metavar="N",
                   help="answer up to N items of one task and method together (one batched decode; the same "
                        "answers up to float rounding, cheaper on small models; ppl ignores it)")
    p.add_argument("--context-file", metavar="FILE",
                   help="--suite fidelity: your own text as the context (its first --lengths tokens), task 'file'")
    p.add_argument("--questions", metavar="FILE",
                   help="--context-file: questions about it, one per line (default: made from the text)")
    p.add_argument("--accuracy", action="store_true",
                   help="--suite fidelity: also answer greedily with each method and score it (both measures on "
                        "the same items)")
    p.add_argument("--out", required=True, help="output directory (results.jsonl, report.md, plots)")
    p.add_argument("--report", action="store_true", help="only write the report from OUT/results.jsonl")
    p.add_argument("--with", dest="report_with", action="append", default=[], metavar="DIR",
                   help="--report: also join the records of the run in DIR (repeatable; e.g. a 4K run beside "
                        "an 8K one for accuracy vs length); with --tasks only those tasks' records")
    p.add_argument("--report-samples", type=int, default=None, metavar="N",
                   help="--report: only each task's first N samples (index < N), so that methods run with "
                        "different --samples are compared on the same items")
    add_cli_args(p)
    add_launcher_args(p)
    return p


def task_list(args) -> Optional[tuple[str, ...]]:
    """``--tasks`` as a tuple of names, None when not given (every task of the suite)."""
    return tuple(t.strip() for t in args.tasks.split(",")) if args.tasks else None


def make_sample(suite: str, task: str, tokenizer, length: int, index: int, seed: int):
    """Sample ``index`` of ``suite``'s ``task`` at ``length`` for ``--data-seed seed``, and its extra key fields
    (niah: depth); see :meth:`magnetar.eval.suite.Suite.make_sample`."""
    return get_suite(suite).make_sample(task, tokenizer, length, index=index, seed=sample_seed(seed, index))


def fitted_sample(suite: str, task: str, tokenizer, length: int, index: int, seed: int,
                  max_positions: Optional[int]):
    """:func:`make_sample` whose prompt (context + query, chat template included) plus the task's output budget
    fits the model's ``max_positions``: the suites size the prompt to ``length``, which leaves no room for the
    answer when ``length`` is the model's whole window (8K for SmolLM2's 8192 positions). Then the sample is
    made again, ``length`` less the overflow, until it fits (RULER likewise counts the tokens to generate in
    its length). Returns (sample, extra key fields, (context ids, query ids)); ``extra["fitted_length"]`` is
    the length the sample was made at when it had to be shortened."""
    target, slack = length, 0
    for attempt in range(8):
        sample, extra = make_sample(suite, task, tokenizer, target, index, seed)
        ids = encode(tokenizer, sample)
        over = sum(int(x.numel()) for x in ids) + sample.max_new_tokens - (max_positions or 0)
        if not max_positions or over <= 0:
            if target != length:
                extra = dict(extra, fitted_length=target)
            return sample, extra, ids
        # a haystack grows by whole units (sentences, needle lines), so a step of exactly the overflow can
        # leave the same text: after three such steps each further step takes more
        target -= over + slack
        slack = 2 * slack + 8 if attempt >= 2 else 0
        if target <= 0:
            break
    raise ValueError(f"{suite}/{task} at length {length}: the prompt and its {sample.max_new_tokens}-token output "
                     f"budget do not fit the model's {max_positions} positions; use a shorter --lengths")


def base_config(args) -> EngineConfig:
    """The engine options every method of the run shares (a method's own options, e.g. Star's ``--halo-size``, go
    to the methods that read it alone: see method_config)."""
    flat = {k: v for k, v in vars(args).items() if k != "method"}
    flat.update({option: None for option in METHOD_OPTIONS})
    return EngineConfig.from_cli(argparse.Namespace(**flat))


def method_config(base: EngineConfig, args, method: str, cp: int) -> EngineConfig:
    """``method``'s config of the run: ``cp`` ranks for the distributed methods (one for the others) and the
    method's own options (:data:`magnetar.config.registry.METHOD_OPTIONS`: Star's and Pulsar's ``--halo-size``) -- so
    one command compares Star with a halo against the other methods."""
    extra = {option: getattr(args, option) for option, (owners, _) in METHOD_OPTIONS.items()
             if method in owners and getattr(args, option, None)}
    return base.replace(method=method, cp_size=cp if METHODS[method].distributed else 1, **extra)


def config_key(config: EngineConfig) -> str:
    """A short stable hash of the engine options that change answers (not the timeout, nor whether the CP ranks
    were real or simulated, or how simulated ones were timed: they give the same answers, nor how their states
    travel (parallel.shm_gather), nor runtime.check_finite, which only stops a run, nor the context cache's budget
    and disk tier, which only decide what is kept between requests, nor the graph decode step's plan, nor
    runtime.max_model_len, which only refuses)."""
    d = config.to_dict()
    d["parallel"].pop("timeout_s", None)
    d["parallel"].pop("simulate", None)
    d["parallel"].pop("rank_by_rank", None)  # how simulated ranks are timed: the same answers
    d["parallel"].pop("shm_gather", None)  # how the ranks' states travel: the same bytes either way
    d["runtime"].pop("check_finite", None)
    d["runtime"].pop("context_cache_mb", None)
    d["runtime"].pop("max_model_len", None)  # it only refuses longer requests: the same answers
    d["runtime"].pop("context_store", None)  # where encoded contexts are kept between runs: the same answers
    d["runtime"].pop("context_store_mb", None)
    d["runtime"].pop("host_cache_mb", None)
    for field in ("decode_graph_batches", "decode_graph_tokens", "decode_graph_warmup_s"):
        d["runtime"].pop(field, None)  # which decode shapes are planned and captured: the same answers
    if d["runtime"].get("prefix_reuse") == "exact":
        d["runtime"].pop("prefix_reuse", None)  # keys as before the field existed (exact reuse changes no answer)
    if d["runtime"].get("decode_step") == "eager":
        d["runtime"].pop("decode_step", None)  # keys as before the field existed
    for field in ("halo_size", "halo_blocks", "exact_layers"):
        if not d["blocks"].get(field, 0):
            d["blocks"].pop(field, None)  # keys as before the field existed
    if d["parallel"].get("tp_size", 1) == 1:
        d["parallel"].pop("tp_size", None)  # keys as before the field existed
    if d.get("sparse", {}).get("sparse_policy", "none") == "none":
        d.pop("sparse", None)  # dense decoding: keys as before the sparse section existed
    if d.get("luka", {}).get("luka_mode", "none") == "none":
        d.pop("luka", None)  # likewise for the LuKA section
    if d.get("prefill", {}).get("prefill_policy", "none") == "none":
        d.pop("prefill", None)  # likewise for the sparse-prefill section
    return hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:10]


def item_key(suite, task, method, length, index, cfg_key) -> str:
    return f"{suite}/{task}/{method}/{length}/{index}/{cfg_key}"


def method_label(config: EngineConfig) -> str:
    """The method plus the options that differ from its defaults, e.g. ``pulsar(bm25, budget 0.25)``: the
    report's column, so that variants of one method (an ablation) are not pooled."""
    from magnetar.engine.strategy import context_method, policy_label

    extra = context_method(config.method).label_options(config)  # the method says what sets its runs apart
    label = config.method + (f"({', '.join(extra)})" if extra else "")
    for section in POLICY_FIELDS:  # each policy on top of it says what sets its runs apart (registry: its class)
        extra = policy_label(getattr(config, section))
        if extra is not None:
            label += "+" + extra
    return label




def load_done(out_dir: Path) -> set[str]:
    """Keys of the items already recorded in ``out_dir`` (every results file). Lines that are not complete
    records are set aside with a warning (:func:`magnetar.eval.results.set_aside_bad_lines`): their items are
    redone."""
    return {row["key"] for row in set_aside_bad_lines(out_dir)}


def _broadcast_obj(obj):
    import torch.distributed as dist

    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def encode(tokenizer, sample) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase-1 and Phase-2 ids (Pulsar App. B split), with RULER's answer prefix after the assistant header."""
    import torch

    from magnetar.engine.template import split_prompt

    p = split_prompt(tokenizer, sample.context, sample.query)
    q = p.query_ids
    if sample.answer_prefix:
        extra = tokenizer(" " + sample.answer_prefix if not getattr(tokenizer, "chat_template", None)
                          else sample.answer_prefix, add_special_tokens=False)["input_ids"]
        q = torch.cat((q, torch.tensor(extra, dtype=torch.long)))
    return p.context_ids, q


def items(args, tasks, lengths, methods) -> Iterator[tuple[str, int, str, int]]:
    """Every item, task by task with all methods of a task together: a run cut short leaves whole rows of the
    table (every method on the same questions), not whole columns. Fidelity runs every method of one sample in
    turn (dense's reference answer is then computed once and held for that sample alone)."""
    suite = get_suite(args.suite)
    for length in lengths:
        for task in tasks:
            if suite.fidelity:
                for index in range(args.samples):
                    for method in methods:
                        yield method, length, task, index
                continue
            for method in methods:
                for index in range(args.samples * suite.items_per_sample):
                    yield method, length, task, index


def _batches(todo: list, size: int) -> Iterator[list]:
    """Consecutive items that can share one ``generate_batch``: same engine config and task (so the same
    output budget), at most ``size`` of them."""
    group: list = []
    for item in todo:
        if group and (len(group) == size or config_key(item[4]) != config_key(group[0][4]) or item[2] != group[0][2]):
            yield group
            group = []
        group.append(item)
    if group:
        yield group


class Fidelity:
    """What a fidelity run holds besides the engines: the dense reference engine, the reference answer of the
    sample in hand (every method of a sample runs in turn), and the user's text and questions."""

    def __init__(self, args, reference_engine, rows: Sequence[dict] = ()):
        from magnetar.eval.fidelity import question_lines

        self.args, self.engine = args, reference_engine
        # dense's answers already in the results (another method or option set of the same items; ``rows`` holds
        # only those): reused, so a new variant costs its own Phase 1 and forward plus dense's forward -- no
        # decoding. Not for --context-file: another text in the same --out would have the same task and index
        self.known = {} if args.context_file else {(r["task"], r["length"], r["index"]): r for r in rows}
        self.text = Path(args.context_file).read_text(encoding="utf-8") if args.context_file else None
        self.questions = question_lines(Path(args.questions).read_text(encoding="utf-8")) if args.questions else []
        self._held: tuple = (None, None)

    def sample(self, task: str, tokenizer, length: int, index: int, max_positions: Optional[int]):
        """(sample, extra key fields, (context ids, query ids)) of one item."""
        from magnetar.eval.fidelity import FILE_TASK, file_sample

        if task == FILE_TASK:
            sample = file_sample(self.text, tokenizer, length, index=index, questions=self.questions)
            return sample, {}, encode(tokenizer, sample)
        return fitted_sample(self.args.suite, task, tokenizer, length, index, self.args.data_seed, max_positions)

    def reference(self, item_id: tuple, ids: tuple, sample):
        """Dense's greedy answer to the item, its distributions and its score (held for the item's methods)."""
        import torch

        from magnetar.eval.fidelity import Reference

        if self._held[0] != item_id:
            old = self.known.get(item_id)
            if old is not None:
                answer, text, phase1 = old["dense_answer_ids"], old["dense_answer"], old["dense_phase1_critical_path_s"]
            else:
                res = self.engine.generate(*ids, max_new_tokens=sample.max_new_tokens, temperature=0.0)
                answer, text, phase1 = res.token_ids, res.text, max(res.phase1_seconds)
            scored = self.engine.score_answer(*ids, answer)
            self._held = (item_id, Reference(torch.tensor(answer), text, scored.logprobs,
                                             get_suite(self.args.suite).score(sample, text), phase1))
        return self._held[1]


def _run_fidelity(args, engine, tokenizer, item, fid: Fidelity) -> tuple[dict, object]:
    """One fidelity item: the method's distributions over dense's answer, compared (and with ``--accuracy`` its
    own greedy answer, scored)."""
    from magnetar.eval.fidelity import compare

    method, length, task, index, cfg, key = item
    sample, extra, ids = fid.sample(task, tokenizer, length, index, engine.max_positions)
    ref = fid.reference((task, length, index), ids, sample)
    got = engine.score_answer(*ids, ref.answer_ids)
    record = {"key": key, "suite": args.suite, "task": task, "method": method, "label": method_label(cfg),
              "length": length, "index": index}
    record.update(extra, **compare(ref.logprobs, got.logprobs, ref.answer_ids), dense_answer=ref.text,
                  dense_answer_ids=ref.answer_ids.tolist(),
                  dense_score=ref.score, dense_phase1_critical_path_s=ref.phase1_s, answers=list(sample.answers),
                  context_tokens=got.context_tokens, prompt_tokens=got.context_tokens + int(ids[1].numel()))
    record["phase1_flops_vs_dense"] = _cost_vs_dense(engine, cfg, ids)
    if args.accuracy:  # the method's own greedy answer (its Phase 1 comes from the context cache)
        res = engine.generate(*ids, max_new_tokens=sample.max_new_tokens, temperature=0.0)
        record.update(prediction=res.text, score=get_suite(args.suite).score(sample, res.text),
                      ttft_s=res.ttft_seconds, decode_s_per_token=res.decode_seconds_per_token)
    return record, got


def _cost_vs_dense(engine, cfg: EngineConfig, ids: tuple) -> float:
    """The cost model's Phase-1 critical path (FLOPs of the slowest rank, this item's token ids) of ``cfg`` over
    dense's on one rank."""
    from magnetar.eval.cost import estimate

    c, q = ids
    L, Q, mc = int(c.numel()), int(q.numel()), engine.model.config
    mine = estimate(mc, cfg, L, Q, context_ids=c, dtype_bytes=4)
    dense = estimate(mc, EngineConfig(method="dense", runtime=cfg.runtime), L, Q, dtype_bytes=4)
    return mine.critical_phase1_flops / dense.critical_phase1_flops


def _run_fitting(args, engine, tokenizer, group: list, fid: Optional[Fidelity] = None) -> list[dict]:
    """:func:`_run_group`, where what does not fit memory is a result (:func:`_did_not_fit`): a batch that does not
    runs again one item at a time, so only the items that do not fit alone are recorded so."""
    try:
        return _run_group(args, engine, tokenizer, group, fid)
    except Exception as e:  # noqa: BLE001 - what did not fit memory is a result; the rest is re-raised
        if len(group) == 1:
            return _did_not_fit(args, engine, group, e)
        why = engine.fit_failure(e)
        log.warning("a batch of %d items did not fit memory (%s); they run one at a time", len(group), why)
    return [r for item in group for r in _run_fitting(args, engine, tokenizer, [item], fid)]


def _did_not_fit(args, engine, group: list, error: Exception) -> list[dict]:
    """The records of a group of items that did not fit memory -- refused before its Phase 1 (its KV and Phase-1
    activations certainly exceed the device: every rank alike) or out of memory where one process holds the replica
    (on several, one rank's failed allocation leaves the others in a collective: re-raised, as anything else) -- each
    with ``error`` and no score: a result of this machine (the report's "OOM" cells; the run goes on, and a resumed
    run does not retry it -- drop its lines, or use another ``--out``, to try again). The device's cached contexts
    are dropped (:meth:`~magnetar.engine.engine.Engine.fit_failure`)."""
    why = engine.fit_failure(error)
    log.warning("%d item(s) did not fit memory (%s); recorded as out of memory, the run goes on", len(group), why)
    return [{"key": key, "suite": args.suite, "task": task, "method": method, "label": method_label(cfg),
             "length": length, "index": index, "cp_size": cfg.parallel.cp_size, "out_of_memory": True,
             "error": why}
            for method, length, task, index, cfg, key in group]


def _run_group(args, engine, tokenizer, group: list, fid: Optional[Fidelity] = None) -> list[dict]:
    """Answer (or score) one group of items with ``engine``; one result record per item. A group of several
    generation items runs as one :meth:`Engine.generate_batch` (the same answers as one by one up to float rounding;
    the decode step, memory-bound on small models, is shared), recorded with ``batch`` = the group size."""
    records, t0 = [], time.perf_counter()
    suite = get_suite(args.suite)
    if suite.fidelity:
        (item,) = group
        record, res = _run_fidelity(args, engine, tokenizer, item, fid)
        pairs = [(record, res, item[4])]
    elif suite.perplexity:
        (method, length, task, index, cfg, key), = group
        win = suite.window(tokenizer, length, index, seed=args.data_seed, target_tokens=args.target_tokens)
        res = engine.score(win.context_ids, win.continuation_ids)
        record = {"key": key, "suite": args.suite, "task": task, "method": method, "label": method_label(cfg),
                  "length": length, "index": index}
        record.update(win.metadata, nll_sum=res.nll_sum, tokens=res.tokens, ppl=res.perplexity,
                      context_tokens=res.context_tokens, phase2_s=res.phase2_seconds)
        pairs = [(record, res, cfg)]
    else:
        samples, requests = [], []
        for method, length, task, index, cfg, key in group:
            sample, extra, ids = fitted_sample(args.suite, task, tokenizer, length, index, args.data_seed,
                                               engine.max_positions)
            samples.append((sample, extra))
            requests.append(ids)
        budget = samples[0][0].max_new_tokens
        results = engine.generate_batch(requests, max_new_tokens=budget)
        pairs = []
        for (method, length, task, index, cfg, key), (sample, extra), res in zip(group, samples, results):
            record = {"key": key, "suite": args.suite, "task": task, "method": method, "label": method_label(cfg),
                      "length": length, "index": index}
            record.update(extra, score=suite.score(sample, res.text), prediction=res.text,
                          answers=list(sample.answers), context_tokens=res.context_tokens,
                          prompt_tokens=res.context_tokens + res.query_tokens,
                          ttft_s=res.ttft_seconds, decode_s_per_token=res.decode_seconds_per_token,
                          batch=len(group))
            pairs.append((record, res, cfg))
    wall = (time.perf_counter() - t0) / len(group)
    for record, res, cfg in pairs:
        record.update(cp_size=cfg.parallel.cp_size, simulated=res.simulated, phase1_s_per_rank=res.phase1_seconds,
                      phase1_critical_path_s=max(res.phase1_seconds), wall_s=wall, config=cfg.to_dict())
        if getattr(res, "prefill_stats", None) is not None:  # sparse prefill: budget and realised sparsity
            record["prefill"] = res.prefill_stats
        if getattr(res, "decode_stats", None) is not None:  # e.g. LuKA: the context held as pages at the answer
            record["decode_stats"] = res.decode_stats
        records.append(record)
    return records


@dataclasses.dataclass
class _Place:
    """Where this process runs an evaluation: its rank in the world, whether the items are dealt to the processes
    (data parallel, ``--simulate-ranks`` under a launcher), the results file it appends to, the waits' timeout."""

    out: Path
    rank: int
    world: int
    dealt: bool
    results_path: Path
    timeout: timedelta
    owns_group: bool  # a caller's process group is left for the caller to destroy


def run(args) -> int:
    """``magnetar eval``: the process group and the output folder (:func:`_setup`), the items left to run
    (:func:`_todo`; none: the report alone), the model, the fidelity reference (:func:`_reference`), the items
    (:func:`_run_items`), the report."""
    suite = get_suite(args.suite)
    base = base_config(args)
    place = _setup(args, base)
    done = _broadcast_obj(load_done(place.out) if place.rank == 0 else None)
    todo, total = _todo(args, suite, base, place, done)
    if place.rank == 0:
        print(f"{total} items to run ({len(done)} already in {place.out})"
              f"{f', dealt to {place.world} processes' if place.dealt else ''}", flush=True)
    if total == 0:  # a finished run resumed: the report again, no model loaded (every process sees the same total)
        _finish(place)
        return 0
    from magnetar.engine.load import load_weights

    model, tokenizer = load_weights(args.model, base.runtime.dtype, revision=args.revision,
                                    trust_remote_code=args.trust_remote_code, timeout=place.timeout)
    fid = None
    if suite.fidelity:
        model, fid = _reference(args, base, model, tokenizer, place)
    bar = None
    if place.rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=len(todo), unit="item", dynamic_ncols=True, desc="rank 0" if place.dealt else None)
    _run_items(args, suite, todo, model, tokenizer, fid, place, bar)
    if bar is not None:
        bar.close()
    _finish(place)
    return 0


def _setup(args, base: EngineConfig) -> _Place:
    """The process group (under a launcher) and the output folder: writable, and locked by rank 0 for this run,
    before any model is loaded."""
    import torch.distributed as dist

    from magnetar.parallel.collectives import barrier
    from magnetar.parallel.launcher import init_distributed

    out = Path(args.out)
    timeout = timedelta(seconds=base.parallel.timeout_s)  # --timeout-s: every wait below
    owns_group = not dist.is_initialized()
    init_distributed(timeout=timeout)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    dealt = args.simulate_ranks is not None and world > 1  # data parallel: each process runs its share alone
    names = [f"results.rank{r}.jsonl" for r in range(world)] if dealt else ["results.jsonl"]
    # no other run writes to the folder (rank 0 holds the lock)
    problem = _broadcast_obj((write_problem(out, names) or lock_output(out)) if rank == 0 else None)
    if problem:
        raise SystemExit(f"--out {args.out}: {problem}; pass a directory this run can write its results to")
    barrier(timeout=timeout)  # rank 0 holds the output folder's lock
    return _Place(out, rank, world, dealt, out / names[rank if dealt else 0], timeout, owns_group)


def _todo(args, suite, base: EngineConfig, place: _Place, done: set) -> tuple[list, int]:
    """The items not in ``done`` (``(method, length, task, index, config, key)``; this process's share when dealt)
    and how many there are in all."""
    tasks = task_list(args) or suite.tasks  # the flags were checked by check_args (main calls it first)
    if args.context_file:  # fidelity on the user's own text
        from magnetar.eval.fidelity import FILE_TASK

        tasks = (FILE_TASK,)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    lengths = [parse_length(x, minimum=0) for x in args.lengths.split(",")]
    todo = []
    for method, length, task, index in items(args, tasks, lengths, methods):
        # the simulation gives the same answers as real ranks: one key for both
        cfg = method_config(base, args, method, args.simulate_ranks or args.cp or place.world)
        key = item_key(args.suite, task, method, length, index, config_key(cfg))
        if suite.perplexity:  # the scored tokens per window change the item
            key += f"/T{args.target_tokens}"
        if args.context_file:  # the user's text and questions are the item
            key += "/" + _files_digest(args)
        if args.accuracy:
            key += "/acc"
        if key not in done:
            todo.append((method, length, task, index, cfg, key))
    return (todo[place.rank::place.world] if place.dealt else todo), len(todo)


def _reference(args, base: EngineConfig, model, tokenizer, place: _Place):
    """The fidelity suite's reference -- plain dense attention and decoding, on this process alone -- with the
    dense answers of earlier runs: ``(the model it holds, Fidelity)``."""
    import magnetar
    from magnetar.parallel import local_groups

    ref_cfg = EngineConfig(method="dense", runtime=dataclasses.replace(base.runtime, prefix_reuse="off"),
                           parallel=dataclasses.replace(EngineConfig().parallel, timeout_s=base.parallel.timeout_s))
    ref = magnetar.init_inference(model, ref_cfg, tokenizer=tokenizer,
                                  groups=local_groups(timeout=place.timeout) if place.world > 1 else None)
    rows = [{k: r.get(k) for k in ("task", "length", "index", "dense_answer_ids", "dense_answer",
                                    "dense_phase1_critical_path_s")} for r in set_aside_bad_lines(place.out)
            if r.get("suite") == "fidelity" and r.get("dense_answer_ids")] if place.rank == 0 else None
    return ref.model, Fidelity(args, ref, _broadcast_obj(rows))


def _run_items(args, suite, todo: list, model, tokenizer, fid, place: _Place, bar) -> None:
    """Every item, grouped by batch (``--batch``), each group on the engine of its config (made once, on every rank:
    group creation is collective unless dealt); the records appended as they come."""
    import magnetar
    from magnetar.parallel import local_groups
    from magnetar.parallel.collectives import barrier

    engines = {}
    for group in _batches(todo, args.batch if not (suite.perplexity or suite.fidelity) else 1):
        method, length, task, index, cfg, key = group[0]
        ck = config_key(cfg)
        if ck not in engines:
            run_cfg = cfg.replace(simulate=True) if args.simulate_ranks is not None and cfg.parallel.cp_size > 1 \
                else cfg
            # every item's own Phase 1 (its measured seconds are the item's), whatever an earlier one cached
            run_cfg = run_cfg.replace(prefix_reuse="off")
            groups = local_groups(timeout=timedelta(seconds=cfg.parallel.timeout_s)) if place.dealt else None
            engines[ck] = magnetar.init_inference(model, run_cfg, tokenizer=tokenizer, groups=groups,
                                                  deepspeed_inference=not engines and fid is None)
            model = engines[ck].model
        engine = engines[ck]
        runs_here = place.dealt or engine.simulated or cfg.parallel.cp_size > 1 or place.rank == 0
        if runs_here:
            records = _run_fitting(args, engine, tokenizer, group, fid)
            if place.rank == 0 or place.dealt:
                append_records(place.results_path, records)
        if not place.dealt and cfg.parallel.cp_size == 1 and place.world > 1:
            barrier(timeout=place.timeout)  # the other ranks wait for rank 0's single-rank item
        if bar is not None:
            bar.update(len(group))


def _finish(place: _Place) -> None:
    """Every process done, rank 0 writes the report and unlocks the folder."""
    import torch.distributed as dist

    from magnetar.parallel.collectives import barrier, store_barrier
    # dealt shares end at different times: wait long for the slowest before rank 0 writes the report -- in the
    # store, whose wait a rank still computing cannot outlast (a collective's is bounded by the group's timeout)
    if place.dealt:
        store_barrier("eval-dealt-done", timeout=timedelta(hours=6))
    barrier(timeout=place.timeout)
    if place.rank == 0:
        from magnetar.eval.report import write_report

        print(write_report(place.out))
        unlock_output(place.out)
    if place.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def _files_digest(args) -> str:
    """A short hash of --context-file's and --questions' contents (part of a fidelity item's key)."""
    h = hashlib.sha1()
    for path in (args.context_file, args.questions):
        h.update(Path(path).read_bytes() if path else b"-")
    return h.hexdigest()[:10]


def check_args(args) -> None:
    """Every check of an evaluation run's flags that needs no model (ValueError / FileNotFoundError naming the
    flag): the methods, lengths, tasks, counts, CP sizes against the launched world, the engine config of every
    method, and the files it reads."""
    methods = parse_names(args.methods, tuple(METHODS), "--methods")
    lengths = parse_lengths(args.lengths, minimum=0)
    if 0 in lengths and not get_suite(args.suite).own_lengths:
        raise ValueError(f"--lengths 0 (each task's own length) is for suites that size their own samples "
                         f"(wikisalad), not --suite {args.suite}; give token counts such as 4k")
    fidelity = get_suite(args.suite).fidelity
    for flag in ("context_file", "accuracy"):
        if getattr(args, flag) and not fidelity:
            raise ValueError(f"--{flag.replace('_', '-')} is an option of --suite fidelity, not --suite {args.suite}")
    if args.questions and not args.context_file:
        raise ValueError("--questions asks about --context-file's text: give --context-file FILE too")
    if args.context_file and args.tasks:
        raise ValueError("--tasks chooses RULER-style tasks; with --context-file the items are your text's "
                         "questions: drop --tasks")
    for flag in ("context_file", "questions"):
        if getattr(args, flag):
            check_input_file(getattr(args, flag), flag="--" + flag.replace("_", "-"))
    if args.tasks is not None:
        parse_names(args.tasks, get_suite(args.suite).tasks, "--tasks")
    for flag in ("samples", "target_tokens", "batch", "cp", "simulate_ranks"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if args.simulate_ranks is not None and args.cp is not None and args.cp != args.simulate_ranks:
        raise ValueError(f"--simulate-ranks {args.simulate_ranks} and --cp {args.cp} differ: give one, or both equal")
    from magnetar.parallel.launcher import launched_world_size

    world = launched_world_size()
    if args.cp is not None and args.simulate_ranks is None:
        check_cp_size(args.cp, world, "--cp")
    base = base_config(args)
    cp = args.simulate_ranks or args.cp or world
    for option, (owners, _) in METHOD_OPTIONS.items():
        flag = "--" + option.replace("_", "-")
        if getattr(args, option, None) and not set(owners) & set(methods):
            raise ValueError(f"{flag} {getattr(args, option)} is an option of {' / '.join(owners)}: add "
                             f"{' or '.join(owners)} to --methods (given {','.join(methods)}) or drop {flag}")
    for method in methods:  # every method's config must hold (e.g. LuKA needs a local Phase 1)
        method_config(base, args, method, cp)
    check_attention_backend(base)
    for name in ("hash_path", "prefill_indexer_path"):
        if getattr(base, name) is not None:
            check_input_file(getattr(base, name), flag="--" + name.replace("_", "-"))
    from magnetar.models import check_model  # transformers: after the checks of the flags alone
    from magnetar.models.dummy import check_text_model

    check_model(args.model, revision=args.revision)
    check_text_model(args.model)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.report_with and not args.report:
        fail(parser.prog, "--with joins other runs' records into a report: use it with --report")
    if args.report_samples is not None and (not args.report or args.report_samples < 1):
        fail(parser.prog, f"--report-samples {args.report_samples}: give a count >= 1, with --report")
    if not args.report:
        with user_errors(parser.prog):
            check_args(args)
    if args.report:
        from magnetar.eval.report import write_report

        print(write_report(Path(args.out), also=[Path(d) for d in args.report_with], tasks=task_list(args),
                           samples=args.report_samples))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
