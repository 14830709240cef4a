"""``runtime.max_model_len`` (``--max-model-len``, vLLM's flag): the most positions one request may use, below the
model's own -- an operator's bound on a request's memory, refused up front and by name instead of running until the
device's memory runs out (tests/test_serve_memory.py)."""
from __future__ import annotations

import httpx
import pytest
import torch

import magnetar
from magnetar.config import EngineConfig
from magnetar.engine.inputs import PositionLimit, position_limit, positions_phrase
from tests.tiny_models import save_tiny_chat

openai = pytest.importorskip("openai", reason="the test extra: pip install 'magnetar[test]'")
pytest.importorskip("fastapi", reason="the serve extra: pip install 'magnetar[serve]'")

from magnetar.serve.server import Server  # noqa: E402
from tests.dist_utils import free_port, serve_in_thread  # noqa: E402

CAP = 96  # the tiny chat model has 1024 positions


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_chat(tmp_path_factory.mktemp("tiny-chat"), 1024)


def test_the_limit_is_the_models_or_the_cap_below_it():
    assert position_limit(None, None) is None and position_limit(1024, None) == 1024
    assert not position_limit(1024, None).capped and not position_limit(1024, 1024).capped
    assert position_limit(1024, 96) == 96 and position_limit(1024, 96).capped and position_limit(None, 96) == 96
    with pytest.raises(ValueError, match=r"runtime.max_model_len \(2048\) exceeds the model's 1024 positions "
                                         r"\(max_position_embeddings\): give at most 1024 \(--max-model-len\)"):
        position_limit(1024, 2048)
    assert positions_phrase(PositionLimit(1024)) == "the model's 1024 positions"
    capped = positions_phrase(PositionLimit(96, capped=True))
    assert capped == "the 96 positions of runtime.max_model_len (--max-model-len)"
    with pytest.raises(ValueError, match=r"runtime.max_model_len \(--max-model-len\): must be >= 1 positions"):
        EngineConfig.create(max_model_len=0)


def test_the_engine_refuses_a_longer_request_by_name(model_dir):
    engine = magnetar.init_inference(str(model_dir), method="dense", max_model_len=CAP, timeout_s=60)
    assert engine.max_positions == CAP
    ok = engine.generate(torch.arange(10, 80), torch.tensor([5, 6]), max_new_tokens=4)  # 70 + 2 + 4 <= 96
    assert len(ok.token_ids) == 4
    with pytest.raises(ValueError, match=r"= 106 tokens exceeds the 96 positions of runtime.max_model_len "
                                         r"\(--max-model-len\); lower max_new_tokens to at most 24"):
        engine.generate(torch.arange(10, 80), torch.tensor([5, 6]), max_new_tokens=34)
    with pytest.raises(ValueError, match="max_model_len"):
        magnetar.init_inference(str(model_dir), method="dense", max_model_len=4096, timeout_s=60)
    plain = magnetar.init_inference(str(model_dir), method="dense", timeout_s=60)
    assert plain.generate(torch.arange(10, 80), torch.tensor([5, 6]), max_new_tokens=34).token_ids  # no cap: fits


def test_the_server_refuses_a_longer_request_before_its_phase1(model_dir):
    engine = magnetar.init_inference(str(model_dir), method="dense", max_model_len=CAP, timeout_s=60)
    with serve_in_thread(Server(engine, model_name="tiny", port=free_port(), max_tokens=4)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Sum it up."}],
                                           max_tokens=4, extra_body={"magnetar": {"context": "A long report. " * 60}})
        assert "runtime.max_model_len (--max-model-len)" in e.value.body["message"], e.value.body
        ok = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Go on."}],
                                            max_tokens=4, extra_body={"magnetar": {"context": "A short note."}})
        assert ok.choices[0].message.content is not None
        r = httpx.post(server.url + "/tokenize", json={"model": "tiny", "prompt": "Hello."}, timeout=30)
        assert r.status_code == 200 and r.json()["max_model_len"] == CAP  # what a vLLM client reads


def test_the_flag_is_checked_by_name(capsys):
    from magnetar.launch.run import main

    with pytest.raises(SystemExit) as e:
        main(["--model", "m", "--context", "c", "--query", "q", "--max-model-len", "0"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and "max_model_len" in err and "must be >= 1" in err, err
