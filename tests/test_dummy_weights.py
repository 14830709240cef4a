"""Dummy weights (``--model dummy:<preset | config.json | folder>``, magnetar/models/dummy.py): a model from its
configuration alone, random weights in the requested dtype, on every entry point -- init_inference, magnetar-run,
magnetar-bench (the GPU kit's dry run, tests/test_gpu_kit.py, runs it too), magnetar serve -- and bad input."""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import magnetar
from magnetar.models import check_model, load_model, model_kind
from magnetar.models.dummy import PRESETS, dummy_config, has_tokenizer
from tests.conftest import repo_pythonpath
from tests.tiny_models import save_tiny_chat


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory) -> Path:
    """A Hugging Face folder without weights: config.json and a tokenizer (with a chat template)."""
    folder = save_tiny_chat(tmp_path_factory.mktemp("dummy-chat"), 512)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    return folder


def test_every_preset_is_a_config_transformers_builds_and_the_engine_supports():
    from magnetar.engine.hf import check_supported

    for name in PRESETS:
        cfg = dummy_config(f"dummy:{name}")
        check_supported(cfg)
        assert cfg.hidden_size == PRESETS[name]["hidden_size"]
    big = dummy_config("dummy:Llama-3.1-8B")  # case does not matter
    assert (big.num_hidden_layers, big.num_key_value_heads, big.vocab_size) == (32, 8, 128256)
    assert big.max_position_embeddings == 131072 and big.rope_scaling["rope_type"] == "llama3"


def test_init_inference_builds_random_weights_in_the_dtype(chat_folder):
    engine = magnetar.init_inference("dummy:tiny-llama", method="pulsar", cp_size=2, simulate=True,
                                     dtype="bfloat16")
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    assert engine.tokenizer is None and model_kind("dummy:tiny-llama") == "dummy"
    res = engine.generate(torch.randint(0, 512, (300,)), torch.randint(0, 512, (6,)), max_new_tokens=3)
    assert len(res.token_ids) == 3 and res.stop_reason == "max_new_tokens"  # random weights: no eos stops it
    # a folder with a tokenizer: text in, text out
    engine = magnetar.init_inference(f"dummy:{chat_folder}", method="dense")
    assert has_tokenizer(f"dummy:{chat_folder}") and engine.tokenizer is not None
    assert isinstance(engine.generate("A long document. " * 20, " Question?", max_new_tokens=2).text, str)
    # the same config.json given as a file: the shapes, no tokenizer
    model, tok = load_model(f"dummy:{chat_folder / 'config.json'}", dtype=torch.float32)
    assert tok is None and model.config.max_position_embeddings == 512


def _run_cli(argv):
    from magnetar.launch import run

    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exc:
        sys.exit(run.main(argv))
    return exc.value.code, out.getvalue(), err.getvalue()


def test_magnetar_run_with_dummy_weights(chat_folder, tmp_path):
    code, out, err = _run_cli(["--model", f"dummy:{chat_folder}", "--method", "star", "--cp-size", "2",
                               "--simulate", "true", "--context", "The number is 7. " * 10, "--query", "Number?",
                               "--max-new-tokens", "3", "--json-out", str(tmp_path / "r.json")])
    assert code == 0, err
    assert json.loads((tmp_path / "r.json").read_text())["method"] == "star"


