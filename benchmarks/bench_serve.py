"""Serving benchmark: the context cache (ask a document many questions) and concurrent streaming clients.

    python benchmarks/bench_serve.py                          # SmolLM2-135M, pulsar, 4 simulated ranks, 8K doc
    python benchmarks/bench_serve.py --parts cache --context-tokens 4096
    python benchmarks/bench_serve.py --tiny                   # random tiny model: a smoke run of a few seconds
    python benchmarks/bench_serve.py --method dense --ranks 1 --peer http://127.0.0.1:8100 \
        --peer-cmd "vllm serve ~/.cache/magnetar/models/smollm2-135m-instruct --port 8100 ..."   # vs vLLM

Part ``cache`` -- ``--questions`` questions about one ``--context-tokens`` document (Paul Graham essays with a
needle; the needle question first, then questions about the essays), ``--new-tokens`` each, greedy:

* ``10 x generate``: a fresh ``generate(doc, q)`` per question with the context cache off (Phase 1 every time);
* ``cached, one at a time``: ``generate(doc, q)`` with the cache on (the first question encodes the document,
  the others reuse its KV: automatic prefix reuse);
* ``cached, batched``: ``encode(doc)`` once, then ``ask_batch`` of all the questions (one decode batch).

Every cached answer must equal its uncached one (checked, reported). Goal on the 2-core CPU: >= 5x.

Part ``clients`` -- the OpenAI-compatible server (``magnetar.serve``) in this process on 127.0.0.1, queried by
``--clients`` (default 1,4,8,16) concurrent streaming clients (threads with the ``openai`` client), each asking
``--rounds`` questions about one of a few shared documents (cache hits after the first), against one-at-a-time
serving (one client, the same requests in a row). Reported: completion tokens/s over the wall time, p50/p99
time to first token (first streamed chunk with text) and the speed-up in tokens/s. Goal: >= 2x at 8 clients.

Part ``pasted`` -- the same ``--questions`` about one ``--context-tokens`` document sent as unmodified clients send
them: the document pasted into the chat message before each question (no ``magnetar`` extension), through the
server in this process. ``split``: the server's rule (the pasted document is Phase 1, cached after the first
question); ``whole message``: ``"magnetar": {"split_document": false}``, the old behaviour (the whole message is the
Phase-2 question, nothing cached). Reported: total and per-request seconds, cached tokens, and the speed-up.
Goal (issue 32): >= 5x on SmolLM2 at 8K.

Part ``turns`` -- a ``--turns``-turn conversation over one ``--turn-context-tokens`` document pasted into the
first user message (later turns: the previous messages, the answer, a new short question), through the server
in this process, once with prefix reuse (``prefix_reuse all``: each turn's context extends the last turn's) and
once without (``off``: each turn re-encodes the conversation). Reported per turn: seconds, context tokens and the
tokens its Phase 1 encoded (context - cached).

Part ``peer`` (``--peer URL``; issue 33) -- the same plain OpenAI requests (each document pasted into the chat message
before its question, nothing Magnetar-specific) against another server and against ``magnetar serve`` in its own
process (``--serve-in-process``: a thread of this one), one at a time (``--peer-cmd`` starts the peer before its turn
and stops it after, so the two never share the cores): one streamed request over a 4K document (TTFT cold, then again
with the document cached, and decode ms/token), ten questions about one 8K document, eight clients with their own new
1K documents one at a time and concurrently (tokens/s; the concurrent round's wall seconds and tokens too), one 8K
prefill. Prints each figure for both and Magnetar / peer. ``--ignore-eos``: every request sends ``ignore_eos`` (vLLM's
extension, Magnetar's too), so both servers generate ``--new-tokens`` for every answer -- the same work (without it,
greedy bf16 answers that differ in length make the tokens/s of a round differ by more than the servers' speed).

Part ``stall`` (issue 33, item 3) -- one request streams ``--stall-tokens`` tokens over a cached document while
another brings a new ``--context-tokens`` document, with ``--prefill-chunk`` 0 (its whole Phase 1 between two decode
steps) and each of ``--stall-chunks``: the decoding request's longest gap between two tokens and the newcomer's TTFT.

Part ``join`` -- eight concurrent streaming clients, each with its own new ~``--client-context-tokens`` document in a
message, all of it query (the server runs with ``--paste-threshold 0``: their queries join the batch together -- a
message cut into a document and a question would run its document's Phase 1 alone), against ``magnetar serve`` in its
own process with each ``--max-join-tokens`` of ``--join-tokens``, alternated ``--rounds`` times (the
same documents for every value in a round; a fresh server each time): every client's TTFT, their p50 and max, the
wall seconds and tokens/s.

Part ``served`` (issue 47, item 3; the GPU kit's ``serve`` step) -- the server in this process, plain chat requests:
one streamed request over a new ``--context-tokens`` document (TTFT, decode ms/token), then each ``--clients`` count of
concurrent streaming clients, each with a new ``--client-context-tokens`` document (tokens/s, TTFT p50/p99). With
dummy weights and another tokenizer, as on a GPU::

    python benchmarks/bench_serve.py --parts served --model dummy:llama-3.1-8b --tokenizer byte --dtype bfloat16 \
        --method dense --ranks 1 --context-tokens 32768 --clients 8,32 --client-context-tokens 2048 --new-tokens 64

Prints the tables, then one JSON line.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch
from bench_threads import stream_chat, wait_ready  # benchmarks/: the script's own folder is first on sys.path

# the checkout too: --tiny and --tokenizer byte take the tests' tiny model and byte tokenizer (tests/tiny_models.py),
# and a free port comes from the tests' helper
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

from magnetar.utils.cli import write_json_line  # noqa: E402
from tests.dist_utils import free_port  # noqa: E402  (the tests' helper: a free loopback port)

QUESTIONS = [  # after the needle question
    "What is the first essay about? Answer in one sentence.",
    "Name one person mentioned in the text.",
    "What advice does the author give to founders?",
    "Which city is mentioned first?",
    "What does the author say about programming languages?",
    "Summarize the last paragraph in one sentence.",
    "What is the main argument of the text?",
    "Which company is mentioned in the text?",
    "What does the author think about ambition?",
    "Give a title for the document.",
    "What year is mentioned first?",
    "What is the tone of the text?",
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="registry name, folder or Hub id")
    p.add_argument("--tiny", action="store_true", help="a random tiny Llama with a byte tokenizer (smoke run)")
    p.add_argument("--tokenizer", default=None, metavar="NAME|FOLDER|byte",
                   help="read text with this tokenizer instead of --model's (magnetar serve's --tokenizer); 'byte': a "
                        "byte-level one with a plain chat template, made here (no files: the GPU kit's dummy model)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="the weights' and the engine's dtype (dummy weights are made on this rank's device)")
    p.add_argument("--method", default="pulsar")
    p.add_argument("--ranks", type=int, default=4, help="simulated CP ranks (one process)")
    p.add_argument("--parts", default="cache,clients", help="comma list of: cache, clients, pasted, turns, stall, "
                   "served (--peer: peer)")
    p.add_argument("--peer", default=None, metavar="URL", help="another OpenAI-compatible server (e.g. vLLM at "
                   "http://127.0.0.1:8100): run the peer workloads against it and against `magnetar serve` (its own "
                   "process), one server at a time, and print the ratios (part 'peer')")
    p.add_argument("--peer-cmd", default=None, metavar="CMD", help="--peer: the shell command that starts the peer "
                   "(started before its workloads, stopped after, so the two servers never share the cores)")
    p.add_argument("--peer-ready-s", type=float, default=600, help="--peer-cmd: how long the peer may take to start")
    p.add_argument("--ignore-eos", action="store_true", help="--peer and join: every request sends ignore_eos (vLLM's "
                   "extension; Magnetar's too): each answer is --new-tokens long on both servers, the same work "
                   "(without it a server whose answers end sooner shows fewer tokens/s)")
    p.add_argument("--peer-results", default=None, metavar="FILE", help="--peer: take the peer's figures from an "
                   "earlier run's output (its JSON line) instead of running the peer again")
    p.add_argument("--serve-in-process", action="store_true", help="--peer: run Magnetar's server in this process "
                   "(a thread beside the clients, sharing their interpreter) instead of `magnetar serve` in its own "
                   "process (the default: how a user runs it, and how the peer runs)")
    p.add_argument("--stall-chunks", default="1024,2048", help="part stall: the --prefill-chunk sizes tried after 0")
    p.add_argument("--join-tokens", default="0,2048,1024", help="part join: the --max-join-tokens values, alternated")
    p.add_argument("--stall-tokens", type=int, default=96, help="part stall: the decoding request's max_tokens")
    p.add_argument("--decode-step", default=None, choices=("eager", "static", "compiled", "graph"),
                   help="Magnetar's runtime.decode_step (default: the engine's, eager); graph: the batch sizes planned "
                        "are the powers of two up to --max-batch")
    p.add_argument("--turns", type=int, default=6, help="turns of the turns part")
    p.add_argument("--turn-context-tokens", type=int, default=4000, help="the turns part's document")
    p.add_argument("--context-tokens", type=int, default=8000, help="(SmolLM2 has 8192 positions in all)")
    p.add_argument("--questions", type=int, default=10)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--clients", default="1,4,8,16", help="concurrent streaming clients per round")
    p.add_argument("--client-context-tokens", type=int, default=1024, help="documents of the clients part")
    p.add_argument("--documents", type=int, default=2, help="distinct documents of the clients part")
    p.add_argument("--rounds", type=int, default=2, help="requests per client in the clients part")
    p.add_argument("--max-batch", type=int, default=16, help="the server's decode batch limit")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, metavar="FILE", help="also write the JSON record here -- the served "
                   "part's rewritten after each workload (\"complete\": false until the last), so a run cut short "
                   "keeps what it measured (the GPU kit's serve step)")
    args = p.parse_args(argv)
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    if args.peer is not None and args.parts == p.get_default("parts"):
        parts = ["peer"]
    known = ("cache", "clients", "pasted", "turns", "peer", "stall", "join", "served")
    bad = [x for x in parts if x not in known]
    if bad or not parts:
        p.error(f"--parts: unknown part(s) {bad}; choose from {', '.join(known)} (comma separated)")
    for name in ("stall_chunks", "join_tokens"):
        try:
            setattr(args, name, [int(x) for x in getattr(args, name).split(",") if x.strip()])
        except ValueError:
            p.error(f"--{name.replace('_', '-')}: comma-separated ints, got {getattr(args, name)!r}")
        if not getattr(args, name) or min(getattr(args, name)) < 0:
            p.error(f"--{name.replace('_', '-')}: ints >= 0, at least one")
    if "peer" in parts and not args.peer:
        p.error("--parts peer needs --peer URL (the other server)")
    if args.peer_cmd and not args.peer:
        p.error("--peer-cmd needs --peer URL (where the command's server listens)")
    args.parts = parts
    try:
        args.clients = [int(x) for x in args.clients.split(",") if x.strip()]
    except ValueError:
        p.error(f"--clients must be comma-separated ints such as 1,4,8,16, got {args.clients!r}")
    if not args.clients or min(args.clients) < 1:
        p.error("--clients: each count must be >= 1")
    for name in ("ranks", "context_tokens", "questions", "new_tokens", "client_context_tokens", "documents", "rounds",
                 "max_batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def load(args):
    """(model, tokenizer) of ``--model`` or the tiny stand-in."""
    if args.tiny:
        import tempfile

        from magnetar.models import load_model
        from tests.tiny_models import save_tiny

        folder = tempfile.mkdtemp(prefix="magnetar-bench-serve-")
        save_tiny(folder, "llama", seed=args.seed, max_position_embeddings=1 << 16)
        args.model_path = folder  # what a `magnetar serve` process loads (part peer)
        return load_model(folder)
    from magnetar.models import load_model
    from magnetar.models.dummy import is_dummy
    from magnetar.parallel.launcher import device_for_rank

    args.model_path = args.model
    device = device_for_rank() if is_dummy(args.model) else "cpu"  # an 8B dummy model never passes the CPU
    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype), device=device)
    if args.tokenizer == "byte":  # one id per byte of text, every other id of the model's vocabulary a word
        from tests.tiny_models import CHAT_TEMPLATE, byte_tokenizer

        tokenizer = byte_tokenizer(int(model.config.vocab_size))
        tokenizer.chat_template = CHAT_TEMPLATE
    elif args.tokenizer is not None:
        from magnetar.models import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    return model, tokenizer


def graph_batches(max_batch: int) -> str:
    """``runtime.decode_graph_batches`` for a server of ``max_batch``: the powers of two below it, and it."""
    sizes = [1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch] + [max_batch]
    return ",".join(map(str, sizes))


def engine(model, tokenizer, args, **flat):
    import magnetar

    if args.decode_step is not None:
        flat.setdefault("decode_step", args.decode_step)
    if args.decode_step == "graph":
        flat.setdefault("decode_graph_batches", graph_batches(args.max_batch))
    simulate = args.ranks > 1
    flat.setdefault("dtype", args.dtype)  # the engine's default (float32) would cast a bf16 model
    return magnetar.init_inference(model, tokenizer=tokenizer, method=args.method, cp_size=args.ranks,
                                   simulate=simulate, deepspeed_inference=False, **flat)


def documents(tokenizer, tokens: int, n: int, seed: int):
    """``n`` needle documents of about ``tokens`` tokens: [(context, needle question, answer)]."""
    from magnetar.data.niah import needle_prompt

    out = []
    for i in range(n):
        s = needle_prompt(tokenizer, tokens, 0.5, seed=seed + i)
        out.append((s.context, s.query, s.answer))
    return out


def part_cache(model, tokenizer, args) -> dict:
    [(doc, needle_q, answer)] = documents(tokenizer, args.context_tokens, 1, args.seed)
    questions = ([needle_q] + QUESTIONS)[: args.questions]
    if len(questions) < args.questions:
        questions += [f"Question {i}: what is said in paragraph {i}?" for i in range(len(questions), args.questions)]
    new = args.new_tokens
    cold = engine(model, tokenizer, args, context_cache_mb=0)
    warm = engine(model, tokenizer, args)
    cold.generate("warm-up. " * 8, "ok?", max_new_tokens=2)  # first-call costs (ops, allocator) out of the timing
    rows = []

    t0 = time.perf_counter()
    uncached = [cold.generate(doc, q, max_new_tokens=new) for q in questions]
    t_uncached = time.perf_counter() - t0

    t0 = time.perf_counter()
    cached = [warm.generate(doc, q, max_new_tokens=new) for q in questions]
    t_cached = time.perf_counter() - t0

    warm.cache.clear()
    t0 = time.perf_counter()
    handle = warm.encode(doc)
    batched = warm.ask_batch([handle] * len(questions), questions, max_new_tokens=new)
    t_batched = time.perf_counter() - t0

    same_cached = all(a.token_ids == b.token_ids for a, b in zip(uncached, cached))
    same_batched = all(a.token_ids == b.token_ids for a, b in zip(uncached, batched))
    L = uncached[0].context_tokens
    for label, seconds, same in (("10 x generate (no cache)", t_uncached, True),
                                 ("cached, one at a time", t_cached, same_cached),
                                 ("cached, batched (encode + ask_batch)", t_batched, same_batched)):
        rows.append(dict(mode=label, seconds=seconds, speedup=t_uncached / seconds, same_tokens=same))
    print(f"\n## {len(questions)} questions about one {L}-token document ({args.method}, {args.ranks} simulated "
          f"ranks, {new} new tokens, greedy)\n")
    print("| mode | total s | speed-up | answers equal the uncached ones |")
    print("|---|---:|---:|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['seconds']:.1f} | {r['speedup']:.2f}x | {'yes' if r['same_tokens'] else 'NO'} |")
    print(f"\nneedle answer {answer}: uncached {uncached[0].text.strip()!r}, cached {cached[0].text.strip()!r}")
    print(f"Phase 1 of the document (uncached, summed over ranks): {sum(uncached[0].phase1_seconds):.1f} s; "
          f"cache {warm.cache.stats()}")
    return dict(context_tokens=L, questions=len(questions), rows=rows,
                phase1_seconds=sum(uncached[0].phase1_seconds))


def _client_round(url: str, jobs: list[tuple[str, str]], clients: int, new: int) -> dict:
    """``jobs`` (context, question) shared out to ``clients`` threads, each streaming its requests in a row with the
    ``openai`` client; returns wall seconds, completion tokens, TTFTs and the answers by job index."""
    import threading

    from openai import OpenAI

    ttfts, tokens, answers, errors = [], [0], {}, []
    lock = threading.Lock()

    def client(mine: list[int]):
        api = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        for i in mine:
            context, question = jobs[i]
            t0 = time.perf_counter()
            first, text, used = None, [], 0
            try:
                stream = api.chat.completions.create(
                    model="bench", messages=[{"role": "user", "content": question}], max_tokens=new, temperature=0,
                    stream=True, stream_options={"include_usage": True}, extra_body={"magnetar": {"context": context}})
                for chunk in stream:
                    if chunk.usage is not None:
                        used = chunk.usage.completion_tokens
                    if chunk.choices and chunk.choices[0].delta.content:
                        if first is None:
                            first = time.perf_counter() - t0
                        text.append(chunk.choices[0].delta.content)
            except Exception as e:  # reported below: a failed request must not pass as a fast one
                with lock:
                    errors.append(f"job {i}: {e}")
                continue
            with lock:
                ttfts.append(first if first is not None else time.perf_counter() - t0)
                tokens[0] += used
                answers[i] = "".join(text)

    shares = [list(range(k, len(jobs), clients)) for k in range(clients)]
    threads = [threading.Thread(target=client, args=(share,)) for share in shares if share]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed: {errors[:3]}")
    return dict(seconds=wall, tokens=tokens[0], ttfts=ttfts, answers=answers)


def _start_server(model, tokenizer, args, prefill_chunk=None, **flat):
    """(server, its thread, its exit status list): ``magnetar.serve``'s Server in this process on 127.0.0.1."""
    import threading

    from magnetar.serve.server import Server

    eng = engine(model, tokenizer, args, **flat)
    chunk = {} if prefill_chunk is None else dict(prefill_chunk=prefill_chunk)
    server = Server(eng, model_name="bench", port=free_port(), max_batch_size=args.max_batch,
                    max_tokens=args.new_tokens, **chunk)
    status = []
    thread = threading.Thread(target=lambda: status.append(server.run()), daemon=True)
    thread.start()
    if not server.started.wait(120) or server.loop.start_error is not None:
        raise RuntimeError(f"the server did not start: {server.loop.start_error}")
    return server, thread, status


