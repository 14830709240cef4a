"""benchmarks/bench_decode.py's floor (what a decode step must read) and its shapes flag; the bench itself runs in the
GPU kit's dry run (tests/test_gpu_kit.py)."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import load_benchmark
from tests.tiny_models import tiny_model


def _bench():
    return load_benchmark("bench_decode")


def test_floor_is_the_weights_but_the_embedding_and_every_requests_kv():
    bench = _bench()
    model = tiny_model("llama", seed=0)
    cfg = model.config
    emb = model.get_input_embeddings().weight
    assert emb.data_ptr() != model.get_output_embeddings().weight.data_ptr()  # untied: the head is read, not the table
    weights = sum(p.numel() * 4 for p in model.parameters()) - emb.numel() * 4
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 4
    assert bench.floor_bytes(model, 1, 100) == weights + 100 * per_token
    assert bench.floor_bytes(model, 8, 100) - bench.floor_bytes(model, 1, 100) == 7 * 100 * per_token  # 8 contexts


def test_own_and_shared_contexts():
    """--contexts own gives each request its own document (the floor counts B contexts); shared, one document;
    copies (the default), one document per length whose KV each other request reads from a copy of its own."""
    bench = _bench()
    model = tiny_model("llama", seed=0)
    own = bench._inputs(model, None, 64, 3, True)
    shared = bench._inputs(model, None, 64, 3, False)
    assert len({id(d) for d, _ in own}) == 3 and not torch.equal(own[0][0], own[1][0])
    assert len({id(d) for d, _ in shared}) == 1 and len({id(q) for _, q in shared}) == 3
    assert bench.parse_args([]).contexts == "copies" and bench.parse_args(["--contexts", "shared"]).contexts == "shared"
    assert bench.copy_bandwidth(torch.device("cpu"), 1 << 20) > 0


def test_shapes_flag():
    bench = _bench()
    args = bench.parse_args(["--shapes", "1@32K,8@32k,64@4096"])
    assert args.shapes == [(1, 32768), (8, 32768), (64, 4096)]
    assert bench.parse_args(["--batches", "1,2", "--context-tokens", "512"]).shapes == [(1, 512), (2, 512)]
    for bad in ("8", "0@1K", "2@x", "2@10"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--shapes", bad])
    with pytest.raises(SystemExit):
        bench.parse_args(["--configs", "ring"])


def test_graph_plan_fits_the_largest_shape_and_a_row_out_of_memory_is_skipped(tmp_path, monkeypatch, capsys):
    bench = _bench()
    args = bench.parse_args(["--shapes", "1@32K,8@32K,64@4K", "--steps", "16", "--warmup", "3"])
    plan = bench.graph_plan(args)
    assert plan["decode_graph_batches"] == "1,8,64"
    assert plan["decode_graph_tokens"] == 64 * 256  # each request's own tokens padded to a planned capacity
    # a row that does not fit the card is recorded as skipped and the others go on
    calls = []

    def run(c, m, bsz, n, *a):
        calls.append((c, m, bsz))
        if m == "static" and bsz == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 34.00 GiB")
        return dict(config=c, mode=m, ran=m, why=None, captured=False, capture_s=None, batch=bsz, context_tokens=n,
                    ms_per_step=1.0, ms_per_token=1.0 / bsz, tokens_per_s=1000.0 * bsz, first_step_s=0.1,
                    host_syncs_per_step=1, tokens=[[1]] * bsz, floor_ms=0.5, pct_of_floor=50.0, ranks=1,
                    simulated=False)

    monkeypatch.setattr(bench, "run", run)
    monkeypatch.setattr(bench, "engine_for", lambda *a: object())
    out = tmp_path / "d.json"
    assert bench.main(["--model", "dummy:tiny-llama", "--shapes", "1@512,2@512", "--configs", "dense", "--modes",
                       "eager,static", "--json-out", str(out)]) == 0
    assert len(calls) == 4
    import json

    record = json.loads(out.read_text())
    assert [(r["mode"], r["batch"]) for r in record["rows"]] == [("eager", 1), ("static", 1), ("eager", 2)]
    assert record["skipped"] == [dict(config="dense", mode="static", batch=2, context_tokens=512,
                                      error="out of memory: CUDA out of memory. Tried to allocate 34.00 GiB")]
    assert "not run (out of memory" in capsys.readouterr().out


def test_copies_read_their_own_kv_and_answer_as_the_original():
    import magnetar

    bench = _bench()
    eng = magnetar.init_inference(tiny_model("llama", seed=0), method="dense")
    h = eng.encode(torch.arange(40) % 50 + 3)
    c = bench.copy_handle(h, 1)
    assert c.key != h.key and torch.equal(c.context_ids, h.context_ids)
    assert c.shard.layers[0].k.data_ptr() != h.shard.layers[0].k.data_ptr()
    q = torch.tensor([5, 6, 7])
    alone = eng.ask(h, q, max_new_tokens=4, temperature=0.0).token_ids
    assert [r.token_ids for r in eng.ask_batch([h, c], [q, q], max_new_tokens=4, temperature=0.0)] == [alone, alone]


def test_forks_share_the_document_and_every_mode_chooses_eager_tokens(tmp_path, monkeypatch):
    """--contexts forks: B conversations about one document, each a turn of its own after it -- the first extends
    the document in place, the others fork, sharing its KV --; a step of each mode reads them alike (the same greedy
    tokens), and the floor counts the document once and each turn's KV."""
    import json

    bench = _bench()
    made = []
    real_run = bench.run

    def run(config, mode, bsz, n, args, model, tokenizer, eng, handles):
        row = real_run(config, mode, bsz, n, args, model, tokenizer, eng, handles)
        made.append((row, [h for h, _ in handles[n]]))
        return row

    monkeypatch.setattr(bench, "run", run)
    out = tmp_path / "d.json"
    assert bench.main(["--model", "dummy:tiny-llama", "--shapes", "3@256", "--configs", "dense", "--modes",
                       "eager,static", "--contexts", "forks", "--warmup", "1", "--steps", "2",
                       "--json-out", str(out)]) == 0
    (eager, handles), (static, _) = made
    assert [h.shard.head is not None for h in handles] == [False, True, True]
    assert handles[1].shard.head is handles[2].shard.head  # the one document's shard
    assert eager["tokens"] == static["tokens"] and eager["ran"] == "eager" and static["ran"] == "static"
    assert json.loads(out.read_text())["rows"][0]["contexts"] == "forks"
    assert eager["floor_ms"] > 0
