"""Loading as Hugging Face users do: Hub ids ``org/name`` with ``revision`` / ``cache_dir`` / ``trust_remote_code``,
offline from a Hub cache built here by hand (nothing is downloaded: every test that resolves a Hub id runs with
``HF_HUB_OFFLINE=1``), clear errors for missing files, ``dtype="auto"``, and the order in which a model argument is
told apart (registry name, local folder, Hub id)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import magnetar
from magnetar.config import DTYPES, EngineConfig
from magnetar.models import ModelNotFoundError, check_model, is_hub_id, load_model, model_kind, model_path
from magnetar.models.hub import hub_errors
from tests.tiny_models import tiny_model

REPO = "tiny-org/tiny-llama"
MAIN, V2 = "a" * 40, "b" * 40  # commit hashes of the two snapshots
CONTEXT, QUERY = "The quick brown fox jumps over the lazy dog. " * 4, "Who jumps?"


def _save_tokenizer(out: Path) -> None:
    """A byte-level tokenizer whose 256 ids are the tiny models' vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(out)


def _save_model(out: Path, seed: int, dtype: torch.dtype = torch.float32):
    model = tiny_model("llama", seed=seed).to(dtype)
    model.save_pretrained(out)
    _save_tokenizer(out)
    return model


def _add_snapshot(cache: Path, repo_id: str, ref: str, commit: str, folder: Path) -> None:
    """``folder``'s files as the Hub cache holds a download: ``models--org--name/snapshots/<commit>/`` and
    ``refs/<ref>`` naming the commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A Hub cache with ``REPO`` at ``main`` (tiny llama, seed 0, fp32) and ``v2`` (seed 1, bf16), and
    ``tiny-org/tiny-bf16`` (seed 2, bf16 checkpoint). Returns (cache, {name: model saved})."""
    root = tmp_path_factory.mktemp("hub")
    cache = root / "cache"
    saved = {"main": _save_model(root / "main", 0), "v2": _save_model(root / "v2", 1, torch.bfloat16),
             "bf16": _save_model(root / "bf16", 2, torch.bfloat16)}
    _add_snapshot(cache, REPO, "main", MAIN, root / "main")
    _add_snapshot(cache, REPO, "v2", V2, root / "v2")
    _add_snapshot(cache, "tiny-org/tiny-bf16", "main", "c" * 40, root / "bf16")
    return cache, saved, root


@pytest.fixture
def offline(monkeypatch):
    """``HF_HUB_OFFLINE=1`` as huggingface_hub sees it: it reads the variable once, at import, into
    ``constants.HF_HUB_OFFLINE``, which transformers and huggingface_hub's HTTP layer consult at every call."""
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert huggingface_hub.is_offline_mode()


def _tokens(model, **kw) -> list[int]:
    engine = magnetar.init_inference(model, method="dense", deepspeed_inference=False, **kw)
    return engine.generate(CONTEXT, QUERY, max_new_tokens=6).token_ids


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k].to(sa[k].dtype)) for k in sa)


# -- Hub ids, offline from the cache --------------------------------------------------------------------------
def test_hub_id_loads_offline_and_answers_as_the_model_object(hub, offline):
    cache, saved, root = hub
    model, tok = load_model(REPO, cache_dir=cache)
    assert _same_weights(model, saved["main"]) and model.dtype == torch.float32
    assert tok("ab", add_special_tokens=False)["input_ids"] == [ord("a") - 33, ord("b") - 33]  # byte-level ids
    from_hub = _tokens(REPO, cache_dir=cache)
    from_object = _tokens(saved["main"], tokenizer=tok)
    assert len(from_hub) == 6 and from_hub == from_object


