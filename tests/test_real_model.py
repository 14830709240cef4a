"""The engine on the real SmolLM2-135M-Instruct (prepared offline from its PyPI package), short contexts.

Marked ``model`` (``pytest -m "not model"`` skips them); CI runs them: the Makefile installs the packages.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.model

MODEL = "smollm2-135m-instruct"
TOKENS = 1500


def _sample(tokenizer):
    from magnetar.data.niah import INSTRUCTION, needle_prompt

    s = needle_prompt(tokenizer, TOKENS, 0.5, seed=1)
    return f"{INSTRUCTION}\n\n{s.context}", f"\n\n{s.query}", s.answer


def test_dense_engine_answers_needle_and_matches_hf_generate(smollm2_path):
    import magnetar
    from magnetar.data.niah import score_answer
    from magnetar.engine.template import split_prompt
    from magnetar.models import load_model

    model, tok = load_model(MODEL)
    context, query, answer = _sample(tok)
    prompt = split_prompt(tok, context, query)
    ids = torch.cat((prompt.context_ids, prompt.query_ids))[None]
    with torch.no_grad():
        hf_out = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
    engine = magnetar.init_inference(model, method="dense", tokenizer=tok, deepspeed_inference=False)
    res = engine.generate(context, query, max_new_tokens=24)
    assert score_answer(res.text, answer), f"dense answered {res.text!r}, expected {answer}"
    n = min(len(res.token_ids), len(hf_out))
    assert res.token_ids[:n] == hf_out[:n], "dense engine tokens differ from HF's own generate"
    assert res.context_kv_tokens_per_rank == [prompt.context_ids.numel()]


def _methods_worker(rank, world):
    import magnetar
    from magnetar.data.niah import score_answer
    from magnetar.models import load_model

    model, tok = load_model(MODEL)
    context, query, answer = _sample(tok)
    results = {}
    for method in ("ring", "star", "pulsar"):
        engine = magnetar.init_inference(model, method=method, cp_size=world, tokenizer=tok,
                                         deepspeed_inference=(method == "ring"))
        res = engine.generate(context, query, max_new_tokens=24)
        L = res.context_tokens
        block = -(-L // world)
        assert res.context_kv_tokens_per_rank == [min(block, L - r * block) for r in range(world)], (method, res)
        assert res.text.strip(), f"{method} produced no text"
        results[method] = res
    # ring is exact: on the real model it must answer like the dense reference does
    assert score_answer(results["ring"].text, answer), f"ring answered {results['ring'].text!r}, expected {answer}"


def test_context_parallel_methods_on_two_ranks(smollm2_path):
    from tests.dist_utils import run_distributed

    run_distributed(_methods_worker, 2)


def test_run_cli_prints_answer_table_and_json(smollm2_path, tmp_path, capsys):
    import json

    from magnetar.launch.run import main

    ctx = tmp_path / "ctx.txt"
    ctx.write_text("The capital of the fictional country of Zembla is Onhava. " * 4)
    out = tmp_path / "res.json"
    assert main(["--model", MODEL, "--method", "dense", "--context-file", str(ctx), "--query",
                 "What is the capital of Zembla?", "--max-new-tokens", "24", "--json-out", str(out),
                 "--deepspeed-inference", "false"]) == 0
    printed = capsys.readouterr().out
    assert "answer:" in printed and "phase-1 critical path" in printed
    res = json.loads(out.read_text())
    assert "Onhava" in res["text"] and res["method"] == "dense" and res["context_kv_tokens_per_rank"][0] > 40


def test_prompt_split_chat_template_and_plain(smollm2_path):
    import copy

    from magnetar.engine.template import split_prompt
    from magnetar.models import load_model

    _, tok = load_model(MODEL)
    context, query = "Alpha beta gamma. The key is 42.", " What is the key?"
    p = split_prompt(tok, context, query)
    rendered = tok.apply_chat_template([{"role": "user", "content": context + query}], tokenize=False,
                                       add_generation_prompt=True)
    # Phase 1 ends with the context; Phase 2 holds the question and the assistant header; together: the turn
    head = tok.decode(p.context_ids)
    assert head.endswith(context) and "<|im_start|>assistant" not in head
    assert tok.decode(p.query_ids).startswith(query) and tok.decode(p.query_ids).rstrip().endswith("assistant")
    assert tok.decode(torch.cat((p.context_ids, p.query_ids))) == rendered
    # base model (no chat template): plain {context}{query}
    plain = copy.deepcopy(tok)
    plain.chat_template = None
    p2 = split_prompt(plain, context, query)
    assert tok.decode(p2.context_ids).endswith(context) and tok.decode(p2.query_ids) == query
    with pytest.raises(ValueError, match="query is empty"):
        split_prompt(tok, context, "  ")
