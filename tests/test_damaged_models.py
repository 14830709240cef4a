"""A damaged model folder (issue 28): a cut tokenizer.json, a missing config.json, a broken chat template, a garbage
or cut safetensors file -- in a folder of the user's own or a prepared registry model -- is one error naming the
file and the fix (``python -m magnetar.models prepare NAME --force`` for a registry model), from the Python API and
as one line from a command line; never a library traceback. A full disk when preparing names the space needed."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import magnetar
from magnetar.models import DamagedModelError, MARKER, model_path
from tests.tiny_models import save_tiny

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _damage(folder: Path, how: str) -> str:
    """Damage ``folder`` (its files replaced, never written through: they may be hard links); the file's name."""
    def replace(name, data: bytes):
        (folder / name).unlink(missing_ok=True)
        (folder / name).write_bytes(data)
        return name

    if how == "cut tokenizer.json":
        return replace("tokenizer.json", (folder / "tokenizer.json").read_bytes()[:200])
    if how == "missing config.json":
        (folder / "config.json").unlink()
        return "config.json"
    if how == "broken chat template":
        return replace("chat_template.jinja", b"{% for m in messages %}{{ m['content'] }")
    if how == "garbage safetensors header":
        data = (folder / "model.safetensors").read_bytes() if (folder / "model.safetensors").stat().st_size < 2**24 \
            else b"\0" * 64
        return replace("model.safetensors", b"\xff" * 8 + data[8:64])
    if how == "cut safetensors":
        with open(folder / "model.safetensors", "rb") as f:
            head = f.read(min(2**20, (folder / "model.safetensors").stat().st_size // 2))
        return replace("model.safetensors", head)
    raise ValueError(how)


DAMAGE = ["cut tokenizer.json", "missing config.json", "broken chat template", "garbage safetensors header",
          "cut safetensors"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-whole")
    save_tiny(out, "llama")
    (out / "chat_template.jinja").write_text(TEMPLATE)
    return out


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_folder_of_ones_own_names_the_file(tiny_dir, tmp_path, how):
    folder = tmp_path / "model"
    shutil.copytree(tiny_dir, folder)
    name = _damage(folder, how)
    if how == "missing config.json":  # then it is no model folder at all, which the model argument's check says
        with pytest.raises(FileNotFoundError, match=r"nor a Hugging Face model folder \(no config.json in"):
            magnetar.init_inference(str(folder), method="dense")
        return
    with pytest.raises(DamagedModelError, match=rf"the model folder {folder} is damaged: {name} .*; replace that "
                                                r"file from the model's source"):
        magnetar.init_inference(str(folder), method="dense")


def test_a_whole_folder_passes(tiny_dir):
    assert model_path(str(tiny_dir)) == tiny_dir


@pytest.mark.model
@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_prepared_model_names_the_file_and_prepare_force(smollm2_path, tmp_path, how):
    """The prepared SmolLM2 folder, hard-linked into a private cache (nothing is copied or written through)."""
    cache = tmp_path / "cache"
    folder = cache / smollm2_path.name
    folder.mkdir(parents=True)
    for f in smollm2_path.iterdir():
        os.link(f, folder / f.name)
    assert (folder / MARKER).exists()
    name = _damage(folder, how)
    with pytest.raises(DamagedModelError, match=rf"{name} .*python -m magnetar\.models prepare "
                                                rf"smollm2-135m-instruct --force --cache-dir {cache}"):
        model_path("smollm2-135m-instruct", cache)


def test_a_damaged_folder_is_one_line_from_magnetar_run(tiny_dir, tmp_path, capsys):
    from magnetar.launch.run import main

    folder = tmp_path / "model"
    shutil.copytree(tiny_dir, folder)
    _damage(folder, "cut tokenizer.json")
    with pytest.raises(SystemExit) as e:
        main(["--model", str(folder), "--context", "Some text.", "--query", "What?"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("magnetar-run: error: the model folder") \
        and "tokenizer.json is not valid JSON" in err[0], err


def test_a_full_disk_names_the_space_needed(tmp_path, monkeypatch):
    from magnetar.models import prepare

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10 * 2**30, 10 * 2**30 - 2**20,
                                                                                    2**20))
    with pytest.raises(ValueError, match=r"not enough disk space to prepare smollm2-135m-instruct in .*: it needs "
                                         r"about 1024 MiB, 1 MiB are free; .*MAGNETAR_CACHE"):
        prepare.check_space(tmp_path, 2**30, "smollm2-135m-instruct")