def part_pasted(model, tokenizer, args) -> dict:
    """``--questions`` plain chat messages (document pasted + question): split and cached vs the whole message."""
    from openai import OpenAI

    [(doc, needle_q, answer)] = documents(tokenizer, args.context_tokens, 1, args.seed)
    questions = ([needle_q] + QUESTIONS)[: args.questions]
    server, thread, status = _start_server(model, tokenizer, args)
    api = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=3600)
    rows, answers = [], {}
    try:
        api.chat.completions.create(model="bench", messages=[{"role": "user", "content": "Hello?"}], max_tokens=2,
                                    extra_body={"magnetar": {"context": "Warm-up text. " * 8}})
        for label, extra in (("whole message (split_document: false)", {"magnetar": {"split_document": False}}),
                             ("split: the pasted document is Phase 1", {})):
            times, cached, splits, texts = [], 0, set(), []
            t0 = time.perf_counter()
            for q in questions:
                t1 = time.perf_counter()
                r = api.chat.completions.create(model="bench", max_tokens=args.new_tokens, temperature=0,
                                                messages=[{"role": "user", "content": doc + "\n\n" + q}],
                                                extra_body=extra or None)
                times.append(time.perf_counter() - t1)
                cached += r.usage.prompt_tokens_details.cached_tokens
                splits.add(r.model_extra["magnetar"]["prompts"][0]["split"])
                texts.append(r.choices[0].message.content)
            rows.append(dict(mode=label, seconds=time.perf_counter() - t0, first_s=times[0],
                             later_s=statistics.mean(times[1:]) if len(times) > 1 else times[0],
                             cached_tokens=cached, split="/".join(sorted(splits))))
            answers[label] = texts
    finally:
        server.drain()
        thread.join(timeout=120)
    base = rows[0]["seconds"]
    for r in rows:
        r["speedup"] = base / r["seconds"]
    same = sum(a == b for a, b in zip(*answers.values()))
    print(f"\n## {len(questions)} questions about one ~{args.context_tokens}-token document pasted into plain chat "
          f"messages ({args.method}, {args.ranks} simulated ranks, {args.new_tokens} new tokens, greedy)\n")
    print("| mode | split | total s | first s | later s (mean) | cached tokens | speed-up |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['mode']} | {r['split']} | {r['seconds']:.1f} | {r['first_s']:.1f} | {r['later_s']:.1f} | "
              f"{r['cached_tokens']} | {r['speedup']:.2f}x |")
    print(f"\nneedle {answer}: whole {list(answers.values())[0][0].strip()!r}, split "
          f"{list(answers.values())[1][0].strip()!r}; {same} of {len(questions)} answers identical")
    return dict(rows=rows, same_answers=same, questions=len(questions), server_status=status[0] if status else None)


