"""The context cache's disk tier (issue 49, item 2; magnetar.engine.store): a restarted engine answers from what an
earlier one stored -- the same tokens as encoding again, no Phase 1 --, continues a stored conversation by extending
it, and never loads a partial, corrupt or foreign file: a writer killed mid-write, a truncated or flipped file,
other weights and another CP layout each fall back to Phase 1 (the bad files removed, a foreign one left). The
store stays within its bound, least recently used out, pinned contexts kept; two real ranks agree before loading."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import magnetar
from tests.conftest import repo_pythonpath
from tests.dist_utils import run_distributed
from tests.test_encode_ask import _same
from tests.tiny_models import save_tiny

REPO = Path(__file__).resolve().parents[1]
CTX, Q = torch.arange(10, 210), torch.tensor([5, 6, 7])
MORE = torch.arange(200, 240)  # the next turn's new tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-store")
    save_tiny(out, "llama", max_position_embeddings=1024)
    return out


def _engine(model_dir, store, **kw):
    kw.setdefault("method", "dense")
    return magnetar.init_inference(str(model_dir), context_store=str(store), timeout_s=60, **kw)


def _files(store: Path) -> list[str]:
    return sorted(p.name for p in store.rglob("*") if p.is_file())


@pytest.mark.parametrize("kw", [dict(method="dense"), dict(method="star", cp_size=2, block_size=64,
                                                              simulate=True)], ids=["dense", "star-simulated"])
def test_a_restarted_engine_answers_from_the_store(model_dir, tmp_path, kw):
    first = _engine(model_dir, tmp_path, **kw)
    want = first.generate(CTX, Q, max_new_tokens=6)
    first.flush_store()
    assert want.cached_context_tokens == 0 and first.cache_stats()["store"]["writes"] == 1
    again = _engine(model_dir, tmp_path, **kw)  # a new engine: an empty memory cache
    got = again.generate(CTX, Q, max_new_tokens=6)
    assert got.token_ids == want.token_ids and got.cached_context_tokens == CTX.numel()
    assert again.cache_stats()["store"]["loads"] == 1 and again.is_cached(again.cache_key(CTX))


def test_a_stored_conversation_is_extended_after_a_restart(model_dir, tmp_path):
    first = _engine(model_dir, tmp_path)
    first.generate(CTX, Q, max_new_tokens=4)
    first.flush_store()
    longer = torch.cat((CTX, MORE))  # the next turn: the stored context plus 40 tokens
    fresh = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60, prefix_reuse="off")
    want = fresh.generate(longer, Q, max_new_tokens=6)
    again = _engine(model_dir, tmp_path)
    assert again.cached_prefix_tokens(longer) == CTX.numel()  # what a server's leader plans with
    got = again.generate(longer, Q, max_new_tokens=6)
    assert got.cached_context_tokens == CTX.numel() and got.token_ids == want.token_ids


def _stored(model_dir, store: Path) -> list[int]:
    first = _engine(model_dir, store)
    tokens = first.generate(CTX, Q, max_new_tokens=6).token_ids
    first.flush_store()
    return tokens


@pytest.mark.parametrize("fault", ["truncated", "flipped", "no-manifest"])
def test_a_damaged_file_is_never_loaded(model_dir, tmp_path, fault, caplog):
    want = _stored(model_dir, tmp_path)
    data = next(tmp_path.rglob("*.safetensors"))
    if fault == "truncated":
        with open(data, "r+b") as f:
            f.truncate(data.stat().st_size // 2)
    elif fault == "flipped":
        raw = bytearray(data.read_bytes())
        raw[-100] ^= 0xFF
        data.write_bytes(bytes(raw))
    else:  # as a writer killed between the data file and its manifest leaves it
        data.with_suffix(".json").unlink()
    with caplog.at_level(logging.WARNING, logger="magnetar.engine.store"):
        again = _engine(model_dir, tmp_path)
        got = again.generate(CTX, Q, max_new_tokens=6)
    assert got.cached_context_tokens == 0 and got.token_ids == want  # Phase 1 ran again
    assert str(data.name) in caplog.text and ("removed" in caplog.text)
    again.flush_store()  # and the context is stored anew, whole
    assert again.cache_stats()["store"]["writes"] == 1 and data.exists() and data.with_suffix(".json").exists()


def test_a_writer_killed_mid_write_leaves_nothing_loadable(model_dir, tmp_path):
    """A real process dies between renaming the data file and writing its manifest (os.replace of the manifest
    kills it): the next engine removes the data file and encodes again."""
    script = (f"import os, torch, magnetar\nimport magnetar.engine.store as s\n"
              f"real = os.replace\n"
              f"def dying(a, b):\n    if str(b).endswith('.json'): os._exit(9)\n    real(a, b)\n"
              f"s.os.replace = dying\n"
              f"e = magnetar.init_inference({str(model_dir)!r}, method='dense', context_store={str(tmp_path)!r})\n"
              f"e.generate(torch.arange(10, 210), torch.tensor([5, 6, 7]), max_new_tokens=2)\n"
              f"e.flush_store(60)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=dict(os.environ, PYTHONPATH=repo_pythonpath()),
                          capture_output=True, timeout=300)
    assert done.returncode == 9, done.stderr.decode()[-2000:]
    assert [n for n in _files(tmp_path) if n.endswith(".safetensors")] and \
        not [n for n in _files(tmp_path) if n.endswith(".json")]
    again = _engine(model_dir, tmp_path)
    assert not _files(tmp_path) and again.generate(CTX, Q, max_new_tokens=2).cached_context_tokens == 0


def test_a_live_writers_files_are_left_to_it(model_dir, tmp_path):
    """Two processes on one folder (data-parallel replicas; a restart while the old server still writes): a store
    opening it leaves a context another process is writing -- its data renamed, its manifest not yet written --
    and removes them once that writer is gone (its lock released: the kernel releases a dead process's)."""
    from magnetar.engine.store import _writing, describe

    _stored(model_dir, tmp_path)
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    held = ["feed.safetensors", "feed.safetensors.tmp-1", "feed.json.tmp-2"]
    dead = ["dead.safetensors", "dead.safetensors.tmp-3", "dead.json.tmp-4"]
    for name in dead:
        (folder / name).write_bytes(b"x")
    with _writing(folder / "feed.json.tmp-2"):  # a writer at work (this process's lock: another descriptor's)
        for name in held[:2]:
            (folder / name).write_bytes(b"x")
        (folder / ".tmpAbC").write_bytes(b"x")  # safetensors' own temporary file: whose, unknown
        problems = "\n".join(describe(tmp_path)["problems"])
        assert "feed" not in problems and "dead.safetensors: no manifest" in problems and ".tmpAbC" not in problems
        opened = _engine(model_dir, tmp_path)
        assert opened.generate(CTX, Q, max_new_tokens=2).cached_context_tokens == CTX.numel()
        left = set(_files(tmp_path))
        assert set(held) | {".tmpAbC"} <= left and not set(dead) & left
    _engine(model_dir, tmp_path)  # the writer gone: what it left is a dead writer's
    assert not {n for n in _files(tmp_path) if "feed" in n or "tmp" in n}


def test_data_parallel_replicas_keep_and_evict_only_their_own_files(model_dir, tmp_path):
    """Two replicas writing one folder (each 1/2 of the bound): a restarted replica keeps the other's files (before,
    each counted every file as its own and a restart cut the store to half), loads them, evicts only its own, and
    writes a turn over another replica's context whole (that replica may evict its parent)."""
    from magnetar.engine.context import prefix_digest
    from magnetar.engine.store import ContextStore, layout_name, weights_fingerprint

    engine = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60, prefix_reuse="all")
    handles = [engine.encode(torch.arange(10 + i, 210 + i)) for i in range(6)]
    each, fp, layout = handles[0].nbytes, weights_fingerprint(engine.model), layout_name(False, 0, 1)
    root = tmp_path / "store"

    def store(replica):
        return ContextStore(root, layout, fp, 4 * each + each // 2, replicas=2, replica=replica)  # 2 each

    def save(st, h, base=None):
        st.save(h, prefix_digest(h.context_ids, h.context_tokens), base=base)
        st.flush()

    a, b = store(0), store(1)
    for h in handles[2:4]:  # replica 1's first: the least recently used files of the folder are the other's
        save(b, h)
    for h in handles[:2]:
        save(a, h)
    names = lambda: {n.split(".")[0] for n in _files(root) if n.endswith(".json")}  # noqa: E731
    assert names() == {h.key for h in handles[:4]}
    again = store(0)  # a restart of replica 0: the folder holds both replicas' files, twice its share
    assert names() == {h.key for h in handles[:4]} and again.stats()["bytes"] == 2 * each
    assert again.stats()["contexts"] == 4 and handles[2].key in again
    got = again.load(handles[2].key, handles[2].context_ids, torch.device("cpu"))  # replica 1's file
    assert got is not None and torch.equal(got["shard"].layers[0].k, handles[2].shard.layers[0].k)
    save(again, handles[4])  # past its share: its own least recent goes, never replica 1's
    assert names() == {h.key for h in (handles[1], handles[2], handles[3], handles[4])}
    turn = engine.encode(torch.cat((handles[3].context_ids, MORE)))  # a turn over replica 1's context
    save(again, turn, base=handles[3])
    manifest = __import__("json").loads((root / layout / f"{turn.key}.json").read_text())
    assert manifest["parent"] is None and manifest["replica"] == 0  # whole: replica 1 may evict its parent
    assert names() == {h.key for h in (handles[2], handles[3], handles[4])} | {turn.key}


def test_a_replica_finds_what_another_wrote_after_it_opened_the_folder(model_dir, tmp_path, monkeypatch):
    """Replicas run side by side: a context replica 0 stores after replica 1 opened the folder is found and loaded
    by replica 1 (before, only at its restart), its prefix too; once replica 0 evicts it, replica 1 no longer
    counts it; files of other weights written meanwhile stay out of its index. A folder's mtime is read each lookup
    and the folder listed again only when it changed (or changed under a second ago: a coarse clock may hide a
    second change in the same tick)."""
    from magnetar.engine import store as store_mod
    from magnetar.engine.context import prefix_digest
    from magnetar.engine.store import ContextStore, layout_name, weights_fingerprint

    engine = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60, prefix_reuse="all")
    handles = [engine.encode(torch.arange(10 + i, 210 + i)) for i in range(3)]
    each, fp, layout = handles[0].nbytes, weights_fingerprint(engine.model), layout_name(False, 0, 1)
    root = tmp_path / "store"
    a = ContextStore(root, layout, fp, 2 * each + each // 2, replicas=2, replica=0)  # one context each
    b = ContextStore(root, layout, fp, 2 * each + each // 2, replicas=2, replica=1)
    assert handles[0].key not in b
    a.save(handles[0], prefix_digest(handles[0].context_ids, 200))
    a.flush()
    assert handles[0].key in b
    got = b.load(handles[0].key, handles[0].context_ids, torch.device("cpu"))
    assert got is not None and torch.equal(got["shard"].layers[1].v, handles[0].shard.layers[1].v)
    longer = torch.cat((handles[0].context_ids, MORE))
    assert b.longest_prefix(longer, handles[0].options, lambda n: prefix_digest(longer, n)) == 200
    foreign = ContextStore(root, layout, "other-weights", 10 * each, replicas=2, replica=0)
    foreign.save(handles[2], prefix_digest(handles[2].context_ids, 200))
    foreign.flush()
    assert handles[2].key not in b
    a.save(handles[1], prefix_digest(handles[1].context_ids, 200))  # past replica 0's share: handles[0] goes
    a.flush()
    assert handles[0].key not in b and handles[1].key in b and b.stats()["bytes"] == 0
    lists = []
    real = store_mod.os.scandir
    monkeypatch.setattr(store_mod.os, "scandir", lambda d: lists.append(d) or real(d))
    stamp = b.dir.stat().st_mtime_ns
    os.utime(b.dir, ns=(stamp - 5 * 10**9, stamp - 5 * 10**9))  # a settled folder: unchanged since, not listed again
    assert handles[1].key in b and len(lists) == 1
    assert handles[1].key in b and handles[0].key not in b and len(lists) == 1
    now = time.time_ns()  # a change in the same tick of the clock as the last lookup: the mtime looks unchanged
    os.utime(b.dir, ns=(now, now))
    assert handles[0].key not in b and len(lists) == 2
    a.save(handles[0], prefix_digest(handles[0].context_ids, 200))
    a.flush()
    os.utime(b.dir, ns=(now, now))
    assert handles[0].key in b and handles[1].key not in b
    for st in (a, b, foreign):
        st.close()


def _pinned_by_replica_1(model_dir, root):
    """Two replicas' stores over ``root`` (two contexts' share each): replica 0 writes a context, replica 1 (which
    loaded it from the folder) pins it, and replica 0 writes three more past its share -- its least recent unpinned
    files go, the pinned one stays. Returns (handles, store 0, store 1, layout, save on replica 0)."""
    from magnetar.engine.context import prefix_digest
    from magnetar.engine.store import ContextStore, layout_name, weights_fingerprint

    engine = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60)
    handles = [engine.encode(torch.arange(10 + i, 210 + i)) for i in range(4)]
    each, fp, layout = handles[0].nbytes, weights_fingerprint(engine.model), layout_name(False, 0, 1)
    a = ContextStore(root, layout, fp, 4 * each + each // 2, replicas=2, replica=0)  # two contexts each
    b = ContextStore(root, layout, fp, 4 * each + each // 2, replicas=2, replica=1)

    def save(h):
        a.save(h, prefix_digest(h.context_ids, 200))
        a.flush()

    save(handles[0])
    assert handles[0].key in b
    b.pin(handles[0].key)
    for h in handles[1:4]:  # past replica 0's share three times: its least recent unpinned files go
        save(h)
    names = {p.stem for p in (root / layout).glob("*.json")}
    assert handles[0].key in names and names >= {handles[3].key} and handles[1].key not in names
    return handles, a, b, layout, save


def test_a_context_one_replica_pinned_is_not_evicted_by_the_replica_that_wrote_it(model_dir, tmp_path):
    """Replica 1 pins a context replica 0 wrote (it loaded it from the folder): replica 0 keeps its file while the pin
    holds -- past its share it evicts its other files -- and may evict it once unpinned (before, a pin held only
    the pinning replica's own files). The pins live in pinned-r<replica>.pins beside the files."""
    from magnetar.engine.store import describe

    root = tmp_path / "store"
    handles, a, b, layout, save = _pinned_by_replica_1(model_dir, root)
    assert describe(root)["pinned"] == {f"{layout}/pinned-r1.pins": 1}
    b.unpin(handles[0].key)
    save(handles[1])  # now the least recent, unpinned: evicted
    assert handles[0].key not in {p.stem for p in (root / layout).glob("*.json")}
    for st in (a, b):
        st.close()


def test_a_retired_replicas_pins_are_removed_by_the_store_command(model_dir, tmp_path, capsys):
    """Replica 1 pinned a context and is no longer run: its pinned-r1.pins stays and replica 0 keeps the file until
    ``magnetar store DIR --unpin-replica 1`` removes the list; asked again, the command names the flag and says no
    replica has one."""
    from magnetar.launch.store import main

    root = tmp_path / "store"
    handles, a, b, layout, save = _pinned_by_replica_1(model_dir, root)
    b.close()  # replica 1 stops; its pins stay
    save(handles[1])
    assert handles[0].key in {p.stem for p in (root / layout).glob("*.json")}
    capsys.readouterr()
    assert main([str(root), "--unpin-replica", "1"]) == 0
    assert f"removed {layout}/pinned-r1.pins" in capsys.readouterr().out
    save(handles[2])  # the least recent, no longer pinned: evicted
    assert handles[0].key not in {p.stem for p in (root / layout).glob("*.json")}
    with pytest.raises(SystemExit):
        main([str(root), "--unpin-replica", "1"])
    assert "--unpin-replica 1: " in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(root), "--unpin-replica", "-1"])
    assert "--unpin-replica: give a replica index >= 0" in capsys.readouterr().err
    a.close()


def test_other_weights_or_layout_are_not_loaded(model_dir, tmp_path, tmp_path_factory):
    _stored(model_dir, tmp_path)
    other = tmp_path_factory.mktemp("tiny-other")
    save_tiny(other, "llama", seed=1, max_position_embeddings=1024)
    foreign = _engine(other, tmp_path)  # the same shapes and options, other weights: another fingerprint
    assert not foreign.is_cached(foreign.cache_key(CTX))
    assert foreign.generate(CTX, Q, max_new_tokens=2).cached_context_tokens == 0
    layout = _engine(model_dir, tmp_path, method="ring", cp_size=2, simulate=True)  # another CP layout
    assert layout.generate(CTX, Q, max_new_tokens=2).cached_context_tokens == 0
    foreign.flush_store()
    layout.flush_store()
    assert len([n for n in _files(tmp_path) if n.endswith(".json")]) == 2  # the first is replaced by the foreign
    # engine's own copy (same key), the simulated layout has its own folder


def test_the_store_stays_within_its_bound_and_keeps_pinned_contexts(model_dir, tmp_path):
    engine = _engine(model_dir, tmp_path, context_store_mb=1)
    one = engine.encode(CTX)
    each = one.nbytes
    engine.pin(one)
    for i in range(1, 14):  # 14 contexts of 100 KiB each: past the 1 MiB bound
        engine.encode(torch.arange(10 + i, 210 + i))
    engine.flush_store()
    stats = engine.cache_stats()["store"]
    assert stats["bytes"] <= 2**20 and stats["evictions"] >= 1 and stats["contexts"] == stats["bytes"] // each
    assert engine.is_cached(one.key)  # pinned: kept while newer ones went
    engine.unpin(one)


def _folder_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def test_the_bound_covers_the_whole_folder(model_dir, tmp_path, caplog):
    """runtime.context_store_mb bounds the folder, other layouts' files included (named in the log when they take
    over half of it); a simulated layout's context counts every rank's KV (its one file holds them all)."""
    other = tmp_path / "cp0of8-tp0of1"  # another layout's contexts, left by an earlier run
    other.mkdir()
    (other / "old.safetensors").write_bytes(bytes(600 * 1024))
    with caplog.at_level(logging.WARNING, logger="magnetar.engine.store"):
        engine = _engine(model_dir, tmp_path, method="star", cp_size=2, block_size=64, simulate=True,
                         context_store_mb=1)
    assert str(other) in caplog.text and "--context-store-mb" in caplog.text
    assert engine.cache_stats()["store"]["budget_bytes"] == 2**20 - 600 * 1024
    one = engine.encode(CTX)
    assert one.nbytes == one.shard.nbytes() > max(s.kv_bytes for s in one.stats)  # both ranks', held by one process
    for i in range(1, 8):
        engine.encode(torch.arange(10 + i, 210 + i))
        engine.flush_store()
        # the KV within the bound at every step; the files' other tensors (positions, ids, logits) and manifests
        # add a few percent on this tiny model (under 1 % on real ones)
        assert _folder_bytes(tmp_path) <= 1.1 * 2**20
    stats = engine.cache_stats()["store"]
    assert stats["evictions"] >= 1 and stats["bytes"] + 600 * 1024 <= 2**20
    assert (other / "old.safetensors").exists()  # never removed: another engine's


def test_a_write_that_does_not_fit_is_skipped_and_leaves_nothing(model_dir, tmp_path, monkeypatch, caplog):
    """Pinned contexts filling the budget, a disk near full, a write failing half-way: the context is not stored,
    nothing is evicted for it, no partial file stays; a low disk is said once."""
    import shutil

    import safetensors.torch

    engine = _engine(model_dir, tmp_path, context_store_mb=1)
    pinned = [engine.encode(torch.arange(10 + i, 210 + i)) for i in range(10)]  # 100 KiB each: the whole budget
    for h in pinned:
        engine.pin(h)
    engine.flush_store()
    files = _files(tmp_path)
    for i in range(10, 13):  # past the bound with every stored context pinned
        engine.encode(torch.arange(10 + i, 210 + i))
    engine.flush_store()
    stats = engine.cache_stats()["store"]
    assert stats["evictions"] == 0 and stats["bytes"] <= 2**20 and stats["skipped"] >= 1
    assert all(engine.is_cached(h.key) for h in pinned) and set(files) <= set(_files(tmp_path))
    for h in pinned:
        engine.unpin(h)
    engine.flush_store()
    before = _files(tmp_path)
    free = shutil.disk_usage(tmp_path)
    monkeypatch.setattr("magnetar.engine.store.shutil.disk_usage", lambda p: free._replace(free=100 << 20))
    with caplog.at_level(logging.WARNING, logger="magnetar.engine.store"):
        for i in range(20, 23):
            engine.encode(torch.arange(10 + i, 210 + i))
        engine.flush_store()
    assert caplog.text.count("MiB free") == 1 and _files(tmp_path) == before
    monkeypatch.undo()

    def failing(tensors, path, metadata=None):
        Path(path).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", failing)
    engine.encode(torch.arange(50, 250).flip(0))
    engine.flush_store()
    assert not [n for n in _files(tmp_path) if ".tmp-" in n] and set(_files(tmp_path)) <= set(before)


def _two_ranks(rank, world, model_dir, store):
    flat = dict(method="star", cp_size=2, block_size=64, timeout_s=60, context_store=store)
    first = magnetar.init_inference(model_dir, **flat)
    assert first.cache_stats()["store"]["budget_bytes"] == 10240 * 2**20 // 2  # each rank half the folder's bound
    want = first.generate(CTX, Q, max_new_tokens=5)
    first.flush_store()
    torch.distributed.barrier()
    again = magnetar.init_inference(model_dir, **flat)
    got = again.generate(CTX, Q, max_new_tokens=5)
    assert got.token_ids == want.token_ids and got.cached_context_tokens == CTX.numel(), rank
    again.flush_store()
    torch.distributed.barrier()
    if rank == 1:  # one rank lost its file: the ranks agree to encode again, none loads
        for p in Path(store).glob("cp1of2*/*.json"):
            p.unlink()
    torch.distributed.barrier()
    third = magnetar.init_inference(model_dir, **flat)
    got = third.generate(CTX, Q, max_new_tokens=5)
    assert got.token_ids == want.token_ids and got.cached_context_tokens == 0, rank


def test_two_ranks_agree_before_loading(model_dir, tmp_path):
    run_distributed(_two_ranks, 2, str(model_dir), str(tmp_path))


def test_a_restarted_server_answers_from_the_store(tmp_path, tmp_path_factory):
    """A server started again on the same --context-store answers a pasted document's question and a pinned
    context's (pinned again under its id) from the stored KV: the same answers, every context token cached."""
    openai = pytest.importorskip("openai", reason="the test extra: pip install 'magnetar[test]'")
    httpx = pytest.importorskip("httpx")
    from magnetar.serve.server import Server
    from tests.dist_utils import free_port, serve_in_thread
    from tests.tiny_models import save_tiny_chat

    model_dir = save_tiny_chat(tmp_path_factory.mktemp("tiny-store-chat"), 2048)
    doc = "\n".join(f"Line {i}: the ledger keeps record {i * 7}." for i in range(16))

    def ask(url: str) -> tuple:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        pinned = client.chat.completions.create(model="tiny", max_tokens=6, messages=[
            {"role": "user", "content": "Which record?"}], extra_body={"magnetar": {"context_id": cid}})
        pasted = client.chat.completions.create(model="tiny", max_tokens=6, messages=[
            {"role": "user", "content": doc + "\n\nWhich record is on line 3?"}])
        return pinned, pasted

    def server() -> Server:
        engine = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60,
                                         context_store=str(tmp_path))
        return Server(engine, model_name="tiny", port=free_port(), max_tokens=8, paste_threshold=64)

    with serve_in_thread(server()) as s:
        made = httpx.post(s.url + "/v1/contexts", json={"model": "tiny", "context": doc + " (pinned)"}, timeout=60)
        cid, tokens = made.json()["id"], made.json()["tokens"]
        before = ask(s.url)
    assert (tmp_path / "pinned-dp0.json").exists()  # the drain wrote the pinned list and flushed the KV
    with serve_in_thread(server()) as s:
        for _ in range(100):  # the pinned context is pinned again just after the server starts
            if httpx.get(s.url + "/metrics", timeout=10).text.count("magnetar_pinned_contexts 1.0"):
                break
            time.sleep(0.1)
        after = ask(s.url)
        metrics = httpx.get(s.url + "/metrics", timeout=10).text
    for b, a in zip(before, after):
        assert a.choices[0].message.content == b.choices[0].message.content
    assert after[0].usage.prompt_tokens_details.cached_tokens == tokens
    assert after[1].usage.prompt_tokens_details.cached_tokens == before[1].model_extra["magnetar"]["prompts"][0][
        "context_tokens"] > 0
    assert "magnetar_context_store_loads_total 2.0" in metrics, metrics


