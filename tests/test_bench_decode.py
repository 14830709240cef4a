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
    assert bench.floor_bytes(model, 8, 100) - bench.floor_bytes(model, 1, 100) == 7 * 100 * per_token
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