def part_turns(model, tokenizer, args) -> dict:
    """A conversation over one pasted document, with and without prefix reuse."""
    from openai import OpenAI

    [(doc, needle_q, answer)] = documents(tokenizer, args.turn_context_tokens, 1, args.seed + 7)
    questions = ([needle_q] + [q.split("?")[0] + "?" for q in QUESTIONS])[: args.turns]
    out = {}
    for mode in ("all", "off"):
        server, thread, status = _start_server(model, tokenizer, args, prefix_reuse=mode)
        api = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=3600)
        rows, messages = [], []
        try:
            for i, q in enumerate(questions):
                messages.append({"role": "user", "content": (doc + "\n\n" + q) if i == 0 else q})
                t0 = time.perf_counter()
                r = api.chat.completions.create(model="bench", messages=messages, max_tokens=args.new_tokens,
                                                temperature=0)
                seconds = time.perf_counter() - t0
                info = r.model_extra["magnetar"]["prompts"][0]
                cached = r.usage.prompt_tokens_details.cached_tokens
                rows.append(dict(turn=i + 1, seconds=seconds, split=info["split"],
                                 context_tokens=info["context_tokens"],
                                 encoded_tokens=info["context_tokens"] - cached, cached_tokens=cached,
                                 text=r.choices[0].message.content))
                messages.append({"role": "assistant", "content": r.choices[0].message.content})
        finally:
            server.drain()
            thread.join(timeout=120)
        out[mode] = rows
    print(f"\n## A {len(questions)}-turn conversation over one ~{args.turn_context_tokens}-token pasted document "
          f"({args.method}, {args.ranks} simulated ranks, {args.new_tokens} new tokens, greedy)\n")
    print("| turn | context tokens | encoded with reuse | s with reuse | encoded without | s without | speed-up | "
          "same answer |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    for a, b in zip(out["all"], out["off"]):
        print(f"| {a['turn']} | {a['context_tokens']} | {a['encoded_tokens']} | {a['seconds']:.1f} | "
              f"{b['encoded_tokens']} | {b['seconds']:.1f} | {b['seconds'] / a['seconds']:.2f}x | "
              f"{'yes' if a['text'] == b['text'] else 'no'} |")
    total = {m: sum(r["seconds"] for r in rows) for m, rows in out.items()}
    print(f"\ntotal: {total['all']:.1f} s with reuse, {total['off']:.1f} s without "
          f"({total['off'] / total['all']:.2f}x)")
    return dict(rows={m: [{k: v for k, v in r.items() if k != "text"} for r in rows] for m, rows in out.items()},
                total_seconds=total)


def part_clients(model, tokenizer, args) -> dict:
    """The server in this process; rounds of 1 (one at a time), then each ``--clients`` count."""
    docs = documents(tokenizer, args.client_context_tokens, args.documents, args.seed + 100)
    server, thread, status = _start_server(model, tokenizer, args)
    url = server.url
    try:
        for context, _, _ in docs:  # encode every document once, so every round sees cache hits only; and a
            _client_round(url, [(context, "Hello?")], 1, args.new_tokens)  # full-length warm-up of the decode path
        rows, answers = [], None
        for clients in args.clients:
            n = max(clients * args.rounds, args.rounds)
            jobs = [(docs[i % len(docs)][0], QUESTIONS[i % len(QUESTIONS)]) for i in range(n)]
            alone = _client_round(url, jobs, 1, args.new_tokens)
            together = _client_round(url, jobs, clients, args.new_tokens)
            same = alone["answers"] == together["answers"]
            answers = answers or alone["answers"]
            for label, r in (("one at a time", alone), (f"{clients} concurrent", together)):
                q = statistics.quantiles(r["ttfts"], n=100, method="inclusive") if len(r["ttfts"]) > 1 else \
                    [r["ttfts"][0]] * 99
                rows.append(dict(clients=clients, mode=label, requests=n, tokens=r["tokens"], seconds=r["seconds"],
                                 tokens_per_s=r["tokens"] / r["seconds"], ttft_p50=q[49], ttft_p99=q[98],
                                 same_answers=same))
            rows[-1]["speedup"] = rows[-1]["tokens_per_s"] / rows[-2]["tokens_per_s"]
    finally:
        server.drain()
        thread.join(timeout=120)
    print(f"\n## Streaming clients ({args.method}, {args.ranks} simulated ranks, {args.documents} documents of "
          f"~{args.client_context_tokens} tokens in the context cache, {args.new_tokens} new tokens, greedy, "
          f"decode batch <= {args.max_batch})\n")
    print("| clients | serving | requests | tokens | s | tokens/s | TTFT p50 s | TTFT p99 s | speed-up "
          "| same answers |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        speed = f"{r['speedup']:.2f}x" if "speedup" in r else ""
        print(f"| {r['clients']} | {r['mode']} | {r['requests']} | {r['tokens']} | {r['seconds']:.1f} | "
              f"{r['tokens_per_s']:.1f} | {r['ttft_p50']:.2f} | {r['ttft_p99']:.2f} | {speed} | "
              f"{'yes' if r['same_answers'] else 'NO'} |")
    return dict(rows=rows, server_status=status[0] if status else None)


def part_stall(model, tokenizer, args) -> dict:
    """A request decoding while another brings a new ``--context-tokens`` document, with ``--prefill-chunk`` 0
    (the whole Phase 1 between two steps) and each chunk size of ``--stall-chunks``: the decoding request's longest
    gap between two tokens, its total seconds, and the newcomer's TTFT."""
    import threading

    from openai import OpenAI

    [(doc, needle_q, _)], [(small, _, _)] = (documents(tokenizer, args.context_tokens, 1, args.seed + 5),
                                             documents(tokenizer, 500, 1, args.seed + 6))
    rows = []
    for chunk in [0] + args.stall_chunks:
        server, thread, status = _start_server(model, tokenizer, args, prefill_chunk=chunk)
        api = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=3600)
        try:
            _stream(api, "bench", small + "\n\nSay hello.", 4)  # warm-up; the small document is then cached
            stamps, started = [], threading.Event()

            def decoding():
                stream = api.chat.completions.create(
                    model="bench", messages=[{"role": "user", "content": small + "\n\n" + QUESTIONS[0]}],
                    max_tokens=args.stall_tokens, temperature=0, stream=True)
                for c in stream:
                    if c.choices and c.choices[0].delta.content:
                        stamps.append(time.perf_counter())
                        if len(stamps) == 5:
                            started.set()

            a = threading.Thread(target=decoding)
            a.start()
            started.wait(600)
            t0 = time.perf_counter()
            b = _stream(api, "bench", doc + "\n\n" + needle_q, 8)
            a.join()
            gaps = [y - x for x, y in zip(stamps, stamps[1:])]
            rows.append(dict(prefill_chunk=chunk, max_gap_s=max(gaps), decode_s=stamps[-1] - stamps[0],
                             tokens=len(stamps), newcomer_ttft_s=b["ttft"], newcomer_started_s=t0 - stamps[0],
                             chunks_applied=server.loop.prefill_chunk > 0))
        finally:
            server.drain()
            thread.join(timeout=120)
    print(f"\n## A decoding request while a new ~{args.context_tokens}-token document arrives ({args.method}, "
          f"{args.ranks} rank(s), decode_step {args.decode_step or 'eager'})\n")
    print("| --prefill-chunk | longest gap between its tokens (s) | its decode (s, tokens) | newcomer TTFT (s) |")
    print("|---|---:|---:|---:|")
    for r in rows:
        label = "0 (whole Phase 1)" if r["prefill_chunk"] == 0 else str(r["prefill_chunk"])
        print(f"| {label} | {r['max_gap_s']:.2f} | {r['decode_s']:.1f} ({r['tokens']}) | {r['newcomer_ttft_s']:.1f} |")
    return dict(rows=rows)


# ------------------------------------------------------------------------------------------- part peer


def _stream(api, model: str, content: str, max_tokens: int, extra_body: Optional[dict] = None) -> dict:
    """One streamed chat request (a plain message: the document pasted before the question): TTFT, decode ms per
    token after the first, completion tokens, text."""
    r = stream_chat(api, model, [{"role": "user", "content": content}], max_tokens, extra_body=extra_body)
    first, last = (r["stamps"][0], r["stamps"][-1]) if r["stamps"] else (r["end"], r["end"])
    used = r["tokens"]
    ms = 1000 * (last - first) / (used - 1) if used > 1 else None
    return dict(seconds=r["end"] - r["t0"], ttft=first - r["t0"], ms_per_token=ms, tokens=used, text=r["text"])


def _extra_body(args) -> Optional[dict]:
    """What every request of the peer and join parts adds to its body: ``ignore_eos`` with ``--ignore-eos``."""
    return {"ignore_eos": True} if args.ignore_eos else None


def _clients(api, model: str, contents: list[str], new: int, together: bool, what: str,
             extra_body: Optional[dict] = None) -> tuple[list[dict], float]:
    """One streamed request per content (:func:`_stream`), all at once (a thread each) or one after another: their
    results and the wall seconds; RuntimeError naming ``what`` when one failed."""
    import threading

    results = [None] * len(contents)

    def client(i):
        results[i] = _stream(api, model, contents[i], new, extra_body)

    t0 = time.perf_counter()
    if together:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(contents))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for i in range(len(contents)):
            client(i)
    wall = time.perf_counter() - t0
    if any(r is None for r in results):
        raise RuntimeError(f"a client request of {what} failed")
    return results, wall