def test_conversations_about_a_pasted_document_share_it_after_a_restart(tmp_path, tmp_path_factory):
    """Three conversations about one document pasted into the chat (the openai client), two turns each, then a
    restart on the same --context-store: each conversation's next turn loads its context from the disk with the same
    answer, and the restarted server holds the document once (the conversations' turns written after it or sharing
    it), as the first did. Before, each conversation came back holding the document whole: three copies."""
    openai = pytest.importorskip("openai", reason="the test extra: pip install 'magnetar[test]'")
    from magnetar.serve.server import Server
    from tests.dist_utils import free_port, serve_in_thread
    from tests.tiny_models import save_tiny_chat

    model_dir = save_tiny_chat(tmp_path_factory.mktemp("tiny-store-chat"), 2048)
    doc = "\n".join(f"Line {i}: the ledger keeps record {i * 7} for the harbour office." for i in range(20))

    def server() -> Server:
        engine = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60, context_store=str(tmp_path))
        return Server(engine, model_name="tiny", port=free_port(), max_tokens=8, paste_threshold=64)

    def turn(url: str, messages: list):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        return client.chat.completions.create(model="tiny", max_tokens=4, temperature=0, messages=messages)

    convs = [[{"role": "user", "content": f"{doc}\n\nWhich record is on line {c}?"}] for c in range(3)]
    with serve_in_thread(server()) as s:
        for t in range(2):
            for messages in convs:
                answer = turn(s.url, messages).choices[0].message.content
                messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"And line {t}?"}]
        want = [turn(s.url, m).choices[0].message.content for m in convs]
        held = s.engine.cache.nbytes
    with serve_in_thread(server()) as s:
        for messages, answer in zip(convs, want):
            got = turn(s.url, messages)
            assert got.choices[0].message.content == answer
            assert got.usage.prompt_tokens_details.cached_tokens > 0.9 * got.usage.prompt_tokens
        assert s.engine.cache.nbytes < 1.2 * held  # the document once, as before the restart (before: ~3x)
        assert s.engine.cache_stats()["store"]["loads"] > 3  # the document, then each conversation's turns


