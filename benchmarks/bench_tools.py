"""Tool-call round trips over a long document (issue 50's goals): do the calls parse, and does the tool result's
turn reuse the document's KV?

SmolLM2-135M-Instruct (or ``--model``) served on one rank (``magnetar serve``'s server, in this process, on
127.0.0.1), asked with the ``openai`` client: for each of ``--prompts`` documents of ``--context`` tokens (Paul
Graham essays, a record number planted in each), the user pastes the document and asks for the record; the
``lookup`` tool is offered. Three requests per document, side by side:

1. ``tool_choice="required"`` (constrained): the call parses and validates? the time to the answer;
2. the tool's result sent back (``role: tool``): its cached tokens against the first request's context tokens,
   and its time (only the new turn is encoded);
3. the same first request with ``tool_choice="auto"`` (free text read by the parser): how often the model calls.

Prints a table, then one JSON line.

    python benchmarks/bench_tools.py --prompts 5 --context 4096
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the tests' helpers (a free port, a server in a thread): tests/dist_utils.py
    sys.path.append(str(REPO))

TOOL = {"type": "function", "function": {
    "name": "lookup", "description": "Look up an archive record by its number and return what it holds.",
    "parameters": {"type": "object", "properties": {"record": {"type": "integer", "minimum": 0, "maximum": 9999}},
                   "required": ["record"]}}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompts", type=int, default=5)
    p.add_argument("--context", type=int, default=4096)
    args = p.parse_args(argv)
    import openai

    import magnetar
    from magnetar.data.texts import paul_graham_essays
    from magnetar.serve.server import Server
    from tests.dist_utils import free_port, serve_in_thread

    engine = magnetar.init_inference(args.model, method="dense", timeout_s=600)
    text = "\n\n".join(paul_graham_essays())
    rows = []
    with serve_in_thread(Server(engine, model_name="m", port=free_port(), max_tokens=64), start_s=600) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        for i in range(args.prompts):
            record = 1000 + 37 * i
            ids = engine.tokenizer(text[i * 5000:], add_special_tokens=False)["input_ids"][: args.context]
            half = len(ids) // 2
            doc = (engine.tokenizer.decode(ids[:half]) + f" The harbour's ledger is archive record {record}. " +
                   engine.tokenizer.decode(ids[half:]))
            first = [{"role": "user", "content": doc + "\n\nWhich archive record is the harbour's ledger? Look it "
                                                      "up with the lookup tool."}]
            t0 = time.perf_counter()
            done = client.chat.completions.create(model="m", messages=first, tools=[TOOL], tool_choice="required",
                                                  parallel_tool_calls=False, temperature=0.0)
            t1 = time.perf_counter()
            calls = done.choices[0].message.tool_calls or []
            args_ok = len(calls) == 1 and _valid(calls[0].function.arguments)
            context = done.model_extra["magnetar"]["prompts"][0]["context_tokens"]
            second = first + [done.choices[0].message.model_dump(exclude_none=True)] + \
                [{"role": "tool", "tool_call_id": c.id, "content": f"record {record}: the harbour's ledger, 1891"}
                 for c in calls]
            t2 = time.perf_counter()
            again = client.chat.completions.create(model="m", messages=second, tools=[TOOL], max_tokens=16,
                                                   temperature=0.0)
            t3 = time.perf_counter()
            auto = client.chat.completions.create(model="m", messages=first, tools=[TOOL], temperature=0.0)
            rows.append(dict(parsed=args_ok, right=args_ok and json.loads(calls[0].function.arguments)["record"] ==
                             record, context=context, cached=again.usage.prompt_tokens_details.cached_tokens,
                             first_s=t1 - t0, result_s=t3 - t2, auto_called=bool(auto.choices[0].message.tool_calls)))
            print(f"  document {i}: call {calls[0].function.arguments if calls else None!r} (record {record}), "
                  f"context {context}, cached on the result's turn {rows[-1]['cached']}, "
                  f"{rows[-1]['first_s']:.1f} s then {rows[-1]['result_s']:.1f} s", file=sys.stderr)
    n = len(rows)
    summary = dict(model=args.model, prompts=n, context=args.context,
                   required_parsed=sum(r["parsed"] for r in rows), required_right=sum(r["right"] for r in rows),
                   auto_called=sum(r["auto_called"] for r in rows),
                   result_turn_reused=sum(r["cached"] >= r["context"] for r in rows),
                   first_s=statistics.median(r["first_s"] for r in rows),
                   result_s=statistics.median(r["result_s"] for r in rows))
    print(f"| tool_choice | calls that parse and validate | right record | turn 2 reuses the document | "
          f"median time |\n|---|---|---|---|---|\n"
          f"| required (constrained) | {summary['required_parsed']}/{n} | {summary['required_right']}/{n} | "
          f"{summary['result_turn_reused']}/{n} | {summary['first_s']:.1f} s, then {summary['result_s']:.1f} s with "
          f"the result |\n| auto (free text) | {summary['auto_called']}/{n} called | | | |")
    print(json.dumps(summary))
    return 0


def _valid(arguments: str) -> bool:
    try:
        value = json.loads(arguments)
    except ValueError:
        return False
    return isinstance(value, dict) and set(value) == {"record"} and isinstance(value["record"], int) and \
        0 <= value["record"] <= 9999


if __name__ == "__main__":
    sys.exit(main())
