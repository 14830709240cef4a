"""Sparse decoding: bit-packing and Hamming top-k (op == torch == brute force), the selection policies against
direct implementations, the ranking loss against Eq. 7 written out, oracle top-k with a full budget == dense
decoding (one rank and two real ranks), hash training, and the errors bad inputs get.

Reference for the engine tests: Hugging Face's own dense forward (tests/tiny_models.reference) and the same
engine without sparse decoding.
"""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch

import magnetar
from magnetar.calibrate.spotlight import TrainConfig, collect, ranking_loss, retrieval_iou, train_layer
from magnetar.config import EngineConfig, SparseConfig
from magnetar.sparse.codes import hamming_scores, hamming_topk, pack_bits
from magnetar.sparse.hashing import HashBank, model_signature, so_rotation
from magnetar.engine.strategy import decode_policy
from tests.conftest import assert_close, assert_differs
from tests.dist_utils import run_distributed
from tests.reference import dense_attention_fp64
from tests.tiny_models import reference, tiny_model

# the fused op must build here (CI has a compiler, as for the fused merge): a build failure fails these tests
OP = "op"
BACKENDS = ["torch", OP]


def _unpack(words: torch.Tensor, nbits: int) -> torch.Tensor:
    w = words.to(torch.int64) & 0xFFFFFFFF
    bits = (w[..., :, None] >> torch.arange(32)) & 1
    return bits.reshape(*words.shape[:-1], nbits).bool()