def test_the_host_tier_keeps_what_the_cache_evicts(model_dir, tmp_path):
    """runtime.host_cache_mb: a context the device cache evicts is kept in host memory and comes back from there
    (no Phase 1, the same answer), before the disk tier is asked; a longer context extends it from there too."""
    engine = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60, context_cache_mb=1, host_cache_mb=8,
                                     context_store=str(tmp_path))
    want = engine.generate(CTX, Q, max_new_tokens=5)
    for i in range(1, 14):  # 100 KiB each: the 1 MiB cache evicts the first
        engine.encode(torch.arange(10 + i, 210 + i))
    assert engine.cache.get(engine.cache_key(CTX)) is None and engine.is_cached(engine.cache_key(CTX))
    got = engine.generate(CTX, Q, max_new_tokens=5)
    stats = engine.cache_stats()
    assert got.token_ids == want.token_ids and got.cached_context_tokens == CTX.numel()
    assert stats["host"]["loads"] == 1 and stats["store"]["loads"] == 0 and stats["host"]["writes"] >= 1
    for i in range(1, 14):  # evict it again, then ask for the context that starts with it
        engine.encode(torch.arange(40 + i, 240 + i))
    longer = torch.cat((CTX, MORE))
    assert engine.generate(longer, Q, max_new_tokens=2).cached_context_tokens == CTX.numel()
    assert engine.cache_stats()["host"]["loads"] == 2