def peer_workloads(url: str, model: str, docs: dict, args) -> dict:
    """The workloads of issue 33 through the plain OpenAI API (nothing Magnetar-specific, so any server runs them):
    ``one_4k`` one streamed request over a 4K document, cold then again with another question (its context cached);
    ``questions_8k`` ten questions about one 8K document in a row; ``clients_8`` eight concurrent streaming clients,
    each with its own 1K document, and the same eight one at a time; ``prefill_8k`` one new 8K document, one token."""

    from openai import OpenAI

    api = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    new = args.new_tokens
    extra = _extra_body(args)
    out = {"ignore_eos": bool(args.ignore_eos)}
    _stream(api, model, "Warm-up. " * 20 + "\n\nSay hello.", 4)
    cold = _stream(api, model, docs["4k"] + "\n\n" + QUESTIONS[0], new, extra)
    warm = _stream(api, model, docs["4k"] + "\n\n" + QUESTIONS[1], new, extra)
    out["one_4k"] = dict(cold=cold, cached=warm)
    t0, texts = time.perf_counter(), []
    for q in ([docs["needle_q"]] + QUESTIONS)[: args.questions]:
        texts.append(_stream(api, model, docs["8k"] + "\n\n" + q, new, extra)["text"])
    out["questions_8k"] = dict(seconds=time.perf_counter() - t0, texts=texts)
    for label, clients in (("alone", 1), ("together", 8)):
        jobs = docs["clients_alone" if label == "alone" else "clients_together"]
        results, wall = _clients(api, model, [j + "\n\n" + QUESTIONS[i % len(QUESTIONS)] for i, j in enumerate(jobs)],
                                 new, together=clients > 1, what=f"{url}: the {label} round", extra_body=extra)
        tokens = sum(r["tokens"] for r in results)
        out[f"clients_8_{label}"] = dict(seconds=wall, tokens=tokens, tokens_per_s=tokens / wall,
                                         ttft_p50=statistics.median(r["ttft"] for r in results),
                                         ttfts=sorted(r["ttft"] for r in results),
                                         texts=[r["text"] for r in results])
    t0 = time.perf_counter()
    _stream(api, model, docs["prefill"] + "\n\n" + QUESTIONS[2], 1, extra)
    out["prefill_8k"] = dict(seconds=time.perf_counter() - t0)
    return out


