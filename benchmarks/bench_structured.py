"""What a grammar costs a decode step, and how often answers parse with and without one (issue 50's goals).

SmolLM2-135M-Instruct (or ``--model``), one rank: for each of ``--prompts`` extraction prompts over a document of
``--context`` tokens (Paul Graham essays, a fact planted in each), the same request is answered twice, side by side --
free, with an instruction to answer in JSON, and constrained to a JSON schema (``response_format``'s grammar) --
greedy, ``--new-tokens`` at most. Prints per-mode decode ms per token (median over prompts), the share of answers
that parse and validate and of those naming the planted city and year, then one JSON line.

    python benchmarks/bench_structured.py --prompts 10 --context 4096
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                            "year": {"type": "integer", "minimum": 0, "maximum": 3000}},
          "required": ["city", "year"], "additionalProperties": False}
CITIES = ["Lisbon", "Osaka", "Quito", "Tromso", "Accra", "Hobart", "Perth", "Lyon", "Cusco", "Bergen"]


def _valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and set(value) == {"city", "year"} and isinstance(value["city"], str) and \
        isinstance(value["year"], int) and not isinstance(value["year"], bool)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=48)
    args = p.parse_args(argv)
    import llguidance
    import torch

    import magnetar
    from magnetar.data.texts import paul_graham_essays

    engine = magnetar.init_inference(args.model, method="dense", timeout_s=600)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA),
                                                            defaults={"whitespace_flexible": False})
    text = "\n\n".join(paul_graham_essays())
    rows = {"free": [], "constrained": []}
    valid = {"free": 0, "constrained": 0}
    right = {"free": 0, "constrained": 0}  # the planted city and year, wherever they are in the answer
    for i in range(args.prompts):
        city, year = CITIES[i % len(CITIES)], 1900 + 7 * i
        fact = f" The archive was founded in {city} in {year}. "
        ids = engine.tokenizer(text[i * 5000:], add_special_tokens=False)["input_ids"][: args.context]
        half = len(ids) // 2
        doc = engine.tokenizer.decode(ids[:half]) + fact + engine.tokenizer.decode(ids[half:])
        question = ('In which city and year was the archive founded? Answer only with JSON like '
                    '{"city": "...", "year": 1234}.')
        handle = engine.encode(doc)  # one Phase 1 for both modes
        for mode in ("free", "constrained"):
            kw = {"grammar": grammar} if mode == "constrained" else {}
            res = engine.ask(handle, question, max_new_tokens=args.new_tokens, **kw)
            if res.decode_seconds_per_token is not None:
                rows[mode].append(1000 * res.decode_seconds_per_token)
            valid[mode] += _valid(res.text.strip())
            right[mode] += city in res.text and str(year) in res.text
        engine.release(handle)
        print(f"{i + 1}/{args.prompts}", file=sys.stderr, flush=True)
    ms = {m: statistics.median(v) for m, v in rows.items()}
    print(f"| mode | decode ms/token (median of {args.prompts}) | answers that parse and validate | city and year "
          f"right |")
    print("|---|---:|---:|---:|")
    for m in rows:
        print(f"| {m} | {ms[m]:.1f} | {valid[m]}/{args.prompts} | {right[m]}/{args.prompts} |")
    print(f"constrained / free per token: {ms['constrained'] / ms['free']:.2f}x")
    print(json.dumps({"bench": "structured", "model": args.model, "context": args.context, "prompts": args.prompts,
                      "ms_per_token": ms, "valid": valid, "right": right, "ratio": ms["constrained"] / ms["free"],
                      "threads": torch.get_num_threads()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