@pytest.mark.parametrize("kw", [dict(method="dense"), dict(method="ring", cp_size=2, simulate=True)],
                         ids=["dense", "ring-simulated"])
def test_the_host_tier_keeps_a_conversations_turns_as_one_copy(model_dir, tmp_path, kw):
    """The turns of a conversation the device cache evicts share one host copy -- the longest's, which the shorter
    ones view --, counted once; each comes back from there with the answer a fresh engine gives."""
    engine = magnetar.init_inference(str(model_dir), timeout_s=60, context_cache_mb=1, host_cache_mb=8, **kw)
    turns = _turns(engine, n=4)  # 200 tokens, then 4 x 40: 100-180 KiB each, in one arena on the device
    engine.encode(turns[0][0])  # the first turn used last: it leaves the device after the longest
    arena = engine.cache.get(engine.cache_key(turns[-1][0])).shard.arena  # (held: it outlives its turns here)
    for i in range(1, 14):  # others: the conversation leaves the 1 MiB cache for the host tier
        engine.encode(torch.arange(10 + i, 210 + i))
    keys = [engine.cache_key(ctx) for ctx, _ in turns]
    assert not any(engine.cache.get(k) for k in keys) and all(engine.is_cached(k) for k in keys)
    kept = {h.key: h for h in engine.host.handles()}
    held = [kept[k] for k in keys]
    others = sum(h.nbytes for k, h in kept.items() if k not in keys)  # the contexts evicted after it
    assert engine.cache_stats()["host"]["bytes"] == held[-1].nbytes + others  # the longest turn's, not their sum
    assert len({h.shard.layers[0].k.untyped_storage().data_ptr() for h in held}) == 1  # one copy, viewed
    fresh = magnetar.init_inference(str(model_dir), timeout_s=60, prefix_reuse="off", **kw)
    for ctx, _ in reversed(turns):  # each comes back (no Phase 1) with a fresh engine's answer
        got = engine.generate(ctx, Q, max_new_tokens=4)
        assert got.cached_context_tokens == ctx.numel()
        assert got.token_ids == fresh.generate(ctx, Q, max_new_tokens=4).token_ids
    assert engine.cache_stats()["host"]["loads"] == len(turns)
    # every turn left the tier: its copy is freed with the last one (the arena lives on, on the device)
    assert engine.host._chains[arena].layers == []