def test_revision_picks_its_snapshot(hub, offline):
    cache, saved, _ = hub
    for revision in ("v2", V2):  # a branch of the cache's refs, and a commit hash
        model, _ = load_model(REPO, cache_dir=cache, revision=revision, dtype=torch.bfloat16)
        assert _same_weights(model, saved["v2"]) and not _same_weights(model, saved["main"])
    engine = magnetar.init_inference(REPO, cache_dir=cache, revision="v2", method="dense", dtype="auto",
                                     deepspeed_inference=False)
    assert _same_weights(engine.model, saved["v2"])
    assert model_path(REPO, cache, revision="v2") == cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / V2
    check_model(REPO, revision="v2", cache_dir=cache)  # in the cache: no error


def test_hub_options_reach_both_from_pretrained_calls(hub, offline, monkeypatch):
    import transformers

    cache, _, _ = hub
    seen = {}
    for cls in (transformers.AutoTokenizer, transformers.AutoModelForCausalLM):
        def spy(source, *args, _real=cls.from_pretrained, _name=cls.__name__, **kw):
            seen[_name] = (source, {k: kw.get(k) for k in ("revision", "cache_dir", "trust_remote_code", "dtype")})
            return _real(source, *args, **kw)

        monkeypatch.setattr(cls, "from_pretrained", spy)
    magnetar.init_inference(REPO, revision="v2", cache_dir=cache, trust_remote_code=True, dtype="auto",
                            method="dense", deepspeed_inference=False)
    want = {"revision": "v2", "cache_dir": cache, "trust_remote_code": True}
    assert seen["AutoTokenizer"] == (REPO, dict(want, dtype=None))
    assert seen["AutoModelForCausalLM"] == (REPO, dict(want, dtype="auto"))


def test_missing_hub_files_offline_say_how_to_get_them(hub, offline, tmp_path):
    cache, _, _ = hub
    for repo, revision in (("tiny-org/missing", None), (REPO, "nope")):
        shown = f"revision {revision or 'main'!r}"
        get = f"hf download {repo}" + (f" --revision {revision}" if revision else "") + f" --cache-dir {cache}"
        for call in (lambda: magnetar.init_inference(repo, cache_dir=cache, revision=revision, method="dense"),
                     lambda: load_model(repo, cache_dir=cache, revision=revision),
                     lambda: check_model(repo, cache_dir=cache, revision=revision),
                     lambda: model_path(repo, cache, revision=revision)):
            with pytest.raises(ModelNotFoundError) as err:
                call()
            msg = str(err.value)
            assert isinstance(err.value, FileNotFoundError)
            for part in (repr(repo), shown, "HF_HUB_OFFLINE", get, "local model folder"):
                assert part in msg, (part, msg)
    # a snapshot whose config is cached but whose weights are not: the same error, from transformers' OSError
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / MAIN / "config.json", partial)
    _save_tokenizer(partial)
    _add_snapshot(tmp_path / "cache", REPO, "main", MAIN, partial)
    with pytest.raises(ModelNotFoundError, match=r"(?s)'tiny-org/tiny-llama' \(revision 'main'\).*HF_HUB_OFFLINE.*"
                                                 r"transformers: "):
        load_model(REPO, cache_dir=tmp_path / "cache")


def test_cli_runs_a_hub_id_offline_and_refuses_a_missing_one(hub, offline, monkeypatch, capsys):
    import huggingface_hub

    from magnetar.launch.run import main

    cache, _, _ = hub
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))  # what $HF_HUB_CACHE sets
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    base = ["--method", "dense", "--deepspeed-inference", "false", "--context", CONTEXT, "--query", QUERY,
            "--max-new-tokens", "3"]
    assert main(["--model", REPO, "--revision", "v2", *base]) == 0
    assert "answer:" in capsys.readouterr().out
    with pytest.raises(SystemExit) as err:
        main(["--model", "tiny-org/missing", *base])
    assert err.value.code == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("magnetar-run: error: model 'tiny-org/missing'") and "hf download tiny-org/missing" in line


