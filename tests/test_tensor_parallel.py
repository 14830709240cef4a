"""Tensor parallelism inside the CP group (DeepSpeed AutoTP) on 4 gloo ranks: tp 2 x cp 2 and tp 2 x cp 1 against
Hugging Face's single-process dense forward, the approximate methods and decoders at tp 2 against tp 1, the
weights each rank holds, and the refusals."""
from __future__ import annotations

import copy

import pytest
import torch

import magnetar
from magnetar.engine.tensor_parallel import weight_bytes
from tests.conftest import assert_close
from tests.dist_utils import run_distributed
from tests.tiny_models import reference, save_tiny, tiny_model

L, Q, NEW = 77, 5, 6  # context, query, generated tokens
TP_ARCHS = ("llama", "qwen3")  # 4 query / 2 KV heads (tests/tiny_models.py)


def _ids(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (L,), generator=g), torch.randint(0, 256, (Q,), generator=g)


def _engine(model, **flat):
    return magnetar.init_inference(copy.deepcopy(model), timeout_s=60, **flat)


def _generate(model, ctx, q, **flat):
    eng = _engine(model, **flat)
    return eng, eng.generate(ctx, q, max_new_tokens=NEW, return_logits=True)


def _layer_linear_bytes(model) -> int:
    """Bytes of the decoder layers' projection weights: what AutoTP splits exactly."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if ".layers." in n and n.endswith("proj.weight"))


def _exact_worker(rank, world):
    for i, arch in enumerate(TP_ARCHS):
        model = tiny_model(arch, seed=10 + i, num_hidden_layers=3)
        ctx, q = _ids(200 + i)
        ref_logits, ref_tokens = reference(model, ctx, q, NEW)
        full = weight_bytes(model)
        for cp, method in ((2, "dense"), (2, "ring"), (1, "dense"), (1, "ring")):
            if method == "dense" and cp == 2:
                method = "star"  # dense reads the whole context on one rank: cp 2 needs a CP method; one block =
                flat = dict(block_size=L)  # star is dense attention exactly
            else:
                flat = {}
            what = f"[rank {rank} {arch} tp2 x cp{cp} {method}]"
            eng, res = _generate(model, ctx, q, method=method, cp_size=cp, tp_size=2, **flat)
            assert (eng.groups.tp_size, eng.groups.cp_size, eng.groups.dp_size) == (2, cp, 2 // cp), what
            assert_close(res.first_token_logits, ref_logits, what="logits", msg=what)
            assert res.token_ids == ref_tokens, f"{what}: tokens {res.token_ids} != HF {ref_tokens}"
            # the attention saw this rank's heads only: half the KV of tp 1
            hkv, dh = model.config.num_key_value_heads, model.config.head_dim
            layers = model.config.num_hidden_layers
            kept = res.context_kv_tokens_per_rank[eng.groups.cp_rank]
            assert res.kv_bytes_per_rank[eng.groups.cp_rank] == 2 * layers * kept * (hkv // 2) * dh * 4, what
            # weights: the layers' projections exactly halved; the whole rank at most half + what stays whole
            assert _layer_linear_bytes(eng.model) * 2 == _layer_linear_bytes(model), what
            whole = full - _layer_linear_bytes(model)  # embeddings, norms, LM head (split, unevenly, or not)
            assert len(res.weight_bytes_per_rank) == 2 * cp, what
            assert res.weight_bytes_per_rank[eng.groups.cp_rank * 2 + eng.groups.tp_rank] == weight_bytes(eng.model)
            for b in res.weight_bytes_per_rank:
                assert _layer_linear_bytes(model) // 2 < b <= _layer_linear_bytes(model) // 2 + whole, (what, b)


def test_tp2_cp2_and_tp2_cp1_dense_and_ring_equal_hf():
    run_distributed(_exact_worker, 4)


def _methods_worker(rank, world):
    model = tiny_model("llama", seed=3, num_hidden_layers=3)
    ctx, q = _ids(300)
    variants = [
        ("star", dict(method="star", block_size=24)),
        ("pulsar", dict(method="pulsar", sink_size=4, chunk_size=8, summary_budget=0.3)),
        ("quest", dict(method="star", block_size=24, sparse_policy="quest", sparse_budget=24, page_size=8)),
        ("lsh", dict(method="star", block_size=24, sparse_policy="lsh", sparse_budget=16)),  # per-head hashes
        ("luka per-KV-head", dict(method="star", block_size=24, luka_mode="clustered", luka_page_size=8,
                                  luka_recent=8, luka_refine_k=2, luka_refine_scope="per_kv_head")),
    ]
    for name, flat in variants:
        _, one = _generate(model, ctx, q, cp_size=2, tp_size=1, **flat)
        eng, two = _generate(model, ctx, q, cp_size=2, tp_size=2, **flat)
        what = f"[rank {rank} {name}]"
        assert two.token_ids == one.token_ids, f"{what}: tp 2 {two.token_ids} != tp 1 {one.token_ids}"
        assert_close(two.first_token_logits, one.first_token_logits, what="logits", msg=what)
    # a policy whose choice needs every head is refused, on every rank alike
    with pytest.raises(ValueError, match="luka_refine_scope 'shared' .* each rank holds 1 of them"):
        _engine(model, method="star", cp_size=2, tp_size=2, luka_mode="clustered", luka_refine_scope="shared")
    with pytest.raises(ValueError, match="prefill_policy 'oracle' .* tp_size 1"):
        _engine(model, method="star", cp_size=2, tp_size=2, prefill_policy="oracle")


def test_star_pulsar_and_decoders_at_tp2_equal_tp1():
    run_distributed(_methods_worker, 4)


@pytest.mark.parametrize("flat,match", [
    (dict(tp_size=3), r"tp_size 3 does not divide the model's 2 KV heads \(4 query heads\).*\[1, 2\]"),
    (dict(tp_size=2, simulate=True, cp_size=2, method="star"), "simulate runs the CP ranks in this one process"),
    (dict(tp_size=2, deepspeed_inference=False), r"DeepSpeed AutoTP .*runtime.deepspeed_inference true"),
])
def test_refusals_before_any_process_group(flat, match):
    with pytest.raises(ValueError, match=match):
        magnetar.init_inference(tiny_model("llama"), **flat)


def _load_worker(rank, world, folders):
    """Loading by path under TP: each rank builds only its shard from the safetensors (an LM head tied to the
    embeddings read from the embedding) and answers like the model object does."""
    for folder, arch, tied in folders:
        model = tiny_model(arch, seed=5, num_hidden_layers=3, tie_word_embeddings=tied)
        ctx, q = _ids(400)
        ref_logits, ref_tokens = reference(model, ctx, q, NEW)
        eng = magnetar.init_inference(folder, method="star", block_size=L, cp_size=2, tp_size=2, timeout_s=60)
        res = eng.generate(ctx, q, max_new_tokens=NEW, return_logits=True)
        what = f"[rank {rank} {arch} from {folder}]"
        assert res.token_ids == ref_tokens, f"{what}: {res.token_ids} != {ref_tokens}"
        assert_close(res.first_token_logits, ref_logits, what="logits", msg=what)
        # the very parameters (and buffers) AutoTP cuts from the whole model
        cut = _engine(model, method="star", block_size=L, cp_size=2, tp_size=2).model.state_dict()
        mine = eng.model.state_dict()
        assert set(mine) == set(cut), what
        for name, t in mine.items():
            assert torch.equal(t, cut[name]), (what, name)


def test_loading_by_path_builds_only_the_rank_shard(tmp_path):
    folders = []
    for arch, tied in (("llama", True), ("qwen3", False)):
        out = tmp_path / arch
        save_tiny(out, arch, seed=5, num_hidden_layers=3, tie_word_embeddings=tied)
        folders.append((str(out), arch, tied))
    run_distributed(_load_worker, 4, folders)