def _ids(start: int, n: int) -> torch.Tensor:
    """``n`` token ids within the tiny model's vocabulary (256), another run for each ``start``."""
    return (torch.arange(start, start + n) * 7) % 250 + 3


def _turns(engine, n: int = 3, step: int = 40) -> list:
    """A conversation over CTX: each turn's context the last one's plus ``step`` new tokens; (context, result)."""
    ctx, out = CTX, []
    for t in range(n + 1):
        if t:
            ctx = torch.cat((ctx, _ids(300 + step * t, step)))
        out.append((ctx, engine.generate(ctx, Q, max_new_tokens=4)))
    engine.flush_store()
    return out


def _manifests(store: Path) -> dict:
    import json

    return {p.stem: json.loads(p.read_text()) for p in store.rglob("*.json") if p.parent != store}


@pytest.mark.parametrize("kw", [dict(method="dense"), dict(method="ring", cp_size=2, simulate=True)],
                         ids=["dense", "ring-simulated"])
def test_a_conversations_turns_are_stored_as_what_each_adds(model_dir, tmp_path, kw):
    """Each turn's file holds only the KV its new tokens add, its manifest naming the turn before as its parent; the
    budget counts each file so; a restarted engine loads the chain -- the same answer as encoding anew --, and a
    fork off an earlier turn loads that turn's chain and extends it."""
    first = _engine(model_dir, tmp_path, **kw)
    turns = _turns(first)
    keys = [first.cache_key(ctx) for ctx, _ in turns]
    m = _manifests(tmp_path)
    assert [m[k]["parent"] for k in keys] == [None, *keys[:-1]]
    size = {k: (tmp_path / next(tmp_path.iterdir()).name / f"{k}.safetensors").stat().st_size for k in keys}
    assert all(size[k] < 0.35 * size[keys[0]] for k in keys[1:])  # 40 new tokens' KV against 200
    last = first.encoder.cache.get(keys[-1])
    assert first.cache_stats()["store"]["bytes"] == sum(m[k]["nbytes"] for k in keys) == last.nbytes
    again = _engine(model_dir, tmp_path, **kw)
    got = again.generate(turns[-1][0], Q, max_new_tokens=4)
    assert got.token_ids == turns[-1][1].token_ids and got.cached_context_tokens == turns[-1][0].numel()
    # each file read once, each turn written after the one before: the turns are cached again, in one arena
    assert again.cache_stats()["store"]["loads"] == len(keys)
    loaded = [again.encoder.cache.peek(k) for k in keys]
    assert all(h is not None for h in loaded) and len({id(h.shard.arena) for h in loaded}) == 1
    assert again.cache_stats()["bytes"] == loaded[0].shard.arena.charged
    fork = torch.cat((turns[1][0], _ids(900, 30)))  # another reply to the first turn
    fresh = magnetar.init_inference(str(model_dir), timeout_s=60, prefix_reuse="off", **kw)
    third = _engine(model_dir, tmp_path, **kw)
    got = third.generate(fork, Q, max_new_tokens=4)
    assert got.cached_context_tokens == turns[1][0].numel() and got.token_ids == \
        fresh.generate(fork, Q, max_new_tokens=4).token_ids