def part_served(model, tokenizer, args, on_progress=None) -> dict:
    """The served workloads of issue 47 (item 3), what the GPU kit's ``serve`` step runs: the server in this process,
    plain chat requests (each document pasted before its question) with the ``openai`` client. ``one``: one streamed
    request over a new ``--context-tokens`` document -- its TTFT (Phase 1 of the whole document) and decode ms/token
    (after the first token); then for each ``--clients`` count that many concurrent streaming clients, each with a new
    ``--client-context-tokens`` document of its own: completion tokens/s over the wall time and TTFT p50/p99.
    ``on_progress(record)`` after each workload, the record so far (``complete`` False)."""

    from openai import OpenAI

    server, thread, status = _start_server(model, tokenizer, args)
    api = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=3600)
    new, rows = args.new_tokens, []

    def record(one: dict, complete: bool) -> dict:
        return dict(context_tokens=args.context_tokens, one=dict(ttft=one["ttft"], ms_per_token=one["ms_per_token"],
                                                                 tokens=one["tokens"]),
                    clients=list(rows), client_context_tokens=args.client_context_tokens,
                    server_status=status[0] if status else None, complete=complete)
    try:
        _stream(api, "bench", "Warm-up. " * 20 + "\n\nSay hello.", 4)
        [(doc, question, _)] = documents(tokenizer, args.context_tokens, 1, args.seed)
        one = _stream(api, "bench", doc + "\n\n" + question, new)
        print(f"served: one request, {args.context_tokens}-token document: TTFT {one['ttft']:.2f} s, "
              f"{one['ms_per_token'] or float('nan'):.1f} ms/token over {one['tokens']} tokens", flush=True)
        if on_progress is not None:
            on_progress(record(one, False))
        for clients in args.clients:
            docs = documents(tokenizer, args.client_context_tokens, clients, args.seed + 1000 * clients)
            results, wall = _clients(api, "bench", [d[0] + "\n\n" + QUESTIONS[i % len(QUESTIONS)]
                                                    for i, d in enumerate(docs)], new, together=True,
                                     what=f"the {clients}-client round (the server's log says why)")
            ttfts = sorted(r["ttft"] for r in results)
            tokens = sum(r["tokens"] for r in results)
            rows.append(dict(clients=clients, tokens=tokens, seconds=wall, tokens_per_s=tokens / wall,
                             ttft_p50=statistics.median(ttfts), ttft_p99=ttfts[min(len(ttfts) - 1,
                                                                                   int(0.99 * len(ttfts)))]))
            print(f"served: {clients} concurrent clients: {tokens / wall:.1f} tokens/s", flush=True)
            if on_progress is not None:
                on_progress(record(one, False))
    finally:
        server.drain()
        thread.join(timeout=120)
    print(f"\n## Served ({args.model}, {args.dtype}, {args.method}, {args.ranks} rank(s), {new} new tokens, greedy, "
          f"decode batch <= {args.max_batch}, decode step {args.decode_step or 'default'})\n")
    print("| workload | TTFT s (p50 / p99) | decode ms/token | tokens/s |")
    print("|---|---|---:|---:|")
    ms = "-" if one["ms_per_token"] is None else f"{one['ms_per_token']:.1f}"
    print(f"| one request, {args.context_tokens}-token document | {one['ttft']:.2f} | {ms} | "
          f"{1000 / one['ms_per_token'] if one['ms_per_token'] else float('nan'):.1f} |")
    for r in rows:
        print(f"| {r['clients']} clients, {args.client_context_tokens}-token documents | {r['ttft_p50']:.2f} / "
              f"{r['ttft_p99']:.2f} | - | {r['tokens_per_s']:.1f} |")
    return record(one, True)


