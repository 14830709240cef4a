"""Conversations, forks, evictions, the host tier, the disk store and restarts in a seeded random order: every
answer equals a fresh engine's (no cache). The pieces have their own tests; this one walks their interplay -- a fork
off any earlier turn, a long turn (its arena grows, and is cut when it leaves), a batch of conversations, an earlier
turn asked again, the device cache shed into host memory, a release, a budget changed under the cache, a restart
mid-way --
the way a long-running server meets them."""
from __future__ import annotations

import random

import pytest
import torch

import magnetar
from magnetar.engine.kv import KVArena
from tests.conftest import assert_close
from tests.tiny_models import save_tiny

OPS = ("new", "turn", "fork", "batch", "again", "shed", "restart", "release", "budget")
WEIGHTS = (2, 6, 4, 2, 3, 1, 1, 1, 1)
STEPS = 60
SEED = 6  # a walk that meets every path: forks, restarts, loads back from host memory and disk, arenas cut


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-random")
    save_tiny(out, "llama", max_position_embeddings=2048)
    return out


def _ids(rng: random.Random, n: int) -> torch.Tensor:
    return torch.tensor([rng.randrange(256) for _ in range(n)])


@pytest.mark.parametrize("flat", [dict(method="dense"), dict(method="ring", cp_size=2, simulate=True),
                                  dict(method="dense", decode_step="static")],
                         ids=["dense", "ring simulated", "static"])
def test_random_conversations_answer_as_a_fresh_engine(model_dir, tmp_path, flat, monkeypatch):
    rng = random.Random(SEED)
    cuts = []  # arenas cut (KVArena.trim) on the walk
    trim = KVArena.trim
    monkeypatch.setattr(KVArena, "trim", lambda self, *a: cuts.append(trim(self, *a)) or cuts[-1])
    kw = dict(timeout_s=60, context_store=str(tmp_path), host_cache_mb=8, **flat)
    engine = magnetar.init_inference(str(model_dir), **kw)
    fresh = magnetar.init_inference(str(model_dir), timeout_s=60, context_cache_mb=0, **flat)
    docs = [_ids(rng, rng.randint(90, 220)) for _ in range(2)]
    q = _ids(rng, 4)
    per_doc = engine.encode(docs[0]).nbytes
    convs: list[list[torch.Tensor]] = []  # each conversation's contexts, each a prefix of the next
    seen = dict.fromkeys(OPS, 0)
    totals: list[dict] = []  # each engine's figures at its restart

    def budget() -> None:  # bytes, below the flags' MiB for the tiny model: from under one document to thirty
        engine.cache.budget_bytes = int(per_doc * rng.choice([0.9, 2.0, 3.5, 10, 30]))
        engine.host.budget_bytes = int(per_doc * rng.choice([1.5, 4, 10]))

    def check(contexts: list, what: str) -> None:  # tokens, and the first token's logits (a tiny random model's
        got = engine.generate_batch([(c, q) for c in contexts], max_new_tokens=3, return_logits=True)  # tokens
        for c, g in zip(contexts, got):  # barely move when a key is duplicated or overwritten: its logits do)
            want = fresh.generate(c, q, max_new_tokens=3, return_logits=True)
            assert g.token_ids == want.token_ids, (what, int(c.numel()))
            assert_close(g.first_token_logits, want.first_token_logits, what="logits", msg=f"{what}, {c.numel()}")

    budget()
    for step in range(STEPS):
        op = "new" if not convs else rng.choices(OPS, WEIGHTS)[0]
        seen[op] += 1
        what = f"step {step}: {op}"
        if op == "new":
            d = rng.choice(docs)
            convs.append([d if rng.random() < 0.5 else torch.cat((d, _ids(rng, rng.randint(1, 20))))])
            check([convs[-1][-1]], what)
        elif op == "turn":  # now and then a long one: its arena grows, and is cut when it leaves
            c = rng.choice(convs)
            c.append(torch.cat((c[-1], _ids(rng, rng.randint(1, 30) if rng.random() < 0.8 else 160))))
            check([c[-1]], what)
        elif op == "fork":  # another conversation off any earlier turn of one
            base = rng.choice(rng.choice(convs))
            convs.append([base, torch.cat((base, _ids(rng, rng.randint(1, 25))))])
            check([convs[-1][-1]], what)
        elif op == "batch":
            picks = rng.sample(convs, min(len(convs), rng.randint(2, 4)))
            for c in picks:
                if rng.random() < 0.5:
                    c.append(torch.cat((c[-1], _ids(rng, rng.randint(1, 10)))))
            check([c[-1] for c in picks], what)
        elif op == "again":  # an earlier turn asked again (a regenerated answer)
            check([rng.choice(rng.choice(convs))], what)
        elif op == "shed":  # the device drops every context (as a rank out of memory does): host memory keeps them
            engine.cache.shed()
        elif op == "restart":
            engine.flush_store()
            totals.append(engine.cache_stats())
            engine = magnetar.init_inference(str(model_dir), **kw)
            budget()
        elif op == "release" and len(engine.cache):
            engine.cache.release(rng.choice(engine.cache.handles()))
        elif op == "budget":
            budget()
    # the walk met what it is for: forks, evictions, loads back from each tier, restarts
    totals.append(engine.cache_stats())
    assert seen["fork"] >= 3 and seen["restart"] >= 1 and seen["batch"] >= 2 and any(cuts), (seen, cuts)
    assert sum(t["evictions"] for t in totals) > 0, totals
    assert sum(t["host"]["loads"] for t in totals) > 0 and sum(t["store"]["loads"] for t in totals) > 0, totals
