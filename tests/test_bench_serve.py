"""benchmarks/bench_serve.py: the ``magnetar serve`` its peer and join parts start carries the bench's flags -- the
dtype above all (without it the server loaded the float32 checkpoint as it is, and a "bf16" comparison against
vLLM's bf16 served Magnetar in fp32)."""
from __future__ import annotations

import pytest

from tests.conftest import load_benchmark, spy_json_writes


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_served_process_gets_the_benchs_dtype_and_flags(dtype):
    bench = load_benchmark("bench_serve")
    args = bench.parse_args(["--dtype", dtype, "--method", "star", "--ranks", "2", "--decode-step", "graph",
                             "--max-batch", "8", "--new-tokens", "32", "--threads", "1"])
    args.model_path = "/models/smollm2"
    cmd = bench.serve_command(args, 8123, ("--max-join-tokens", "512"))

    def flag(name):
        return cmd[cmd.index(name) + 1]

    assert cmd[1:3] == ["-m", "magnetar.serve"] and flag("--model") == "/models/smollm2"
    assert flag("--dtype") == dtype and flag("--port") == "8123" and flag("--method") == "star"
    assert flag("--cp-size") == "2" and flag("--simulate") == "true" and flag("--decode-step") == "graph"
    assert flag("--max-batch-size") == "8" and flag("--max-tokens") == "32" and flag("--threads") == "1"
    assert flag("--max-join-tokens") == "512" and flag("--decode-graph-batches") == bench.graph_batches(8)


def test_the_served_part_writes_its_record_after_each_workload(tmp_path, monkeypatch, capsys):
    # the GPU kit's serve step kills the bench at its limit: the single stream and the client counts measured by then
    # must be in --json-out (rewritten after each workload, "complete" false until the last)
    import json

    bench = load_benchmark("bench_serve")
    out, seen = tmp_path / "serve.json", []
    spy_json_writes(monkeypatch, bench, out, seen)
    assert bench.main(["--model", "dummy:tiny-llama", "--tokenizer", "byte", "--parts", "served", "--method", "dense",
                       "--ranks", "1", "--context-tokens", "256", "--clients", "1,2", "--client-context-tokens", "64",
                       "--new-tokens", "3", "--max-batch", "4", "--json-out", str(out)]) == 0
    served = [r["served"] for r in seen]
    assert [len(s["clients"]) for s in served] == [0, 1, 2, 2]
    assert [s["complete"] for s in served] == [False, False, False, True]
    assert served[0]["one"]["tokens"] == 3 and served[0]["one"]["ttft"] > 0
    assert seen[-1] == json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert not (tmp_path / "serve.json.tmp").exists()


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_the_peer_workloads_send_ignore_eos_with_every_request_when_asked(monkeypatch, ignore_eos):
    # --ignore-eos: both servers must generate --new-tokens for every answer (the same work), so every timed request
    # carries vLLM's ignore_eos; without it, none does (a server that does not know the field would refuse it)
    bench = load_benchmark("bench_serve")
    sent = []

    def stream_chat(api, model, messages, max_tokens, extra_body=None):
        sent.append((max_tokens, extra_body))
        return dict(t0=0.0, stamps=[0.1, 0.2], end=0.3, tokens=max_tokens, text="x")

    monkeypatch.setattr(bench, "stream_chat", stream_chat)
    args = bench.parse_args(["--new-tokens", "5", "--questions", "2"] + (["--ignore-eos"] if ignore_eos else []))
    docs = {"4k": "a", "8k": "b", "needle_q": "q", "prefill": "c", "clients_alone": ["d"] * 8,
            "clients_together": ["e"] * 8}
    out = bench.peer_workloads("http://127.0.0.1:9", "m", docs, args)
    assert out["ignore_eos"] is ignore_eos and out["clients_8_together"]["tokens"] == 40
    timed = sent[1:]  # after the warm-up
    assert len(timed) == 2 + 2 + 8 + 8 + 1
    assert all(extra == ({"ignore_eos": True} if ignore_eos else None) for _, extra in timed), timed