@pytest.mark.parametrize("kw", [dict(method="dense"), dict(method="ring", cp_size=2, simulate=True)],
                         ids=["dense", "ring-simulated"])
def test_a_fork_is_stored_as_what_it_adds_and_comes_back_from_either_tier(model_dir, tmp_path, kw):
    """A second conversation off a document (a fork: the document's KV shared, not copied) is written as the KV its
    own tokens add, its manifest naming the document as its parent; a restarted engine loads it, and an engine whose
    device cache evicted it gets it back from host memory -- each with a fresh engine's answer."""
    first = _engine(model_dir, tmp_path, **kw)
    first.generate(CTX, Q, max_new_tokens=2)
    first.generate(torch.cat((CTX, _ids(300, 40))), Q, max_new_tokens=2)  # extends the document in place
    fork = torch.cat((CTX, _ids(500, 30)))
    want = first.generate(fork, Q, max_new_tokens=4)
    assert first.encoder.cache.get(first.cache_key(fork)).shard.head is not None
    first.flush_store()
    doc, key = first.cache_key(CTX), first.cache_key(fork)
    m = _manifests(tmp_path)
    assert m[key]["parent"] == doc and m[key]["parent_kv"] == m[doc]["kv"]
    size = {k: next(tmp_path.rglob(f"{k}.safetensors")).stat().st_size for k in (doc, key)}
    assert size[key] < 0.3 * size[doc]  # 30 tokens' KV against 200
    fresh = magnetar.init_inference(str(model_dir), timeout_s=60, prefix_reuse="off", **kw)
    assert want.token_ids == fresh.generate(fork, Q, max_new_tokens=4).token_ids
    again = _engine(model_dir, tmp_path, **kw)
    got = again.generate(fork, Q, max_new_tokens=4)
    assert got.token_ids == want.token_ids and got.cached_context_tokens == fork.numel()
    host = magnetar.init_inference(str(model_dir), timeout_s=60, context_cache_mb=1, host_cache_mb=8, **kw)
    host.generate(CTX, Q, max_new_tokens=2)
    host.generate(torch.cat((CTX, _ids(300, 40))), Q, max_new_tokens=2)
    host.generate(fork, Q, max_new_tokens=2)
    for i in range(1, 14):  # the 1 MiB cache evicts the fork (and the document) to host memory
        host.encode(torch.arange(10 + i, 210 + i))
    assert host.cache.get(key) is None and key in host.host
    got = host.generate(fork, Q, max_new_tokens=4)
    assert got.token_ids == want.token_ids and got.cached_context_tokens == fork.numel()
    assert host.cache_stats()["host"]["loads"] >= 1


def _conversations(engine, convs: int = 4, turns: int = 2) -> list:
    """``convs`` conversations over CTX, ``turns`` turns each (the first extends the document in place, the others
    fork off it); the last turns' (context, result)."""
    engine.encode(CTX)
    last = []
    for c in range(convs):
        ctx = CTX
        for t in range(turns):
            ctx = torch.cat((ctx, _ids(400 + 50 * c + 20 * t, 12 + 3 * t)))
            out = engine.generate(ctx, Q, max_new_tokens=4, return_logits=True)
        last.append((ctx, out))
    return last


def _doc_held_once(engine, convs: list) -> None:
    """Every conversation's KV holds the cached document's (its own arena's first entries, or its head) -- one
    copy -- and the cache counts each arena once."""
    doc = engine.encoder.cache.peek(engine.cache_key(CTX))
    handles = [engine.encoder.cache.peek(engine.cache_key(ctx)) for ctx, _ in convs]
    assert doc is not None and all(h is not None for h in handles)
    assert all(h.shard.head is doc.shard or h.shard.arena is doc.shard.arena for h in handles)
    arenas = {id(a): a for h in [doc, *handles] for a in h.shard.arenas()}
    assert engine.cache_stats()["bytes"] == sum(a.charged for a in arenas.values()) < 2 * doc.shard.arena.charged


@pytest.mark.parametrize("kw", [dict(method="dense"), dict(method="ring", cp_size=2, simulate=True)],
                         ids=["dense", "ring-simulated"])
