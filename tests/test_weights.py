"""Weights files (``magnetar.utils.weights``) as read by :class:`HashBank` and :class:`IndexerBank`: a round trip
keeps every tensor and the metadata; a file laid out as before the shared loader still loads; a malicious pickle
is refused without its payload ever running; random bytes, a truncated archive, another kind of file, another
model, a missing field, a wrong shape and NaN weights each get an error that names the file and what to do.
"""
from __future__ import annotations

import os
import pickle
import re

import pytest
import torch

from magnetar.prefill.indexer import IndexerBank
from magnetar.sparse.hashing import HashBank, model_signature
from tests.tiny_models import tiny_model


class _Payload:
    """Unpickling this creates ``marker`` (a stand-in for any shell command)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def config():
    return tiny_model("llama", seed=8).config


def _hash_bank(config):
    bank = HashBank("mlp", model_signature(config), bits=64, hidden=16, seed=3)
    bank.trained_layers, bank.meta = [1], {"losses": {1: (1.0, 0.5, 0.1)}, "train_config": {"betas": (0.9, 0.98)}}
    return bank


BANKS = {"hash": (_hash_bank, HashBank.load, "hash_path"),
         "indexer": (lambda config: IndexerBank.random(config, 64, seed=1), IndexerBank.load, "prefill_indexer_path")}


@pytest.mark.parametrize("kind", BANKS)
def test_round_trip_keeps_tensors_and_metadata(kind, config, tmp_path):
    make, load, _ = BANKS[kind]
    bank = make(config)
    bank.save(tmp_path / "w.pt")
    back = load(tmp_path / "w.pt", config)
    assert back.trained_layers == bank.trained_layers and back.meta == (
        bank.meta if kind == "hash" else dict(bank.meta, untrained=True))
    for (name, a), (_, b) in zip(bank.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert not (tmp_path / "w.pt.tmp").exists()


def test_file_written_by_the_previous_save_code_still_loads(config, tmp_path):
    bank = _hash_bank(config)  # the dict HashBank.save wrote with a bare torch.save before the shared loader
    torch.save({"format": "magnetar-hash-v1", "kind": bank.kind, "signature": bank.signature, "bits": bank.bits,
                "hidden": bank.hidden, "state": bank.state_dict(), "trained_layers": bank.trained_layers,
                "meta": bank.meta}, tmp_path / "old.pt")
    back = HashBank.load(tmp_path / "old.pt", config)
    x = torch.randn(2, 9, 16)
    assert torch.equal(back.codes(1, x), bank.codes(1, x)) and back.meta == bank.meta
    ix = IndexerBank.random(config, 64, seed=1)  # an indexer file without "seed" (optional since v1)
    torch.save({"format": "magnetar-indexer-v1", "signature": ix.signature, "d_idx": 64, "theta": ix.theta,
                "state": ix.state_dict(), "trained_layers": [], "meta": {}}, tmp_path / "old-ix.pt")
    assert torch.equal(IndexerBank.load(tmp_path / "old-ix.pt", config, d_idx=64)[1].wq, ix[1].wq)


@pytest.mark.parametrize("kind", BANKS)
@pytest.mark.parametrize("wrapping", ["torch archive", "plain pickle"])
def test_malicious_pickle_is_refused_and_never_runs(kind, wrapping, config, tmp_path):
    make, load, _ = BANKS[kind]
    marker, path = tmp_path / "PWNED", tmp_path / "evil.pt"
    bank = make(config)  # a real bank's file, with the payload hidden in its metadata
    data = {"format": f"magnetar-{kind}-v1", "signature": bank.signature, "state": bank.state_dict(),
            "kind": "mlp", "bits": 64, "hidden": 16, "d_idx": 64, "theta": 1e4, "meta": {"x": _Payload(marker)}}
    if wrapping == "torch archive":
        torch.save(data, path)
    else:
        path.write_bytes(pickle.dumps(data))
    why = (r"refused: it holds Python objects other than tensors and plain data \(posix.system\).*could run code"
           if wrapping == "torch archive" else "not a torch weights archive.*it was not read")
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*" + why):
        load(path, config)
    assert not marker.exists()
    # the payload is live: the unsafe load this loader replaced would have run it
    if wrapping == "torch archive":
        torch.load(path, weights_only=False)
        assert marker.exists()


@pytest.mark.parametrize("kind", BANKS)
def test_bad_files_get_errors_naming_the_file(kind, config, tmp_path):
    make, load, option = BANKS[kind]
    good = tmp_path / "good.pt"
    make(config).save(good)

    def refused(path, pattern, error=ValueError):
        with pytest.raises(error, match=pattern) as err:
            load(path, config)
        assert str(path) in str(err.value) and option in str(err.value), err.value

    noise = tmp_path / "noise.pt"
    noise.write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0),
                                    dtype=torch.uint8).numpy().tobytes())
    refused(noise, "not a torch weights archive")
    blob = good.read_bytes()
    (tmp_path / "cut.pt").write_bytes(blob[: len(blob) // 2])
    refused(tmp_path / "cut.pt", "damaged or truncated")
    (tmp_path / "empty.pt").write_bytes(b"")
    refused(tmp_path / "empty.pt", "empty")
    refused(tmp_path / "missing.pt", "not found", FileNotFoundError)
    refused(tmp_path, "folder")
    torch.save({"model.embed_tokens.weight": torch.zeros(3)}, tmp_path / "hf.pt")
    refused(tmp_path / "hf.pt", "not a Magnetar weights file")
    other = tmp_path / "other.pt"  # the other bank's file
    BANKS["indexer" if kind == "hash" else "hash"][0](config).save(other)
    refused(other, "wrong kind of file")
    with pytest.raises(ValueError, match=re.escape(str(good)) + ".*made for another model.*num_hidden_layers 2 != 3"):
        load(good, tiny_model("llama", num_hidden_layers=3).config)

    def edited(name, change):
        data = torch.load(good, weights_only=True)
        change(data)
        torch.save(data, tmp_path / name)
        return tmp_path / name

    refused(edited("v9.pt", lambda d: d.update(format=f"magnetar-{kind}-v9")), "format version '9'")
    refused(edited("nosig.pt", lambda d: d.pop("signature")), "field 'signature' is missing")
    refused(edited("dims.pt", lambda d: d["signature"].update(head_dim="16")), "signature field 'head_dim'")
    refused(edited("layers.pt", lambda d: d.update(trained_layers=[7])), r"trained_layers \[7\]")
    name = next(iter(torch.load(good, weights_only=True)["state"]))
    refused(edited("shape.pt", lambda d: d["state"].update({name: d["state"][name][..., :1]})),
            rf"tensor '{name}' is .* its header implies")
    refused(edited("nan.pt", lambda d: d["state"][name].view(-1).__setitem__(0, float("nan"))), "NaN or inf")