def test_magnetar_run_with_another_models_tokenizer(chat_folder, tmp_path):
    # vLLM's --tokenizer: dummy weights of a preset read text with a folder's tokenizer (256 ids <= its 512)
    code, out, err = _run_cli(["--model", "dummy:tiny-llama", "--tokenizer", str(chat_folder), "--method", "dense",
                               "--context", "The number is 7. " * 10, "--query", "Number?", "--max-new-tokens", "2"])
    assert code == 0 and "answer:" in out, err
    # what --tokenizer cannot be, each named before any model is built
    (tmp_path / "empty").mkdir()
    for tok, words in (("dummy:tiny-llama", "--tokenizer dummy:tiny-llama: dummy weights have no tokenizer"),
                       (str(tmp_path / "empty"), "no tokenizer in that folder"),
                       ("", "--tokenizer is empty"),
                       ("no such thing", "--tokenizer 'no such thing' is neither")):
        code, out, err = _run_cli(["--model", "dummy:tiny-llama", "--tokenizer", tok, "--method", "dense",
                                   "--context", "text", "--query", "q"])
        assert code == 2 and words in err and "Traceback" not in err, err
    with pytest.MonkeyPatch.context() as mp:  # a Hub id not in the cache, offline (HF_HUB_OFFLINE=1)
        from huggingface_hub import constants

        mp.setattr(constants, "HF_HUB_OFFLINE", True)
        code, out, err = _run_cli(["--model", "dummy:tiny-llama", "--tokenizer", "someorg/no-such-tokenizer",
                                   "--method", "dense", "--context", "text", "--query", "q"])
        assert code == 2 and "--tokenizer: model 'someorg/no-such-tokenizer'" in err and "HF_HUB_OFFLINE" in err, err
    # a tokenizer with more ids than the model has embeddings
    small = json.loads((chat_folder / "config.json").read_text()) | {"vocab_size": 128}
    (tmp_path / "small.json").write_text(json.dumps(small))
    code, out, err = _run_cli(["--model", f"dummy:{tmp_path / 'small.json'}", "--tokenizer", str(chat_folder),
                               "--method", "dense", "--context", "text", "--query", "q"])
    assert code == 2 and "has 256 tokens, more than the model's vocabulary of 128" in err, err


@pytest.mark.parametrize("model,names", [
    ("dummy:llama-3.1-8b", ("--model dummy:llama-3.1-8b", "without a tokenizer", "--tokenizer", "magnetar-bench")),
    ("dummy:llama-9000", ("'llama-9000' is neither a dummy preset", "llama-3.1-8b")),
    ("dummy:", ("names no shape", "dummy:<preset>")),
])
def test_magnetar_run_refuses_what_dummy_weights_cannot_do(model, names):
    code, out, err = _run_cli(["--model", model, "--method", "dense", "--context", "text", "--query", "q"])
    assert code == 2 and err.startswith("magnetar-run: error: "), err
    assert all(n in err for n in names), err
    assert "Traceback" not in err


def test_bad_configs_and_context_past_the_positions(chat_folder, tmp_path):
    (tmp_path / "nomodeltype.json").write_text('{"hidden_size": 64}')
    (tmp_path / "broken.json").write_text('{"model_type": "llama", ')
    (tmp_path / "empty").mkdir()
    for spec, words in ((f"dummy:{tmp_path / 'nomodeltype.json'}", 'has no "model_type"'),
                        (f"dummy:{tmp_path / 'broken.json'}", "not a readable JSON config"),
                        (f"dummy:{tmp_path / 'empty'}", "holds no config.json")):
        with pytest.raises((ValueError, FileNotFoundError), match=words):
            check_model(spec)
    with pytest.raises(ValueError, match="applies to Hub ids.*dummy-weights model"):
        check_model("dummy:tiny-llama", revision="main")
    # the config's positions bound the context, as for real weights (512 here)
    code, out, err = _run_cli(["--model", f"dummy:{chat_folder}", "--method", "dense", "--context",
                               "word " * 800, "--query", "q", "--max-new-tokens", "2"])
    assert code == 2 and "max_position_embeddings" in err and "512" in err, err
    # a dtype the device cannot compute in (bf16 on a pre-Ampere GPU), checked before any weight is made
    from magnetar.models import dummy

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
        mp.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100 (test)")
        with pytest.raises(ValueError, match="bfloat16 is not supported by Tesla V100.*float16"):
            dummy.check_dtype_on(torch.bfloat16, torch.device("cuda", 0))


def test_magnetar_bench_refuses_a_missing_preset():
    from magnetar.eval import bench

    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exc:
        bench.main(["--model", "dummy:qwen-7", "--lengths", "64"])
    assert exc.value.code == 2 and "dummy preset" in err.getvalue() and "qwen2.5-7b" in err.getvalue()