def test_conversations_loaded_back_share_their_document_again(model_dir, tmp_path, kw):
    """Four conversations forking from one document, loaded back -- after a restart from the disk, after the device
    cache shed them into host memory -- each rejoin the document the cache holds (the first conversation's turns
    written after it, the others sharing it as their head) rather than holding a copy each; every answer equals the
    first engine's. Before, each loaded conversation held the document whole: four copies."""
    first = _engine(model_dir, tmp_path, **kw)
    convs = _conversations(first)
    first.flush_store()
    _doc_held_once(first, convs)
    again = _engine(model_dir, tmp_path, **kw)  # a restart: the conversations on disk only
    for ctx, want in convs[::-1]:  # a fork first: the document is loaded on its way
        got = again.generate(ctx, Q, max_new_tokens=4, return_logits=True)
        _same(got, want, "after a restart")
        assert got.cached_context_tokens == ctx.numel()
    _doc_held_once(again, convs)
    assert again.cache_stats()["store"]["loads"] == 1 + 4 * 2  # each file once: the document, every turn
    host = magnetar.init_inference(str(model_dir), timeout_s=60, host_cache_mb=64, **kw)
    convs = _conversations(host)
    doc_bytes = host.encoder.cache.peek(host.cache_key(CTX)).nbytes
    host.cache.shed()  # the device drops every context: host memory keeps them -- a fork's own entries alone
    assert len(host.cache) == 0 and host.cache_stats()["host"]["contexts"] == 9
    assert host.cache_stats()["host"]["bytes"] < 2 * doc_bytes  # before: a copy of the document per fork (4.5x)
    for ctx, want in convs:
        got = host.generate(ctx, Q, max_new_tokens=4, return_logits=True)
        _same(got, want, "after a shed")
        assert got.cached_context_tokens == ctx.numel()
    _doc_held_once(host, convs)


def test_a_forks_own_entries_in_host_memory_wait_for_its_document(model_dir):
    """A fork's host copy holds its own entries alone: it does not load whole. With its document gone from every tier
    it stays where it is, and the fork is encoded again (a fresh engine's answer); with the document back in the
    cache, it loads after it."""
    engine = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60, host_cache_mb=64)
    convs = _conversations(engine, convs=2, turns=1)  # the document, its first conversation in place, a fork
    fork, key = convs[1][0], engine.cache_key(convs[1][0])
    engine.cache.shed()
    tier = engine.encoder.host
    assert tier.load(key, None, "cpu") is None and key in tier  # not whole, and still there
    later = torch.cat((fork, _ids(500, 8)))  # the fork's next turn: the fork is its prefix
    assert engine.is_cached(key) and engine.encoder.held_tokens(fork, key) == fork.numel()
    assert engine.encoder.tier_prefix_tokens(later) == fork.numel()
    tier.load(engine.cache_key(CTX), None, "cpu")  # the document leaves host memory (as if evicted from it)
    # what the server's scheduler and the admission plan with: the fork no longer comes back (a Phase 1, chunked
    # where it is long; its memory counted), nor is it a prefix of its next turn
    assert not engine.is_cached(key) and engine.encoder.held_tokens(fork, key) == 0
    assert engine.encoder.tier_prefix_tokens(later) == 0
    fresh = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60, context_cache_mb=0)
    got = engine.generate(fork, Q, max_new_tokens=4, return_logits=True)
    _same(got, fresh.generate(fork, Q, max_new_tokens=4, return_logits=True), "the fork encoded again")
    assert got.cached_context_tokens == 0 and key in tier
    engine.cache.shed()  # the document is saved again (the fork's new context, whole, too)
    engine.cache.release(engine.cache_key(fork))
    engine.encode(CTX)  # the document back in the cache, from host memory
    assert engine.is_cached(key) and engine.encoder.tier_prefix_tokens(later) == fork.numel()
    assert engine.generate(fork, Q, max_new_tokens=4).cached_context_tokens == fork.numel()


def test_host_memory_keeps_a_document_while_forks_there_load_after_it(model_dir):
    """In host memory the document is the least recently used -- yet when the tier must evict, the forks' own entries
    there go before it (they load only after it), and a fork still kept comes back after it."""
    engine = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60, host_cache_mb=64)
    convs = _conversations(engine, convs=3, turns=1)  # the document, a conversation in place, two forks
    engine.cache.shed()
    tier = engine.encoder.host
    doc = engine.cache_key(CTX)
    tier._items.move_to_end(doc, last=False)  # the least recently used there (as when it was evicted first)
    tier.budget_bytes = tier.stats()["bytes"] - 1  # one context must go
    engine.cache.budget_bytes = 0
    assert doc in tier and tier.stats()["evictions"] == 0
    tier.save(engine.encode(torch.arange(100, 104)), "x")  # a small context comes in: a fork's part goes
    assert doc in tier and tier.stats()["evictions"] >= 1
    engine.cache.budget_bytes = 10 ** 9
    kept = [ctx for ctx, _ in convs[1:] if engine.cache_key(ctx) in tier]
    assert kept, "a fork is still in host memory"
    got = engine.generate(kept[0], Q, max_new_tokens=4)
    assert got.cached_context_tokens == kept[0].numel()


def test_host_memory_evicts_a_conversations_turns_together(model_dir):
    """A conversation's turns share one host copy, so one of them alone frees nothing: the tier evicts them together,
    as recent as the last used of them. A context kept between them goes first; the turns keep their copy."""
    engine = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60, host_cache_mb=64)
    turns = [ctx for ctx, _ in _turns(engine, n=3)]  # one arena on the device
    other = torch.arange(20, 220)
    engine.encode(other)
    tier = engine.host
    handles = {k: engine.cache.peek(k) for k in map(engine.cache_key, [*turns, other])}
    for key in [*handles][:3] + [engine.cache_key(other), engine.cache_key(turns[3])]:  # the longest last
        tier.save(handles[key], "x")
    copy = tier.stats()["bytes"] - handles[engine.cache_key(other)].nbytes
    assert copy == handles[engine.cache_key(turns[3])].nbytes  # one copy for the four turns
    tier.budget_bytes = tier.stats()["bytes"] - 1
    small = engine.encode(torch.arange(100, 104))
    tier.save(small, "y")  # room for it: the other context goes, not the conversation's first turns
    assert engine.cache_key(other) not in tier and all(k in tier for k in handles if k != engine.cache_key(other))
    assert tier.stats()["evictions"] == 1 and tier.stats()["bytes"] == copy + small.nbytes
    tier.budget_bytes = 2 * small.nbytes  # the conversation must go: its four turns at once, the copy freed
    tier.save(engine.encode(torch.arange(110, 114)), "z")
    assert not any(k in tier for k in handles) and tier.stats()["evictions"] == 5