# -- dtype "auto" -------------------------------------------------------------------------------------------
def test_dtype_auto_keeps_the_checkpoints_dtype(hub, offline):
    cache, saved, root = hub
    assert "auto" in DTYPES and EngineConfig.create(dtype="auto").runtime.dtype == "auto"
    for source, kw in (("tiny-org/tiny-bf16", {"cache_dir": cache}), (root / "bf16", {})):  # Hub id, local folder
        model, _ = load_model(source, dtype="auto", **kw)
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        engine = magnetar.init_inference(source, method="dense", dtype="auto", deepspeed_inference=False, **kw)
        assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
        assert _same_weights(engine.model, saved["bf16"])
        assert len(engine.generate(CONTEXT, QUERY, max_new_tokens=3).token_ids) == 3
        cast = magnetar.init_inference(source, method="dense", dtype="float32", deepspeed_inference=False, **kw)
        assert {p.dtype for p in cast.model.parameters()} == {torch.float32}  # a fixed dtype still casts
    obj = tiny_model("llama", seed=3).to(torch.float16)  # a model object keeps its own dtype
    engine = magnetar.init_inference(obj, method="dense", dtype="auto", deepspeed_inference=False)
    assert {p.dtype for p in engine.model.parameters()} == {torch.float16}


def test_dtype_auto_runs_a_float16_checkpoint_as_bfloat16_on_a_cpu(tmp_path, caplog):
    """torch's CPU float16 products are ~10x slower than bfloat16's: auto runs such a checkpoint as bfloat16 there
    (as vLLM's CPU build), saying so; a named dtype is kept; on a GPU auto keeps float16."""
    from magnetar.engine.load import cpu_half

    saved = _save_model(tmp_path / "fp16", 4, torch.float16)
    with caplog.at_level("WARNING", logger="magnetar.engine.load"):
        engine = magnetar.init_inference(tmp_path / "fp16", method="dense", dtype="auto", deepspeed_inference=False)
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    assert "is a float16 checkpoint: on a CPU it runs as bfloat16" in caplog.text and "--dtype float16" in caplog.text
    assert _same_weights(engine.model, saved)  # float16 -> bfloat16 of the same weights
    kept = magnetar.init_inference(tmp_path / "fp16", method="dense", dtype="float16", deepspeed_inference=False)
    assert {p.dtype for p in kept.model.parameters()} == {torch.float16}
    assert cpu_half(torch.float16, torch.device("cuda", 0), "m") == torch.float16
    assert cpu_half(torch.bfloat16, torch.device("cpu"), "m") == torch.bfloat16


def test_dtype_auto_cli_choice_and_cost_model():
    from magnetar.eval.cost import estimate
    from magnetar.launch.run import build_parser

    args = build_parser().parse_args(["--model", "m", "--context", "c", "--query", "q", "--dtype", "auto"])
    assert EngineConfig.from_cli(args).runtime.dtype == "auto"
    # auto (the default): the cost model counts the bytes of the dtype the model config names, as the engine loads
    model_config = tiny_model("llama").config
    for named, fixed in (("bfloat16", "bfloat16"), ("float16", "float16"), (None, "float32")):
        model_config.dtype = named
        auto, want = (estimate(model_config, EngineConfig.create(dtype=d), 64) for d in ("auto", fixed))
        assert auto == want, named
    assert EngineConfig().runtime.dtype == "auto"