def test_magnetar_serve_with_dummy_weights_answers_the_openai_client(chat_folder):
    # as on a GPU: `magnetar serve --model dummy:llama-3.1-8b --tokenizer smollm2-135m-instruct`, here a config.json
    # alone (no tokenizer of its own) with the chat folder's tokenizer and chat template
    openai = pytest.importorskip("openai", reason="the test extra: pip install 'magnetar[test]'")
    pytest.importorskip("fastapi", reason="the serve extra: pip install 'magnetar[serve]'")
    from tests.dist_utils import free_port, wait_serving

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=repo_pythonpath(), OMP_NUM_THREADS="1")
    log = chat_folder / "serve.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "magnetar.serve", "--model",
                                 f"dummy:{chat_folder / 'config.json'}", "--tokenizer", str(chat_folder),
                                 "--method", "dense", "--port", str(port), "--served-model-name", "dummy",
                                 "--timeout-s", "20", "--log-level", "info"], env=env, stdout=f,
                                stderr=subprocess.STDOUT)
    try:
        wait_serving(f"http://127.0.0.1:{port}", proc, 120, log.read_text)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.chat.completions.create(model="dummy", max_tokens=3,
                                               messages=[{"role": "user", "content": "Hello there?"}])
        assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"
        # a CPU rank's start: freed memory kept for the next tensors, the rotary embedding by Magnetar's op
        started = log.read_text()
        assert "malloc keeps freed memory for the next tensors" in started, started[-3000:]
        assert "modeling_llama.apply_rotary_pos_emb computed by Magnetar's one-pass op" in started, started[-3000:]
    finally:
        proc.terminate()
        t = time.monotonic()
        proc.wait(60)
        assert time.monotonic() - t < 60


def _config(folder, chat_folder, **fields):
    """A dummy model folder: ``chat_folder``'s tokenizer, the tiny-llama preset's config with ``fields``."""
    import shutil

    shutil.copytree(chat_folder, folder)
    base = dict(PRESETS["tiny-llama"])
    base.update(fields)
    (folder / "config.json").write_text(json.dumps(base))
    return f"dummy:{folder}"


@pytest.mark.parametrize("fields,words", [
    (dict(hidden_size=0), ("'hidden_size' must be a positive int, got 0",)),
    (dict(num_attention_heads=3, head_dim=None), ("not a multiple of the number of attention heads",)),
    (dict(vocab_size=10**12), ("lower vocab_size (1000000000000)", "GiB free on cpu")),
    (dict(num_hidden_layers=10**7), ("lower num_hidden_layers (10000000)", "GiB free on cpu")),
])
def test_a_dummy_config_is_checked_before_anything_is_built(tmp_path, chat_folder, fields, words):
    """Issue 44 item 4: the shapes a real model is held to, and the weights' size against the device's free memory,
    before a byte is allocated -- one ValueError naming the file and the field (these used to allocate until the
    allocator failed, or serve a model of hidden size 0)."""
    spec = _config(tmp_path / "m", chat_folder, **fields)
    with pytest.raises(ValueError) as e:
        load_model(spec, dtype=torch.float32)
    assert str(tmp_path / "m" / "config.json") in str(e.value) and all(w in str(e.value) for w in words), str(e.value)
    if "GiB" not in words[-1]:  # the shapes alone: the command lines' early check refuses them too
        with pytest.raises(ValueError, match=words[0].replace("(", r"\(").replace(")", r"\)")):
            check_model(spec)
    code, out, err = _run_cli(["--model", spec, "--method", "dense", "--context", "text", "--query", "q"])
    assert code == 2 and words[0] in err and "Traceback" not in err, err


def test_config_files_are_read_bounded(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text('{"model_type": "llama", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    huge = tmp_path / "huge.json"
    huge.write_text('{"model_type": "llama", "x": "' + "a" * (2**20 + 10) + '"}')
    digits = tmp_path / "digits.json"
    digits.write_text('{"model_type": "llama", "vocab_size": ' + "9" * 5000 + "}")
    for path, words in ((deep, "nested too deeply"), (huge, "larger than 1 MiB"), (digits, "integer of 5000 digits")):
        with pytest.raises(ValueError, match=words) as e:
            check_model(f"dummy:{path}")
        assert str(path) in str(e.value)