def _brute_scores(qbits, kbits):  # (H, M, G, nbits), (H, N, nbits) -> agreeing bits summed over G
    agree = (qbits[:, :, :, None, :] == kbits[:, None, None, :, :]).sum(-1)  # (H, M, G, N)
    return agree.sum(2).to(torch.int32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pack_bits_layout_and_round_trip(backend):
    bits = torch.zeros(2, 64, dtype=torch.bool)
    bits[0, 0] = True  # bit 0 -> word 0, least significant bit
    bits[1, 31] = True  # bit 31 -> the sign bit of word 0
    bits[1, 33] = True  # bit 33 -> word 1, bit 1
    words = pack_bits(bits, backend=backend)
    assert words.dtype == torch.int32 and words.tolist() == [[1, 0], [-(2**31), 2]]
    g = torch.Generator().manual_seed(0)
    rnd = torch.rand(7, 5, 96, generator=g) > 0.5
    assert torch.equal(_unpack(pack_bits(rnd, backend=backend), 96), rnd)
    assert torch.equal(pack_bits(rnd.to(torch.uint8), backend=backend), pack_bits(rnd, backend="torch"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("nbits,G", [(32, 1), (128, 3)])
def test_hamming_scores_and_topk_equal_brute_force(backend, nbits, G):
    g = torch.Generator().manual_seed(nbits + G)
    H, M, N = 2, 3, 301
    qbits, kbits = torch.rand(H, M, G, nbits, generator=g) > 0.5, torch.rand(H, N, nbits, generator=g) > 0.5
    q, k = pack_bits(qbits, backend="torch"), pack_bits(kbits, backend="torch")
    want = _brute_scores(qbits, kbits)
    assert torch.equal(hamming_scores(q, k, backend=backend), want)
    for kk in (1, 17, N):
        s, idx = hamming_topk(q, k, kk, backend=backend)
        # brute force: a stable sort by score descending keeps ties in index order
        order = torch.stack([torch.tensor(sorted(range(N), key=lambda n: (-int(want[h, m, n]), n))[:kk])
                             for h in range(H) for m in range(M)]).reshape(H, M, kk)
        assert torch.equal(idx, order), (backend, kk)
        assert torch.equal(s, want.gather(-1, order))


def test_code_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_bits(torch.ones(2, 48, dtype=torch.bool))
    q, k = pack_bits(torch.ones(1, 1, 1, 32)), pack_bits(torch.ones(1, 5, 32))
    for bad in (0, 6):
        with pytest.raises(ValueError, match=r"k must be in \[1, 5\]"):
            hamming_topk(q, k, bad)
    with pytest.raises(ValueError, match="int32"):
        hamming_scores(q.float(), k)
    with pytest.raises(ValueError, match="unknown Hamming backend"):
        hamming_scores(q, k, backend="cuda-magic")


def test_sparse_config_errors():
    with pytest.raises(ValueError, match="code_bits.*multiple of 32"):
        SparseConfig(sparse_policy="lsh", sparse_budget=8, code_bits=48)
    with pytest.raises(ValueError, match="exactly one of sparse_budget"):
        SparseConfig(sparse_policy="oracle_topk")  # budget 0 and no pruning rate
    with pytest.raises(ValueError, match="exactly one of sparse_budget"):
        SparseConfig(sparse_policy="oracle_topk", sparse_budget=8, sparse_pruning=0.9)
    with pytest.raises(ValueError, match="sparse_pruning"):
        SparseConfig(sparse_policy="quest", sparse_pruning=1.0)
    with pytest.raises(ValueError, match="hash_path.*magnetar-calibrate"):
        SparseConfig(sparse_policy="spotlight", sparse_pruning=0.9)
    with pytest.raises(ValueError, match="unknown policy"):
        EngineConfig.create(sparse_policy="magic")
    cfg = SparseConfig(sparse_policy="quest", sparse_pruning=0.98)
    assert cfg.budget(4096) == 82 and cfg.budget(100) == 20 and cfg.budget(10) == 10  # at least 20 (App. A.5)


def test_so_rotation_and_lsh_bank():
    r = so_rotation(16, torch.Generator().manual_seed(3))
    assert_close(r.T @ r, torch.eye(16), what="fp32", msg="R^T R")
    assert_close(torch.linalg.det(r), 1.0, what="fp32", msg="det R")
    model = tiny_model("llama")
    bank = HashBank("lsh", model_signature(model.config), bits=64)
    R = bank.R[0, 0]  # (D=16, 64): four independent rotations side by side
    for j in range(4):
        blk = R[:, 16 * j:16 * (j + 1)]
        assert_close(blk.T @ blk, torch.eye(16), what="fp32", msg=f"rotation {j}")


def test_ranking_loss_matches_eq7_written_out():
    g = torch.Generator().manual_seed(1)
    R, N, top, beta, alpha = 3, 12, 3, 1.5, 2.0
    draft, true = torch.randn(R, N, generator=g), torch.randn(R, N, generator=g)
    visible = torch.ones(R, N, dtype=torch.bool)
    visible[0, 8:] = False  # an early query: its last keys are in the future
    got = ranking_loss(draft, true, visible, top, beta=beta, alpha=alpha)
    terms = []
    for r in range(R):
        ranked = sorted(range(N), key=lambda n: (not visible[r, n], -float(true[r, n])))
        B, C = ranked[:top], ranked[top:]
        for i in B:
            for j in C:
                if visible[r, i] and visible[r, j]:
                    x = beta * (draft[r, i] - draft[r, j]) - alpha
                    terms.append(-math.log(1 / (1 + math.exp(-float(x)))))
    assert_close(got, sum(terms) / len(terms), what="fp32", msg="ranking loss")


def _kv(Hkv=2, N=50, D=8, seed=0):
    from magnetar.engine.kv import LayerKV

    g = torch.Generator().manual_seed(seed)
    kv = LayerKV()
    kv.freeze()
    kv.append(torch.randn(1, Hkv, N, D, generator=g), torch.randn(1, Hkv, N, D, generator=g), torch.arange(N))
    return kv


def _masked_reference(q, kv, sel, scale, q_pos):  # fp64 dense attention over each row's selection only
    Hkv, S, _ = sel.shape
    G = q.shape[1] // Hkv
    outs = []
    for s in range(S):
        o_heads = []
        for h in range(q.shape[1]):
            keys = sel[h // G, s]
            o, _ = dense_attention_fp64(q[:, h:h + 1, s:s + 1], kv.k[:, h // G:h // G + 1, keys],
                                        kv.v[:, h // G:h // G + 1, keys], q_pos=q_pos[s:s + 1], k_pos=kv.pos[keys],
                                        scale=scale)
            o_heads.append(o)
        outs.append(torch.cat(o_heads, 1))
    return torch.cat(outs, 2)


def test_oracle_and_quest_selections_match_direct_implementations():
    model = tiny_model("llama")
    kv = _kv()
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 3, 8, generator=g)  # Hq 4 over Hkv 2: groups of 2
    q_pos = torch.arange(60, 63)
    scale = 8 ** -0.5
    # oracle: top-k of the group's attention mass
    dec = decode_policy(SparseConfig(sparse_policy="oracle_topk", sparse_budget=7, dense_layers=0), model.config)
    idx, valid = dec.choose(0, q, kv, 7, scale, 50)
    assert valid is None
    for h in range(2):
        for s in range(3):
            mass = sum(torch.softmax(q[0, 2 * h + j, s] @ kv.k[0, h].T * scale, -1) for j in range(2))
            assert set(idx[h, s].tolist()) == set(mass.topk(7).indices.tolist())
    out, lse = dec.attend(0, q, kv, q_pos, 7, scale, 50)
    assert_close(out, _masked_reference(q, kv, idx, scale, q_pos), what="fp32", msg="oracle out")
    # quest: pages of 4 keys ranked by sum_d max(q_d max_d, q_d min_d), max over the group
    dec = decode_policy(SparseConfig(sparse_policy="quest", sparse_budget=10, page_size=4, dense_layers=0),
                        model.config)
    idx, valid = dec.choose(0, q, kv, 10, scale, 50)
    for h in range(2):
        for s in range(3):
            scores = []
            for p in range(13):  # 50 keys: 12 full pages and one of 2
                kp = kv.k[0, h, 4 * p:4 * p + 4]
                scores.append(max(float(torch.maximum(q[0, 2 * h + j, s] * kp.amax(0),
                                                      q[0, 2 * h + j, s] * kp.amin(0)).sum())
                                  for j in range(2)))
            best = sorted(range(13), key=lambda p: -scores[p])[:3]  # ceil(10 / 4) pages
            want = {n for p in best for n in range(4 * p, min(4 * p + 4, 50))}
            assert set(idx[h, s][valid[h, s]].tolist()) == want
    out, _ = dec.attend(0, q, kv, q_pos, 10, scale, 50)
    sel = [[idx[h, s][valid[h, s]] for s in range(3)] for h in range(2)]
    ref = torch.cat([torch.cat([dense_attention_fp64(q[:, hq:hq + 1, s:s + 1],
                                                     kv.k[:, hq // 2:hq // 2 + 1, sel[hq // 2][s]],
                                                     kv.v[:, hq // 2:hq // 2 + 1, sel[hq // 2][s]],
                                                     q_pos=q_pos[s:s + 1],
                                                     k_pos=kv.pos[sel[hq // 2][s]], scale=scale)[0]
                                for hq in range(4)], 1) for s in range(3)], 2)
    assert_close(out, ref, what="fp32", msg="quest out")


def test_lsh_sinks_and_window_are_always_selected():
    model = tiny_model("llama")
    kv = _kv(N=200, D=16)
    dec = decode_policy(SparseConfig(sparse_policy="lsh", sparse_budget=5, dense_layers=0, code_bits=64), model.config)
    assert dec.cfg.sinks == 4 and dec.cfg.window == 64  # MagicPIG-style defaults
    q = torch.randn(1, 4, 2, 16, generator=torch.Generator().manual_seed(2))
    idx, _ = dec.choose(0, q, kv, 5, 0.25, 200)
    assert idx.shape == (2, 2, 4 + 64 + 5)
    for row in idx.reshape(-1, idx.shape[-1]):
        chosen = set(row.tolist())
        assert set(range(4)) <= chosen and set(range(136, 200)) <= chosen and len(chosen) == 73


def _ids(seed, L=61, Q=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (L,), generator=g), torch.randint(0, 256, (Q,), generator=g)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_oracle_full_budget_equals_dense_decoding(arch):
    model = tiny_model(arch, seed=2, **({"num_hidden_layers": 4} if arch == "llama" else {}))
    ctx, q = _ids(7)
    ref_logits, ref_tokens = reference(model, ctx, q, 6)
    eng = magnetar.init_inference(copy.deepcopy(model), deepspeed_inference=False, sparse_policy="oracle_topk",
                                  sparse_budget=61, dense_layers=1)
    res = eng.generate(ctx, q, max_new_tokens=6, return_logits=True)
    assert_close(res.first_token_logits, ref_logits, what="logits", msg=arch)
    assert res.token_ids == ref_tokens
    # a real budget changes the answer's logits (the test can fail) but still decodes
    small = magnetar.init_inference(copy.deepcopy(model), deepspeed_inference=False, sparse_policy="oracle_topk",
                                    sparse_budget=4, dense_layers=1).generate(ctx, q, max_new_tokens=6,
                                                                              return_logits=True)
    assert_differs(small.first_token_logits, ref_logits, msg="budget 4")
    with pytest.raises(ValueError, match="exceeds the context"):
        magnetar.init_inference(copy.deepcopy(model), deepspeed_inference=False, sparse_policy="oracle_topk",
                                sparse_budget=62).generate(ctx, q, max_new_tokens=2)


def _distributed_worker(rank, world):
    model = tiny_model("qwen2", seed=4, num_hidden_layers=3)
    ctx, q = _ids(11)
    for method, extra in (("star", {}), ("ring", {})):
        base = magnetar.init_inference(copy.deepcopy(model), method=method, cp_size=world, deepspeed_inference=False,
                                       **extra).generate(ctx, q, max_new_tokens=5, return_logits=True)
        full = magnetar.init_inference(copy.deepcopy(model), method=method, cp_size=world, deepspeed_inference=False,
                                       sparse_policy="oracle_topk", sparse_budget=61, dense_layers=1, **extra
                                       ).generate(ctx, q, max_new_tokens=5, return_logits=True)
        assert_close(full.first_token_logits, base.first_token_logits, what="same_computation",
                     msg=f"rank {rank} {method}")
        assert full.token_ids == base.token_ids
        # every rank selects its share of a real budget; all ranks still agree on the tokens
        part = magnetar.init_inference(copy.deepcopy(model), method=method, cp_size=world, deepspeed_inference=False,
                                       sparse_policy="quest", sparse_pruning=0.5, page_size=4, dense_layers=1, **extra
                                       ).generate(ctx, q, max_new_tokens=5)
        assert len(part.token_ids) == 5


def test_sparse_over_distributed_kv_full_budget_equals_dense_phase2():
    run_distributed(_distributed_worker, 2)


def _tiny_training(seed=0):
    model = tiny_model("llama", seed=seed, num_hidden_layers=3)
    cfg = TrainConfig(seq_len=256, sequences=6, held_out=2, queries=32, passes=6, dense_layers=1, bits=64, hidden=32,
                      max_top=8, max_oth=64, pruning=0.9, lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    # text-like ids: a few frequent tokens, so attention has structure for the hash to learn
    seqs = [torch.multinomial(torch.linspace(1, 0.01, 256) ** 3, 256, replacement=True, generator=g) for _ in range(8)]
    return model, cfg, collect(model, seqs, cfg, progress=False)


def test_trained_hash_beats_its_random_init_on_held_out_data():
    model, cfg, data = _tiny_training()
    bank = HashBank("mlp", model_signature(model.config), bits=cfg.bits, hidden=cfg.hidden)
    before = retrieval_iou(bank, data[6:], [1, 2], cfg.pruning)
    for layer in (1, 2):
        losses = train_layer(bank, layer, data[:6], cfg)
        assert sum(losses[-6:]) / 6 < sum(losses[:6]) / 6  # the ranking loss went down
    after = retrieval_iou(bank, data[6:], [1, 2], cfg.pruning)
    assert sum(after.values()) > sum(before.values()) + 0.02, (before, after)


def test_hash_file_round_trip_and_wrong_model(tmp_path):
    model = tiny_model("llama")
    bank = HashBank("mlp", model_signature(model.config), bits=64, hidden=16, seed=3)
    bank.save(tmp_path / "h.pt")
    back = HashBank.load(tmp_path / "h.pt", model.config)
    x = torch.randn(2, 9, 16)
    assert torch.equal(back.codes(1, x), bank.codes(1, x))
    other = tiny_model("llama", num_hidden_layers=3)
    with pytest.raises(ValueError, match="made for another model.*num_hidden_layers 2 != 3"):
        HashBank.load(tmp_path / "h.pt", other.config)
    with pytest.raises(FileNotFoundError, match="magnetar-calibrate spotlight"):
        HashBank.load(tmp_path / "missing.pt")
    with pytest.raises(ValueError, match="64-bit codes but code_bits is 128"):
        magnetar.init_inference(copy.deepcopy(model), deepspeed_inference=False, sparse_policy="spotlight",
                                sparse_budget=4, hash_path=str(tmp_path / "h.pt"))
    eng = magnetar.init_inference(copy.deepcopy(model), deepspeed_inference=False, sparse_policy="spotlight",
                                  sparse_budget=8, code_bits=64, hash_path=str(tmp_path / "h.pt"))
    ctx, q = _ids(3)
    assert len(eng.generate(ctx, q, max_new_tokens=3).token_ids) == 3


def test_score_variants_share_one_phase1_and_equal_separate_scores():
    model = tiny_model("llama", seed=6, num_hidden_layers=4)
    ctx, cont = _ids(12, L=61, Q=9)
    with torch.no_grad():  # independent reference: HF's forward over context + continuation
        logits = model(torch.cat((ctx, cont))[None], use_cache=False).logits[0, 61:-1]
    ref = torch.log_softmax(logits.float(), -1).gather(1, cont[1:, None])[:, 0]
    eng = magnetar.init_inference(copy.deepcopy(model), deepspeed_inference=False)
    quest = SparseConfig(sparse_policy="quest", sparse_budget=16, page_size=4, dense_layers=1)
    dense, full, q = eng.score_variants(ctx, cont, [None, SparseConfig(sparse_policy="oracle_topk", sparse_budget=61,
                                                                         dense_layers=1), quest])
    assert_close(dense.token_logprobs, ref, what="logits", msg="dense")
    assert_close(full.token_logprobs, ref, what="logits", msg="full budget")
    alone = magnetar.init_inference(copy.deepcopy(model), deepspeed_inference=False, sparse_policy="quest",
                                    sparse_budget=16, page_size=4, dense_layers=1).score(ctx, cont)
    assert_close(q.token_logprobs, alone.token_logprobs, what="same_computation", msg="quest")
    assert_differs(q.token_logprobs, ref, msg="quest")  # 16 of 61 keys: not dense
    assert dense.phase1_seconds == q.phase1_seconds  # one Phase 1 for all variants


def test_sparse_ppl_report_and_runner_label(tmp_path):
    from magnetar.eval.experiments.sparse_ppl import write_report
    from magnetar.eval.runner import config_key, method_label

    rows = []
    for i in range(3):
        for pol, rate, nll in (("none", 0.0, 100.0), ("oracle_topk", 0.9, 101.0), ("quest", 0.9, 120.0 + i)):
            rows.append({"method": "dense", "length": 4096, "index": i, "variant_key": f"{pol}/{rate}", "policy": pol,
                         "pruning": rate, "nll_sum": nll, "tokens": 50})
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    md = write_report(tmp_path)
    assert "+2.0 % [+2.0, +2.0] vs dense" in md  # paired: 0.02 nats per token more on every window
    assert "| dense (0 % pruned) | 7.389" in md and "| quest | 11.246 [" in md and "(n=3)" in md
    assert (tmp_path / "sparse_ppl.png").stat().st_size > 1000
    # lsh keeps MagicPIG's sinks and window by default, on top of its budget; the rows say so, and a run that
    # overrides them is a separate row and a separate key (the default variant's key is unchanged)
    from magnetar.eval.experiments.sparse_ppl import _vkey, build_parser, variants

    extra = [dict(rows[0], policy="lsh", pruning=0.9, variant_key="lsh/0.9"),
             dict(rows[0], policy="lsh", pruning=0.9, variant_key="lsh/0.9/s0w0", sinks=0, window=0)]
    with open(tmp_path / "results.jsonl", "a") as f:
        f.write("\n".join(json.dumps(r) for r in extra) + "\n")
    md = write_report(tmp_path)
    assert "| lsh +4 sinks +64 window | " in md and "| lsh | " in md
    keys = {_vkey(v) for a in (["--policies", "lsh"], ["--policies", "lsh", "--sinks", "0", "--window", "0"])
            for v in variants(build_parser().parse_args(a + ["--pruning", "0.9", "--out", "x"]))}
    assert keys == {"none/0/2/", "lsh/0.9/2/", "lsh/0.9/2//s0w0"}
    cfg = EngineConfig.create(sparse_policy="spotlight", sparse_pruning=0.9, hash_path="h.pt")
    assert method_label(cfg) == "dense+spotlight(90% pruned)"
    assert config_key(cfg) != config_key(EngineConfig())
    # dense decoding keys did not change with the sparse section (float32's key: the default dtype before it became
    # "auto"; the default's key now)
    assert config_key(EngineConfig.create(dtype="float32")) == "de97319849"
    assert config_key(EngineConfig()) == "0570034af0"


class _WordTokenizer:
    """A stand-in tokenizer for the tiny models: one id per word (hash mod the vocabulary)."""

    def __call__(self, text, add_special_tokens=False):
        import zlib

        return {"input_ids": [zlib.crc32(w.encode()) % 256 for w in text.split()]}


def test_calibrate_writes_trains_and_resumes(tmp_path):
    from magnetar.calibrate.spotlight import calibrate

    model = tiny_model("llama", seed=8, num_hidden_layers=3)
    words = [f"w{i % 37}" for i in range(2000)]
    texts = [" ".join(words[i:i + 500]) for i in range(0, 2000, 500)]
    cfg = TrainConfig(seq_len=64, sequences=3, held_out=1, queries=8, passes=1, dense_layers=1, bits=32, hidden=16,
                      max_top=2, max_oth=16, pruning=0.9)
    path = tmp_path / "not" / "yet" / "h.pt"  # the folder is created (the collection is saved beside the hash)
    logs = []
    bank = calibrate(model, _WordTokenizer(), texts, path, cfg, progress=False, log=logs.append)
    assert bank.trained_layers == [1, 2] and set(bank.meta["iou_after"]) == {1, 2}
    init = bank.initial()  # the untrained bank it started from: its IoU is the recorded "before"
    held = torch.load(next(path.parent.glob("qk-cache-*.pt")), weights_only=True)["data"][cfg.sequences:]
    assert retrieval_iou(init, held, [1, 2], cfg.pruning) == pytest.approx(bank.meta["iou_before"])
    assert retrieval_iou(bank, held, [1, 2], cfg.pruning) == pytest.approx(bank.meta["iou_after"])
    # as if the run had been cut after layer 1: the rerun trains layer 2 only, from the cached collection
    cut = HashBank.load(path, model.config)
    cut.trained_layers = [1]
    cut.meta.pop("iou_after")
    cut.W1.data[2].zero_()
    cut.save(path)
    again = calibrate(model, _WordTokenizer(), texts, path, cfg, progress=False, log=logs.append)
    assert any("using the collected" in m for m in logs) and any("resuming" in m for m in logs)
    assert again.trained_layers == [1, 2]
    assert torch.equal(again.W1[1], bank.W1[1])  # layer 1 was not trained again
    assert not torch.equal(again.W1[2], torch.zeros_like(again.W1[2]))  # layer 2 was
    with pytest.raises(ValueError, match="corpus holds"):
        calibrate(model, _WordTokenizer(), [" ".join(words[:100])], tmp_path / "other.pt", cfg, progress=False)