def test_a_parent_goes_only_after_the_files_that_continue_it(model_dir, tmp_path):
    """The bound evicts the least recently used file that no other continues; the parent of the file being written
    stays even when it is the least recently used."""
    engine = _engine(model_dir, tmp_path, context_store_mb=1)  # 1024 KiB; a 200-token context holds 100 KiB
    engine.encode(CTX)
    for i in range(1, 10):
        engine.encode(torch.arange(10 + i, 210 + i))  # 1000 KiB stored, CTX the least recently used
    turn = torch.cat((CTX, _ids(300, 100)))  # 50 KiB more: a file must go
    engine.encode(turn)
    engine.flush_store()
    stored = _manifests(tmp_path)
    assert engine.cache_key(CTX) in stored and stored[engine.cache_key(turn)]["parent"] == engine.cache_key(CTX)
    assert engine.cache_key(torch.arange(11, 211)) not in stored  # the least recently used that no file continues
    more = [torch.cat((turn, _ids(400, 20 * (t + 1)))) for t in range(3)]
    for ctx in more:  # a conversation on: 10 KiB a turn
        engine.encode(ctx)
    for i in range(20, 23):  # then others: the conversation's last turns go first, each parent after its child
        engine.encode(torch.arange(10 + i, 210 + i))
        engine.flush_store()
        stored = _manifests(tmp_path)
        assert all(m["parent"] is None or m["parent"] in stored for m in stored.values())
    assert engine.cache_stats()["store"]["bytes"] <= 2**20


def test_a_damaged_parent_removes_the_files_that_continue_it(model_dir, tmp_path, caplog):
    first = _engine(model_dir, tmp_path)
    turns = _turns(first, n=2)
    first.encode(torch.cat((CTX, _ids(700, 30))))  # another branch off the same document
    first.flush_store()
    root = next(tmp_path.rglob(f"{first.cache_key(CTX)}.safetensors"))
    raw = bytearray(root.read_bytes())
    raw[-100] ^= 0xFF
    root.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="magnetar.engine.store"):
        again = _engine(model_dir, tmp_path)
        got = again.generate(turns[-1][0], Q, max_new_tokens=4)
    assert got.token_ids == turns[-1][1].token_ids and got.cached_context_tokens == 0  # Phase 1 ran again
    assert "checksum" in caplog.text and "removed, with the 3 stored contexts that continue it" in caplog.text
    again.flush_store()
    stored = _manifests(tmp_path)
    # every file that continued the damaged one is gone, the other branch too; the context is stored anew, whole
    assert list(stored) == [again.cache_key(turns[-1][0])] and stored[again.cache_key(turns[-1][0])]["parent"] is None
    # a parent removed by hand: the files that continue it are removed when the store opens
    root = next(tmp_path.rglob("*.json")).parent
    for p in root.iterdir():
        p.unlink()
    _turns(_engine(model_dir, tmp_path), n=2)
    for suffix in (".json", ".safetensors"):
        (root / f"{first.cache_key(CTX)}{suffix}").unlink()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="magnetar.engine.store"):
        opened = _engine(model_dir, tmp_path)
    assert not _files(tmp_path) and opened.cache_stats()["store"]["contexts"] == 0
    assert caplog.text.count("which is not stored: removed") == 2


def test_a_format_1_file_still_loads(model_dir, tmp_path):
    import hashlib
    import json

    want = _stored(model_dir, tmp_path)
    manifest = next(tmp_path.rglob("*.json"))
    m = json.loads(manifest.read_text())
    m["format"] = 1  # as an engine before files continued their parents wrote it: blake2b, no "hash"
    for field in ("kv", "parent", "parent_kv", "held", "hash"):
        del m[field]
    data = manifest.with_suffix(".safetensors")
    m["checksum"] = hashlib.blake2b(data.read_bytes(), digest_size=16).hexdigest()
    manifest.write_text(json.dumps(m))
    again = _engine(model_dir, tmp_path)
    got = again.generate(CTX, Q, max_new_tokens=6)
    assert got.token_ids == want and got.cached_context_tokens == CTX.numel()
    # a data file differing from its blake2b checksum is refused, as an xxh3 one is
    m["checksum"] = "0" * 32
    manifest.write_text(json.dumps(m))
    third = _engine(model_dir, tmp_path)
    assert third.generate(CTX, Q, max_new_tokens=6).cached_context_tokens == 0
    assert third.cache_stats()["store"]["refused"] == 1


def _two_ranks_conversation(rank, world, model_dir, store):
    flat = dict(method="star", cp_size=2, block_size=64, timeout_s=60, context_store=store, prefix_reuse="all")
    first = magnetar.init_inference(model_dir, **flat)
    turns = _turns(first)
    import json

    keys = [first.cache_key(ctx) for ctx, _ in turns]
    torch.distributed.barrier()  # both ranks' writes flushed
    folders = sorted(Path(store).iterdir())
    assert len(folders) == 2
    for folder in folders:  # each rank's folder: the same chain of its own shards
        m = {p.stem: json.loads(p.read_text()) for p in folder.glob("*.json")}
        assert [m[k]["parent"] for k in keys] == [None, *keys[:-1]], (rank, folder.name)
    fork = torch.cat((CTX, _ids(900, 30)))  # another conversation off the document
    want = first.generate(fork, Q, max_new_tokens=4)
    first.flush_store()
    torch.distributed.barrier()
    again = magnetar.init_inference(model_dir, **flat)
    got = again.generate(turns[-1][0], Q, max_new_tokens=4)
    assert got.token_ids == turns[-1][1].token_ids and got.cached_context_tokens == turns[-1][0].numel(), rank
    # the turns came back one after another, cached; the fork then shares the document both ranks hold
    got = again.generate(fork, Q, max_new_tokens=4)
    assert got.token_ids == want.token_ids and got.cached_context_tokens == fork.numel(), rank
    cache = again.encoder.cache
    assert cache.peek(again.cache_key(fork)).shard.head is cache.peek(again.cache_key(CTX)).shard, rank


def test_two_ranks_store_a_conversation_as_what_each_turn_adds(model_dir, tmp_path):
    run_distributed(_two_ranks_conversation, 2, str(model_dir), str(tmp_path))