# -- what a model argument is, and bad arguments ------------------------------------------------------------
def test_resolution_order(hub, offline, tmp_path, monkeypatch):
    _, saved, root = hub
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("org/name") and is_hub_id("Org-1/na.me_2")
    assert not any(is_hub_id(x) for x in ("gpt2", "a/b/c", "/abs/path", "org/", "org--x/y", "~/m", 3, b"o/n"))
    assert model_kind("smollm2-135m-instruct") == "registry"
    (tmp_path / "smollm2-135m-instruct").mkdir()  # a same-named folder does not shadow the registry name
    assert model_kind("smollm2-135m-instruct") == "registry"
    # an existing folder spelled like a Hub id wins, as in transformers: loaded from disk although no cache has it
    shutil.copytree(root / "main", tmp_path / "tiny-org" / "local-only")
    assert model_kind("tiny-org/local-only") == "local"
    model, _ = load_model("tiny-org/local-only")
    assert _same_weights(model, saved["main"])
    assert model_kind(tmp_path / "tiny-org" / "local-only") == "local"  # os.PathLike too
    assert model_kind("tiny-org/not-here") == "hub"
    for bad, why in (("gpt2", "nor a Hugging Face Hub id of the form org/name"),
                     ("/nonexistent/llama", "neither a registered model"),
                     (str(tmp_path / "tiny-org"), "no config.json")):
        with pytest.raises(FileNotFoundError, match=why):
            load_model(bad)
        with pytest.raises(FileNotFoundError, match=why):
            check_model(bad)


def test_bad_loading_arguments_are_named(hub, offline):
    cache, saved, root = hub
    cases = [
        (lambda: magnetar.init_inference(saved["main"], revision="v2"),
         "revision applies to a model given by name.*loaded already"),
        (lambda: magnetar.init_inference(saved["main"], cache_dir=cache),
         "cache_dir applies .*loaded already: drop it"),
        (lambda: magnetar.init_inference(saved["main"], trust_remote_code=True), "trust_remote_code applies .*loaded"),
        (lambda: magnetar.init_inference(REPO, revision=""), "revision must be a non-empty str"),
        (lambda: magnetar.init_inference(REPO, revision=2), "revision must be a non-empty str"),
        (lambda: magnetar.init_inference(REPO, trust_remote_code="yes"), "trust_remote_code must be True or False"),
        (lambda: magnetar.init_inference(REPO, cache_dir=3), "cache_dir must be a folder path"),
        (lambda: load_model(root / "main", revision="v2"), "revision='v2' applies to Hub ids .*local folder"),
        (lambda: check_model("smollm2-135m-instruct", revision="v2"), "registered model: drop revision"),
        (lambda: load_model(REPO, cache_dir=cache, dtype="fp16"),
         r"dtype must be a floating torch.dtype .* or 'auto'.*got 'fp16'"),
        (lambda: load_model(REPO, cache_dir=cache, dtype=torch.int8), "dtype must be a floating torch.dtype"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()


def _http_error(cls, status: int):
    import httpx2

    response = httpx2.Response(status, request=httpx2.Request("GET", "https://huggingface.co/api/models/x"))
    return cls(f"{status} error", response=response)


@pytest.mark.parametrize("case", ["repo", "revision", "gated", "no-network"])
def test_online_hub_errors_name_the_cause(case, monkeypatch):
    """The messages of failures only an online load meets (built from huggingface_hub's own exceptions, as
    transformers chains them under its OSError; nothing is requested)."""
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError
    from huggingface_hub.errors import RevisionNotFoundError

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    cause, expect = {
        "repo": (_http_error(RepositoryNotFoundError, 404), "no such repository on the Hugging Face Hub; no local "
                                                            "folder 'org/name' exists either"),
        "revision": (_http_error(RevisionNotFoundError, 404), "the repository has no revision 'r1'"),
        "gated": (_http_error(GatedRepoError, 403), "gated: accept its terms at https://huggingface.co/org/name"),
        "no-network": (LocalEntryNotFoundError("not cached"), "the Hub could not be reached"),
    }[case]
    with pytest.raises(ModelNotFoundError) as err:
        with hub_errors("org/name", "r1", None):
            raise OSError("transformers' own words") from cause
    msg = str(err.value)
    assert msg.startswith("model 'org/name' (revision 'r1') cannot be loaded: ") and expect in msg
    assert "transformers' own words" in msg and err.value.__cause__.__cause__ is cause