@contextlib.contextmanager
def _process(cmd: list, name: str, stop_s: float):
    """``(process, log path)`` of ``cmd`` started in a session of its own, its output in a log file (the error when
    it does not start); when the block ends it gets SIGTERM, and SIGKILL after ``stop_s`` seconds."""
    import signal
    import subprocess
    import tempfile

    log = Path(tempfile.mkdtemp(prefix=f"magnetar-bench-{name}-")) / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc, log
    finally:
        if proc.poll() is None:  # (one that exited has nothing left to stop)
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=stop_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def serve_command(args, port: int, extra: tuple = ()) -> list[str]:
    """``magnetar serve`` with the bench's flags (and ``extra``): the bench's model in the bench's ``--dtype`` (without
    it the server loads the checkpoint's own dtype -- SmolLM2's folder is float32 --, so a bf16 comparison against a
    peer served fp32 against bf16)."""
    cmd = [sys.executable, "-m", "magnetar.serve", "--model", args.model_path, "--served-model-name", "bench",
           "--port", str(port), "--method", args.method, "--dtype", args.dtype, "--max-batch-size", str(args.max_batch),
           "--max-tokens", str(args.new_tokens), "--deepspeed-inference", "false", *extra]
    if args.ranks > 1:
        cmd += ["--cp-size", str(args.ranks), "--simulate", "true"]
    if args.decode_step is not None:
        cmd += ["--decode-step", args.decode_step]
    if args.decode_step == "graph":
        cmd += ["--decode-graph-batches", graph_batches(args.max_batch)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    return cmd


@contextlib.contextmanager
def _serve_process(args, extra: tuple = ()):
    """The URL of ``magnetar serve`` (:func:`serve_command`) started in its own process, as a user starts it (its own
    thread choice); stopped (SIGTERM: it drains) when the block ends."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = serve_command(args, port, extra)
    with _process(cmd, "serve", 120) as (proc, log):
        print(f"magnetar serve's log: {log}", flush=True)
        wait_ready(url, proc, log, args.peer_ready_s, path="/v1/models")
        yield url


def part_join(model, tokenizer, args) -> dict:
    """Eight concurrent clients with ~1K-token messages (all query) against ``magnetar serve`` at each
    ``--join-tokens`` value, alternated ``--rounds`` times: each client's TTFT, p50 / max, wall, tokens/s."""
    from openai import OpenAI

    rows = []
    for r in range(args.rounds):
        docs = [d for d, _, _ in documents(tokenizer, args.client_context_tokens, 8, args.seed + 40 + 8 * r)]
        contents = [d + "\n\n" + QUESTIONS[i % len(QUESTIONS)] for i, d in enumerate(docs)]
        for bound in args.join_tokens:
            # --paste-threshold 0: no message is cut into a document and a question -- every message is a query
            with _serve_process(args, ("--max-join-tokens", str(bound), "--paste-threshold", "0")) as url:
                api = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
                _stream(api, "bench", "Warm-up. " * 20 + "\n\nSay hello.", 4)
                results, wall = _clients(api, "bench", contents, args.new_tokens, True, f"round {r}",
                                         extra_body=_extra_body(args))
            ttfts = sorted(x["ttft"] for x in results)
            tokens = sum(x["tokens"] for x in results)
            rows.append(dict(round=r, max_join_tokens=bound, ttfts=ttfts, ttft_p50=statistics.median(ttfts),
                             ttft_max=ttfts[-1], wall_s=wall, tokens=tokens, tokens_per_s=tokens / wall))
            print(f"[bench_serve] join round {r}, --max-join-tokens {bound}: TTFT p50 {rows[-1]['ttft_p50']:.2f} s, "
                  f"{rows[-1]['tokens_per_s']:.2f} tokens/s", file=sys.stderr, flush=True)
    print(f"\n## 8 concurrent clients, own ~{args.client_context_tokens}-token messages (query only), "
          f"--max-join-tokens alternated ({args.method}, {args.ranks} rank(s), {args.new_tokens} new tokens)\n")
    print("| round | --max-join-tokens | TTFT p50 (s) | TTFT max (s) | every client's TTFT (s) | wall (s) | tokens/s |")
    print("|---:|---:|---:|---:|---|---:|---:|")
    for x in rows:
        every = " ".join(f"{t:.1f}" for t in x["ttfts"])
        label = "0 (no bound)" if x["max_join_tokens"] == 0 else str(x["max_join_tokens"])
        print(f"| {x['round']} | {label} | {x['ttft_p50']:.2f} | {x['ttft_max']:.2f} | {every} | {x['wall_s']:.1f} | "
              f"{x['tokens_per_s']:.2f} |")
    return dict(rows=rows)


def part_peer(model, tokenizer, args) -> dict:
    """The peer workloads against the peer (``--peer``; started and stopped by ``--peer-cmd`` if given), then against
    ``magnetar serve`` in its own process (``--serve-in-process``: in this one) with ``--method``, ``--ranks``,
    ``--decode-step``: one server at a time."""
    import shlex
    import urllib.request

    from magnetar.utils.machine import cpu_description

    def doc(tokens, seed):
        return documents(tokenizer, tokens, 1, seed)[0]

    d4, d8, pre = doc(4000, args.seed + 1), doc(7800, args.seed + 2), doc(7800, args.seed + 3)
    docs = {"4k": d4[0], "8k": d8[0], "needle_q": d8[1], "prefill": pre[0],
            # fresh documents for each round (no server has seen them: every client's request needs its Phase 1)
            "clients_alone": [doc(1000, args.seed + 10 + i)[0] for i in range(8)],
            "clients_together": [doc(1000, args.seed + 20 + i)[0] for i in range(8)]}
    results = {}
    if args.peer_results:
        lines = [ln for ln in open(args.peer_results).read().splitlines() if ln.startswith("{")]
        results["peer"] = json.loads(lines[-1])["peer"]["results"]["peer"]
        if results["peer"].get("ignore_eos", False) != bool(args.ignore_eos):
            raise SystemExit(f"bench_serve: error: --peer-results {args.peer_results} was measured "
                             f"{'with' if results['peer'].get('ignore_eos') else 'without'} --ignore-eos: run this "
                             f"one the same way (the two must generate the same tokens' work)")
    else:
        started = _process(shlex.split(args.peer_cmd), "peer", 60) if args.peer_cmd else \
            contextlib.nullcontext((None, None))
        with started as (proc, peer_log):
            wait_ready(args.peer, proc, peer_log, args.peer_ready_s if proc else 30, path="/v1/models")
            with urllib.request.urlopen(args.peer + "/v1/models", timeout=10) as r:
                peer_model = json.loads(r.read())["data"][0]["id"]
            t0 = time.perf_counter()
            results["peer"] = peer_workloads(args.peer, peer_model, docs, args)
            results["peer"]["wall_s"] = time.perf_counter() - t0
    if args.serve_in_process:
        server, thread, status = _start_server(model, tokenizer, args)
        try:
            t0 = time.perf_counter()
            results["magnetar"] = peer_workloads(server.url, "bench", docs, args)
            results["magnetar"]["wall_s"] = time.perf_counter() - t0
        finally:
            server.drain()
            thread.join(timeout=120)
    else:  # `magnetar serve` in its own process, as a user starts it (its thread choice), like the peer
        with _serve_process(args) as url:
            t0 = time.perf_counter()
            results["magnetar"] = peer_workloads(url, "bench", docs, args)
            results["magnetar"]["wall_s"] = time.perf_counter() - t0
    m, o = results["magnetar"], results["peer"]
    rows = [("one request, 4K document: TTFT (s)", m["one_4k"]["cold"]["ttft"], o["one_4k"]["cold"]["ttft"], "lower"),
            ("  the same document again: TTFT (s)", m["one_4k"]["cached"]["ttft"], o["one_4k"]["cached"]["ttft"],
             "lower"),
            ("  decode ms/token (cached document)", m["one_4k"]["cached"]["ms_per_token"],
             o["one_4k"]["cached"]["ms_per_token"], "lower"),
            (f"{args.questions} questions on one 8K document (s)", m["questions_8k"]["seconds"],
             o["questions_8k"]["seconds"], "lower"),
            ("8 clients, own 1K documents, one at a time: tokens/s", m["clients_8_alone"]["tokens_per_s"],
             o["clients_8_alone"]["tokens_per_s"], "higher"),
            ("8 concurrent clients: tokens/s", m["clients_8_together"]["tokens_per_s"],
             o["clients_8_together"]["tokens_per_s"], "higher"),
            ("  8 concurrent clients: TTFT p50 (s)", m["clients_8_together"]["ttft_p50"],
             o["clients_8_together"]["ttft_p50"], "lower"),
            ("  8 concurrent clients: wall (s)", m["clients_8_together"]["seconds"],
             o["clients_8_together"]["seconds"], "lower"),
            ("  8 concurrent clients: tokens generated", m["clients_8_together"]["tokens"],
             o["clients_8_together"]["tokens"], "-"),
            ("one 8K prefill, 1 token (s)", m["prefill_8k"]["seconds"], o["prefill_8k"]["seconds"], "lower")]
    same = {k: sum(a == b for a, b in zip(m[k]["texts"], o[k]["texts"])) if "texts" in o[k] else None for k in
            ("questions_8k", "clients_8_alone", "clients_8_together")}
    print(f"\n## Peer: Magnetar ({args.dtype}, {args.method}, {args.ranks} rank(s), decode_step "
          f"{args.decode_step or 'eager'}) "
          f"against {args.peer} ({o.get('model', 'peer')}), the same plain OpenAI requests, {args.new_tokens} new "
          f"tokens{' (ignore_eos: every answer that long)' if args.ignore_eos else ''}, greedy; "
          f"{cpu_description()}\n")
    print("| workload | Magnetar | peer | Magnetar / peer | better |")
    print("|---|---:|---:|---:|---|")
    table = []
    for label, a, b, better in rows:
        ratio = None if a is None or b in (None, 0) else a / b
        table.append(dict(workload=label.strip(), magnetar=a, peer=b, ratio=ratio, better=better))
        fa, fb = (("-" if x is None else f"{x:.2f}" if isinstance(x, float) else str(x)) for x in (a, b))
        print(f"| {label} | {fa} | {fb} | {'-' if ratio is None else f'{ratio:.2f}'} | {better} |")
    print(f"\nanswers identical to the peer's: {same}")
    return dict(peer=args.peer, rows=table, same_answers=same, results=results)  # the texts stay: --peer-results


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from magnetar.utils.machine import cpu_description

    model, tokenizer = load(args)
    out = dict(bench="serve", model="tiny" if args.tiny else args.model, method=args.method, ranks=args.ranks,
               dtype=args.dtype, device=str(next(model.parameters()).device),
               machine=f"{platform.machine()} {platform.processor() or ''}".strip(), cpu=cpu_description(),
               torch_threads=torch.get_num_threads())
    if "cache" in args.parts:
        out["cache"] = part_cache(model, tokenizer, args)
    if "clients" in args.parts:
        out["clients"] = part_clients(model, tokenizer, args)
    if "pasted" in args.parts:
        out["pasted"] = part_pasted(model, tokenizer, args)
    if "turns" in args.parts:
        out["turns"] = part_turns(model, tokenizer, args)
    if "peer" in args.parts:
        out["peer"] = part_peer(model, tokenizer, args)
    if "stall" in args.parts:
        out["stall"] = part_stall(model, tokenizer, args)
    if "join" in args.parts:
        out["join"] = part_join(model, tokenizer, args)
    if "served" in args.parts:
        out["served"] = part_served(model, tokenizer, args, on_progress=None if args.json_out is None else (
            lambda served: write_json_line(args.json_out, {**out, "served": served})))
    print(json.dumps(out))
    if args.json_out is not None:
        write_json_line(args.json_out, out)
    return 0



if __name__ == "__main__":
    sys.exit(main())
