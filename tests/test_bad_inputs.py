"""Every bad argument to a public Python entry gets a clear error: the exception type, and a message that names the
argument and what to pass instead (the issue's "Every bad input gets a clear error"; the rules in docs/design.md).

Entries: ``init_inference``, ``Engine.generate`` / ``generate_batch`` / ``score`` / ``score_variants``
(:mod:`magnetar.engine.inputs`), the ops (``attention_with_lse``, ``merge_states``, ``merge_states_torch``,
``register_backend``, ``explain``), ``ring_attention`` (local checks, a group of one), ``init_groups`` /
``rank_layout`` / ``local_groups``. One tiny model and engine serve every case (built once, on first use).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import pytest
import torch

import magnetar
from magnetar.config import EngineConfig, SparseConfig
from magnetar.ops import attention_with_lse, explain, merge_states, merge_states_torch, register_backend
from magnetar.parallel import init_groups, local_groups, rank_layout, ring_attention
from tests.tiny_models import tiny_model

# The bare exception types the issue rules out: an entry must never let one of these escape from deep inside.
FORBIDDEN = (TypeError, IndexError, ZeroDivisionError, AttributeError, KeyError, RuntimeError)


@dataclass(frozen=True)
class Case:
    id: str                                # unique pytest id
    call: Callable[[], object]             # performs the bad call (closures over fixtures built once)
    error: type[BaseException]             # expected exception type (pytest.raises semantics)
    names: tuple[str, ...]                 # substrings the message must contain: the argument and the fix


class CharTokenizer:
    """One id per character (code point mod 256, the tiny models' vocabulary); no chat template, no BOS."""

    chat_template = None
    bos_token_id = eos_token_id = None

    def __call__(self, text, add_special_tokens=False, split_special_tokens=False):  # no special tokens to split
        return {"input_ids": [ord(c) % 256 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class WideTokenizer(CharTokenizer):
    """A tokenizer that does not match the model: ids beyond its 256-token vocabulary."""

    def __call__(self, text, add_special_tokens=False, split_special_tokens=False):
        return {"input_ids": [1000 + ord(c) for c in text]}


@functools.cache
def _model():
    return tiny_model("llama", seed=0)  # vocab 256, 1024 positions, 4 query / 2 KV heads of 16


@functools.cache
def _engine():
    return magnetar.init_inference(_model(), deepspeed_inference=False, tokenizer=CharTokenizer())


def _wide_engine():
    return magnetar.Engine(_engine().model, _engine().config, _engine().groups, WideTokenizer())


CTX, QRY = torch.arange(20), torch.tensor([5, 6, 7])
Q, K = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 5, 8)  # (B, Hq, Sq, D), (B, Hkv, Sk, D)
OUT, LSE = torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3)  # one partial state (B, H, S, D), (B, H, S)


def gen(*args, **kw):
    return lambda: _engine().generate(*args, **kw)


def attn(q=Q, k=K, v=K, **kw):
    return lambda: attention_with_lse(q, k, v, **kw)


def ring(q=Q, k=K, v=K, **kw):
    kw = {"group": None, "q_pos": torch.tensor([3, 4]), "k_pos": torch.arange(5), **kw}
    return lambda: ring_attention(q, k, v, **kw)


CASES = [
    # -- Engine.generate: context / query --------------------------------------------------------------------
    Case("generate-context-int", gen(5, QRY), ValueError, ("context", "str or a 1-D tensor of token ids", "int 5")),
    Case("generate-context-none", gen(None, QRY), ValueError, ("context", "str or a 1-D tensor", "NoneType")),
    Case("generate-context-list-of-ids", gen([1, 2, 3], QRY), ValueError, ("context is a list", "torch.tensor(ids)")),
    Case("generate-context-bytes", gen(b"some text", "q?"), ValueError, ("context is bytes", "decode")),
    Case("generate-query-mixed-types", gen("some text", QRY), ValueError, ("context and query", "both as strings")),
    Case("generate-context-float-tensor", gen(CTX.float(), QRY), ValueError,
         ("context is a torch.float32 tensor", "integer tensor")),
    Case("generate-query-bool-tensor", gen(CTX, QRY > 5), ValueError, ("query is a torch.bool tensor", "integer")),
    Case("generate-context-batch-of-2", gen(CTX.view(2, 10), QRY), ValueError,
         ("context has shape (2, 10)", "(N,) or (1, N)", "generate_batch")),
    Case("generate-query-0d", gen(CTX, torch.tensor(5)), ValueError, ("query has shape ()", "(N,)")),
    Case("generate-context-3d", gen(CTX.view(1, 1, 20), QRY), ValueError, ("context has shape (1, 1, 20)",)),
    Case("generate-context-empty-tensor", gen(torch.zeros(0, dtype=torch.long), QRY), ValueError,
         ("context is empty", "non-empty context")),
    Case("generate-context-empty-str", gen("", "q?"), ValueError, ("context is empty",)),
    Case("generate-query-empty-tensor", gen(CTX, torch.zeros(0, dtype=torch.long)), ValueError,
         ("query is empty", "at least one query token")),
    Case("generate-query-blank-str", gen("some text", "   "), ValueError, ("query is empty", "pass a question")),
    Case("generate-context-negative-id", gen(torch.tensor([3, -1, 4]), QRY), ValueError,
         ("context holds token id -1", "index 1", "vocab_size = 256")),
    Case("generate-context-id-out-of-vocab", gen(torch.tensor([3, 256]), QRY), ValueError,
         ("context holds token id 256", "[0, 256)", "model.config.vocab_size")),
    Case("generate-query-id-out-of-vocab", gen(CTX, torch.tensor([1, 2, 99999])), ValueError,
         ("query holds token id 99999", "model's own tokenizer")),
    Case("generate-tokenizer-out-of-vocab", lambda: _wide_engine().generate("ab", "c?"), ValueError,
         ("context holds token id", "tokenizer does not match the model")),
    Case("generate-str-without-tokenizer",
         lambda: magnetar.Engine(_engine().model, _engine().config, _engine().groups).generate("a", "b"),
         ValueError, ("need a tokenizer", "tokenizer=")),
    # -- Engine.generate: options ------------------------------------------------------------------------------
    Case("max-new-tokens-0", gen(CTX, QRY, max_new_tokens=0), ValueError, ("max_new_tokens", ">= 1", "0")),
    Case("max-new-tokens-negative", gen(CTX, QRY, max_new_tokens=-1), ValueError, ("max_new_tokens", "-1")),
    Case("max-new-tokens-bool", gen(CTX, QRY, max_new_tokens=True), ValueError, ("max_new_tokens", "int", "bool")),
    Case("max-new-tokens-float", gen(CTX, QRY, max_new_tokens=2.5), ValueError, ("max_new_tokens", "float 2.5")),
    Case("max-new-tokens-str", gen(CTX, QRY, max_new_tokens="8"), ValueError, ("max_new_tokens", "str '8'")),
    Case("max-new-tokens-none", gen(CTX, QRY, max_new_tokens=None), ValueError, ("max_new_tokens", "NoneType")),
    Case("max-new-tokens-over-positions", gen(CTX, QRY, max_new_tokens=1010), ValueError,
         ("max_new_tokens (1010)", "1024 positions", "lower max_new_tokens to at most 1001",
          "shorten the context by at least 9")),
    Case("max-new-tokens-huge", gen(CTX, QRY, max_new_tokens=10**9), ValueError,
         ("max_new_tokens (1000000000)", "lower max_new_tokens to at most 1001")),
    Case("context-over-positions", gen(torch.zeros(1030, dtype=torch.long), QRY, max_new_tokens=4), ValueError,
         ("context (1030)", "1024 positions", "shorten the context by at least 13")),
    # issue 28: a text far past the positions is refused from a prefix (tests/test_template.py), lone surrogates
    Case("context-str-far-over-positions", gen("x" * 20_000_000, "q?"), ValueError,
         ("context: too long for the model's 1024 positions", "characters")),
    Case("context-lone-surrogate", gen("ab\ud800cd", "q?"), ValueError, ("context holds a lone surrogate", "U+D800",
                                                                       "index 2")),
    Case("query-lone-surrogate", gen("abc", "q\udfff?"), ValueError, ("query holds a lone surrogate", "U+DFFF")),
    Case("stop-bare-str", gen(CTX, QRY, stop="\n"), ValueError, ("stop must be a list of strings", "stop=['\\n']")),
    Case("stop-int-item", gen(CTX, QRY, stop=["a", 3]), ValueError, ("stop[1]", "non-empty str", "int 3")),
    Case("stop-empty-str", gen(CTX, QRY, stop=[""]), ValueError, ("stop[0]", "non-empty str")),
    Case("stop-set", gen(CTX, QRY, stop={"a"}), ValueError, ("stop", "list of strings", "set")),
    Case("return-logits-str", gen(CTX, QRY, return_logits="yes"), ValueError, ("return_logits", "True or False")),
    Case("return-logits-int", gen(CTX, QRY, return_logits=1), ValueError, ("return_logits", "int 1")),
    # -- Engine.generate_batch ----------------------------------------------------------------------------------
    Case("batch-empty", lambda: _engine().generate_batch([]), ValueError, ("at least one (context, query)",)),
    Case("batch-not-a-list", lambda: _engine().generate_batch(5), ValueError, ("requests", "list of (context, query)")),
    Case("batch-str", lambda: _engine().generate_batch("context"), ValueError, ("requests", "str 'context'")),
    Case("batch-flat-pair", lambda: _engine().generate_batch((CTX, QRY)), ValueError,
         ("requests[0]", "(context, query) pair", "generate_batch([(context, query)])")),
    Case("batch-triple", lambda: _engine().generate_batch([(CTX, QRY, QRY)]), ValueError,
         ("requests[0]", "a tuple of 3")),
    Case("batch-bad-second-query", lambda: _engine().generate_batch([(CTX, QRY), (CTX, 1.5)]), ValueError,
         ("requests[1] query", "float 1.5")),
    # -- Engine.score / score_variants --------------------------------------------------------------------------
    Case("score-continuation-one-token", lambda: _engine().score(CTX, torch.tensor([1])), ValueError,
         ("continuation has 1 token", "at least 2")),
    Case("score-continuation-int", lambda: _engine().score(CTX, 5), ValueError, ("continuation", "int 5")),
    Case("score-context-float", lambda: _engine().score(CTX.float(), QRY), ValueError,
         ("context is a torch.float32 tensor",)),
    Case("score-continuation-out-of-vocab", lambda: _engine().score(CTX, torch.tensor([1, 300])), ValueError,
         ("continuation holds token id 300", "vocab_size = 256")),
    Case("score-context-empty", lambda: _engine().score(torch.zeros(0, dtype=torch.long), QRY), ValueError,
         ("context is empty",)),
    Case("score-variants-bare-config", lambda: _engine().score_variants(CTX, QRY, SparseConfig()), ValueError,
         ("sparse must be a list", "[variant]")),
    Case("score-variants-dict", lambda: _engine().score_variants(CTX, QRY, [{"sparse_policy": "oracle_topk"}]),
         ValueError, ("sparse[0]", "SparseConfig(**d)")),
    Case("score-variants-empty", lambda: _engine().score_variants(CTX, QRY, []), ValueError,
         ("sparse is empty", "None for dense")),
    # -- init_inference -----------------------------------------------------------------------------------------
    Case("init-model-int", lambda: magnetar.init_inference(5), ValueError, ("model must be", "local model folder")),
    Case("init-model-none", lambda: magnetar.init_inference(None), ValueError, ("model must be", "NoneType")),
    Case("init-model-missing-path", lambda: magnetar.init_inference("/no/such/model"), FileNotFoundError,
         ("'/no/such/model'", "config.json")),
    Case("init-model-missing-bytes-path", lambda: magnetar.init_inference(b"/no/such/model"), FileNotFoundError,
         ("'/no/such/model'",)),
    Case("init-config-dict", lambda: magnetar.init_inference(_model(), {"method": "dense"}), ValueError,
         ("config must be an EngineConfig", "EngineConfig.from_dict")),
    Case("init-unknown-flat-field", lambda: magnetar.init_inference(_model(), no_such_field=1), ValueError,
         ("unknown config field 'no_such_field'",)),
    Case("init-tokenizer-not-callable", lambda: magnetar.init_inference(_model(), tokenizer="gpt2"), ValueError,
         ("tokenizer must be", "callable")),
    Case("init-groups-wrong-type", lambda: magnetar.init_inference(_model(), groups=1), ValueError,
         ("groups must be a ParallelGroups", "init_groups")),
    Case("init-groups-cp-size-mismatch",
         lambda: magnetar.init_inference(_model(), method="star", cp_size=2, groups=local_groups()), ValueError,
         ("groups.cp_size (1)", "cp_size 2")),
    # -- attention_with_lse and the backend registry ------------------------------------------------------------
    Case("attn-q-3d", attn(q=Q[0]), ValueError, ("q must be 4-D", "(B, Hq, Sq, D)")),
    Case("attn-k-list", attn(k=[1.0]), ValueError, ("k must be a torch.Tensor",)),
    Case("attn-batch-mismatch", attn(q=torch.randn(2, 4, 2, 8)), ValueError, ("batch sizes differ",)),
    Case("attn-head-dim-mismatch", attn(q=torch.randn(1, 4, 2, 16)), ValueError, ("head dims differ", "D=16")),
    Case("attn-heads-not-divisible", attn(q=torch.randn(1, 3, 2, 8)), ValueError, ("Hq=3", "multiple of KV heads")),
    Case("attn-int-dtype", attn(q=Q.long(), k=K.long(), v=K.long()), ValueError, ("dtype torch.int64",)),
    Case("attn-dtype-mismatch", attn(k=K.half(), v=K.half()), ValueError, ("share a dtype", "cast k and v")),
    Case("attn-head-dim-zero", lambda: attention_with_lse(Q[..., :0], K[..., :0], K[..., :0]), ValueError,
         ("head dimension D", "is 0", "D >= 1")),
    Case("attn-q-pos-length", attn(q_pos=torch.arange(3)), ValueError, ("q_pos has 3 positions",)),
    Case("attn-k-pos-strings", attn(k_pos=["a"] * 5), ValueError, ("k_pos must be a tensor of integer positions",)),
    Case("attn-scale-zero", attn(scale=0.0), ValueError, ("scale must be a finite float > 0",)),
    Case("attn-scale-nan", attn(scale=float("nan")), ValueError, ("scale", "nan")),
    Case("attn-scale-str", attn(scale="0.1"), ValueError, ("scale must be a float", "str")),
    Case("attn-window-zero", attn(window=0), ValueError, ("window=0", "window >= 1")),
    Case("attn-window-float", attn(window=2.5), ValueError, ("window must be an int", "float 2.5")),
    Case("attn-window-without-causal", attn(window=4, causal=False), ValueError, ("needs causal=True",)),
    Case("attn-causal-str", attn(causal="false"), ValueError, ("causal must be True or False",)),
    Case("attn-unknown-backend", attn(backend="flash"), ValueError, ("unknown attention backend 'flash'", "tiled")),
    Case("attn-backend-not-str", attn(backend=None), ValueError, ("unknown attention backend None", "'auto'")),
    Case("register-backend-auto", lambda: register_backend("auto", object), ValueError, ("name", "other than 'auto'")),
    Case("register-backend-not-callable", lambda: register_backend("mine", 3), ValueError, ("factory", "callable")),
    Case("explain-not-a-call", lambda: explain((Q, K, K)), ValueError, ("call must be", "AttentionCall")),
    # -- merge_states -------------------------------------------------------------------------------------------
    Case("merge-empty", lambda: merge_states([], []), ValueError, ("outs is empty", "at least one")),
    Case("merge-not-a-list", lambda: merge_states(3, 3), ValueError, ("outs must be a list of tensors",)),
    Case("merge-item-not-tensor", lambda: merge_states([OUT, 1.0], [LSE, LSE]), ValueError,
         ("outs[1] must be a torch.Tensor",)),
    Case("merge-shapes-differ", lambda: merge_states([OUT, torch.zeros(1, 2, 3, 5)], [LSE, LSE]), ValueError,
         ("outs[1] is (1, 2, 3, 5)", "one shape")),
    Case("merge-lse-shape", lambda: merge_states([OUT], [torch.zeros(1, 2, 4)]), ValueError, ("lses must have shape",)),
    Case("merge-lse-int", lambda: merge_states([OUT], [LSE.long()], backend="torch"), ValueError,
         ("lses must be a floating dtype", "torch.int64")),
    Case("merge-outs-int", lambda: merge_states([OUT.long()], [LSE]), ValueError, ("outs must be a floating dtype",)),
    Case("merge-unknown-backend", lambda: merge_states([OUT], [LSE], backend="cuda"), ValueError,
         ("backend must be one of",)),
    Case("merge-torch-unstacked", lambda: merge_states_torch(OUT, LSE), ValueError, ("stacked (N, B, H, S, D)",)),
    # -- ring_attention (local checks; a group of one) ----------------------------------------------------------
    Case("ring-q-3d", ring(q=Q[0]), ValueError, ("ring_attention", "q must be 4-D")),
    Case("ring-head-dim-mismatch", ring(k=torch.randn(1, 2, 5, 16), v=torch.randn(1, 2, 5, 16)), ValueError,
         ("ring_attention", "head dims differ")),
    Case("ring-k-pos-missing", ring(k_pos=None), ValueError, ("ring_attention: k_pos is required",)),
    Case("ring-k-pos-float", ring(k_pos=torch.arange(5.0)), ValueError, ("ring_attention: k_pos", "integer positions")),
    Case("ring-q-pos-length", ring(q_pos=torch.arange(3)), ValueError, ("ring_attention: q_pos has 3 positions",)),
    Case("ring-group-wrong-type", ring(group="cp"), ValueError, ("group must be a torch.distributed ProcessGroup",)),
    Case("ring-timeout-seconds", ring(timeout=60), ValueError, ("timeout must be a datetime.timedelta",)),
    Case("ring-scale-negative", ring(scale=-1.0), ValueError, ("ring_attention: scale",)),
    # -- init_groups / rank_layout / local_groups ---------------------------------------------------------------
    Case("groups-cp-size-0", lambda: init_groups(0), ValueError, ("cp_size must be >= 1", "ranks sharing one")),
    Case("groups-cp-size-negative", lambda: init_groups(-2), ValueError, ("cp_size must be >= 1", "-2")),
    Case("groups-cp-size-bool", lambda: init_groups(True), ValueError, ("cp_size must be an int", "bool True")),
    Case("groups-cp-size-float-whole", lambda: init_groups(1.0), ValueError, ("cp_size must be an int", "float 1.0")),
    Case("groups-cp-size-float", lambda: rank_layout(4, 2.5), ValueError, ("cp_size must be an int", "2.5")),
    Case("groups-cp-size-str", lambda: init_groups("2"), ValueError, ("cp_size must be an int", "str '2'")),
    Case("groups-world-size-str", lambda: rank_layout("4", 2), ValueError, ("world_size must be an int",)),
    Case("groups-not-dividing", lambda: rank_layout(6, 4), ValueError,
         ("world size 6 is not divisible by cp_size 4", "[1, 2, 3, 6]")),
    Case("groups-tp-size-0", lambda: init_groups(1, tp_size=0), ValueError, ("tp_size must be >= 1",)),
    Case("groups-tp-size-bool", lambda: init_groups(1, tp_size=True), ValueError, ("tp_size must be an int", "bool")),
    Case("groups-tp-size-float", lambda: rank_layout(4, 1, 2.5), ValueError, ("tp_size must be an int", "2.5")),
    Case("groups-tp-cp-not-dividing", lambda: rank_layout(8, 3, 2), ValueError,
         ("world size 8", "cp_size 3 x tp_size 2 = 6", "tp_size x cp_size x dp_size", "[1, 2, 4]")),
    Case("groups-tp-without-distributed", lambda: init_groups(1, tp_size=2), ValueError,
         ("tp_size=2 needs torch.distributed",)),
    Case("init-tp-size-2", lambda: magnetar.init_inference(_model(), method="dense", tp_size=2), ValueError,
         ("tp_size=2 needs torch.distributed", "launch with `deepspeed` or `torchrun`")),
    Case("init-tp-size-3-heads", lambda: magnetar.init_inference(_model(), method="dense", tp_size=3), ValueError,
         ("tp_size 3 does not divide the model's", "KV heads", "choose tp_size from")),
    Case("groups-without-distributed", lambda: init_groups(2), ValueError, ("cp_size=2 needs torch.distributed",)),
    Case("groups-timeout-seconds", lambda: init_groups(1, timeout=30), ValueError,
         ("timeout must be a datetime.timedelta", "int 30")),
    Case("local-groups-timeout-float", lambda: local_groups(timeout=30.0), ValueError,
         ("timeout must be a datetime.timedelta",)),
]


def test_case_ids_are_unique():
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input_gets_a_clear_error(case: Case):
    with pytest.raises(case.error) as excinfo:
        case.call()
    assert type(excinfo.value) not in FORBIDDEN, f"bare {type(excinfo.value).__name__}: {excinfo.value}"
    message = str(excinfo.value)
    for name in case.names:
        assert name in message, f"{case.id}: {name!r} not in the message: {message}"


def test_good_inputs_of_the_accepted_forms_still_run():
    """The forms the checks let through: a (1, N) id tensor, an int32 tensor, a stop tuple, string prompts."""
    eng = _engine()
    a = eng.generate(CTX, QRY, max_new_tokens=2)
    b = eng.generate(CTX.view(1, -1).int(), QRY.view(1, -1), max_new_tokens=2, stop=("zz",))
    assert a.token_ids == b.token_ids
    assert eng.generate("some context", "a question?", max_new_tokens=1).context_tokens == len("some context")
    assert len(eng.score_variants(CTX, QRY, (None,))) == 1
    assert rank_layout(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert init_groups(1, timeout=timedelta(seconds=5)).cp_size == 1
    cfg = EngineConfig.create(method="dense")
    assert magnetar.init_inference(_model(), cfg, deepspeed_inference=False).config.method == "dense"
