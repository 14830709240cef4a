"""Per-request generation parameters (magnetar/engine/sampling.py): token choice against transformers' own
warpers, per-request seeding, stop reasons and their precedence, streamed text deltas, bad parameters."""
from __future__ import annotations

import functools

import pytest
import torch

from magnetar.config import DecodeConfig
from magnetar.engine.inputs import MAX_STOP_CHARS, MAX_STOP_STRINGS
from magnetar.engine.sampling import RequestSampler, SamplingParams, StopStrings, TextDeltas
from tests.conftest import assert_close
from tests.tiny_models import tiny_model

V = 258  # the test tokenizer's vocabulary: 256 bytes and the merges "ST", "OP"


@functools.cache
def byte_tokenizer():
    """A byte-level BPE tokenizer (the one tests/tiny_models.save_tiny saves) with two merges, so that "STOP" is
    the two tokens "ST" + "OP"; every other character is one token per UTF-8 byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)} | {"ST": 256, "OP": 257}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("S", "T"), ("O", "P")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def ids_of(text: str) -> list[int]:
    return byte_tokenizer()(text, add_special_tokens=False)["input_ids"]


class CharTokenizer:
    """Not a transformers tokenizer: one id per character (code point mod 256), decode only."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def step_logits(step: int, vocab: int = V) -> torch.Tensor:
    """Fixed logits of decode step ``step`` (the same for every request: only the generators may differ)."""
    return 2.0 * torch.randn(vocab, generator=torch.Generator().manual_seed(1000 + step))


# -- choosing tokens --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax(dtype):
    sampler = RequestSampler(SamplingParams(max_new_tokens=20), vocab_size=V)
    for step in range(20):
        logits = step_logits(step).to(dtype)
        assert sampler.choose(logits) == int(torch.argmax(logits))
    assert sampler.stop_reason == "max_new_tokens"


def test_top_k_1_sampling_is_greedy():
    sampler = RequestSampler(SamplingParams(max_new_tokens=30, temperature=1.7, top_k=1, seed=3), vocab_size=V)
    assert [sampler.choose(step_logits(s)) for s in range(30)] == [int(step_logits(s).argmax()) for s in range(30)]


def _run_batch(order: list[int], params: list[SamplingParams], steps: int) -> list[list[int]]:
    """Requests b = 0..2 decoded together, each step calling their samplers in ``order``; the samplers are also
    created in that order, after an unrelated sampler has drawn, and the global RNG is reseeded per order."""
    torch.manual_seed(len(order) + order[0])
    other = RequestSampler(SamplingParams(temperature=1.0, seed=0), vocab_size=V)
    other.choose(step_logits(99))
    samplers = {b: RequestSampler(params[b], vocab_size=V) for b in order}
    for step in range(steps):
        for b in order:
            samplers[b].choose(step_logits(step))
    return [samplers[b].token_ids for b in range(len(params))]


def test_sampled_tokens_do_not_depend_on_the_batch():
    """A request's tokens depend on its seed only: not on its position in the batch, the other requests, the
    order the samplers are created or called in, nor the global RNG -- the same as the request alone."""
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_new_tokens=12),
              SamplingParams(temperature=1.2, top_k=40, seed=5, max_new_tokens=12),
              SamplingParams(temperature=0.9, top_p=0.95, seed=6, max_new_tokens=12)]
    a = _run_batch([0, 1, 2], params, 12)
    b = _run_batch([2, 0, 1], params, 12)
    assert a == b
    for i, p in enumerate(params):  # each request alone, as a lone generate would decode it
        lone = RequestSampler(p, vocab_size=V)
        assert [lone.choose(step_logits(s)) for s in range(12)] == a[i]
    assert a[0] != a[2], "another seed must draw other tokens, or the test cannot fail"
    state = torch.get_rng_state()
    RequestSampler(params[0], vocab_size=V).choose(step_logits(0))
    assert torch.equal(torch.get_rng_state(), state), "sampling must not draw from the global RNG"


def test_sampling_is_deterministic_per_seed():
    p = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=11, max_new_tokens=16)
    runs = []
    for _ in range(2):
        s = RequestSampler(p, vocab_size=V)
        runs.append([s.choose(step_logits(i)) for i in range(16)])
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 1, "the draws must vary from step to step"


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (0.8, 0, 0.9), (1.3, 10, 0.8),
                                                     (1.0, 0, 0.5), (0.5, 300, 0.95)])
def test_filtering_equals_transformers_generate(temperature, top_k, top_p):
    """Our scores after the warpers equal those of HF's generate (do_sample) for the same raw logits: the same
    tokens filtered to -inf, the same values elsewhere."""
    model = tiny_model("llama", seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)  # logits spread over a few units, so top-p keeps some tokens, not all
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    out = model.generate(ids, do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=1,
                         output_scores=True, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    raw, theirs = out.logits[0][0], out.scores[0][0]
    ours = RequestSampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p),
                          vocab_size=256).process(raw)
    kept = int(torch.isfinite(theirs).sum())
    assert 1 < kept <= 256 and (kept < 256 or (top_k == 0 and top_p == 1.0)), f"a filter must act: {kept} kept"
    assert_close(ours, theirs, what="logits", msg=f"T {temperature}, top_k {top_k}, top_p {top_p}")


def _hf_scores(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """transformers' warpers for one row, as generate chains them (the reference of warp_rows)."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = logits.float()[None]
    if p.temperature != 1.0:
        scores = TemperatureLogitsWarper(p.temperature)(None, scores)
    if p.top_k:
        scores = TopKLogitsWarper(top_k=p.top_k, min_tokens_to_keep=1)(None, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(top_p=p.top_p, min_tokens_to_keep=1)(None, scores)
    return scores[0]


def test_warp_rows_equals_each_rows_transformers_warpers():
    """A batch whose rows have their own temperature / top-k / top-p (or none) is filtered row by row exactly as
    transformers' warpers filter each row alone: the same -inf entries, the same values elsewhere."""
    from magnetar.engine.sampling import warp_rows

    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=5),
              SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=1.3, top_k=10, top_p=0.8),
              SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=0.5, top_k=300, top_p=0.95),
              SamplingParams(temperature=1.0, top_k=1)]
    logits = torch.stack([step_logits(s) for s in range(len(params))])
    ours = warp_rows(logits, params)
    for i, p in enumerate(params):
        theirs = _hf_scores(logits[i], p)
        assert torch.equal(torch.isinf(ours[i]), torch.isinf(theirs)), f"row {i} ({p}): other tokens filtered"
        assert_close(ours[i], theirs, what="logits", msg=f"row {i}")
    kept = torch.isfinite(ours).sum(dim=-1).tolist()
    assert kept[0] == V and kept[1] == 5 and kept[6] == 1 and all(k < V for k in kept[2:6]) and kept[2] > 1, kept


def test_sampled_draws_follow_the_filtered_distribution():
    """The exponential race draws from softmax of the warped scores: 6000 draws of one request over fixed logits
    (temperature 0.8, top-k 5 of 8) against those probabilities (chi-square); the filtered tokens never."""
    from scipy.stats import chisquare

    logits = torch.tensor([2.0, 1.5, 1.0, 0.7, 0.2, -0.5, -1.0, 0.1])
    p = SamplingParams(temperature=0.8, top_k=5, seed=4, max_new_tokens=6000)
    s = RequestSampler(p, vocab_size=8)
    draws = torch.tensor([s.choose(logits) for _ in range(6000)])
    counts = torch.bincount(draws, minlength=8).double()
    probs = torch.softmax(_hf_scores(logits, p), dim=-1).double()
    assert counts[probs == 0].sum() == 0, f"a filtered token was drawn: {counts.tolist()}"
    keep = probs > 0

    def expected(p):  # summing to the draws exactly, as chisquare asks
        return (p[keep] / p[keep].sum() * counts.sum()).numpy()

    stat = chisquare(counts[keep].numpy(), expected(probs))
    assert stat.pvalue > 1e-3, f"draws {counts.tolist()} against {(probs * 6000).tolist()}: p = {stat.pvalue:.2g}"
    untempered = torch.softmax(torch.where(keep, logits, float("-inf")), dim=-1).double()
    assert chisquare(counts[keep].numpy(), expected(untempered)).pvalue < 1e-3, \
        "the test must tell the temperature's distribution from the raw one"


def test_a_batchs_draws_equal_each_request_alone():
    """sample_rows over a batch (in any order) draws for each row what that request's choose draws alone: every row
    takes its numbers from its own generator."""
    from magnetar.engine.sampling import sample_rows

    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=5), SamplingParams(temperature=1.2, top_k=40, seed=5),
              SamplingParams(temperature=0.9, top_p=0.95, seed=6)]
    alone = []
    for p in params:
        lone = RequestSampler(p, vocab_size=V)
        alone.append([lone.choose(step_logits(s)) for s in range(10)])
    for order in ([0, 1, 2], [2, 0, 1]):
        samplers = {b: RequestSampler(params[b], vocab_size=V) for b in order}
        got = {b: [] for b in order}
        for step in range(10):
            rows = torch.stack([step_logits(step)] * len(order))
            tokens, ok = sample_rows(rows, [samplers[b] for b in order])
            assert ok.all()
            for b, t in zip(order, tokens.tolist()):
                got[b].append(t)
        assert [got[b] for b in range(3)] == alone, order
    assert alone[0] != alone[2]


def test_sampling_refuses_non_finite_logits():
    sampler = RequestSampler(SamplingParams(temperature=1.0), vocab_size=4)
    for bad in (torch.tensor([0.0, float("nan"), 1.0, 2.0]), torch.full((4,), float("-inf")),
                torch.tensor([0.0, float("inf"), 1.0, 2.0])):
        with pytest.raises(ValueError, match="logits hold NaN or \\+inf"):
            sampler.choose(bad)
    assert sampler.token_ids == []


# -- stop reasons -----------------------------------------------------------------------------------------
def _feed(sampler: RequestSampler, ids: list[int]) -> list:
    reasons = []
    for t in ids:
        sampler.record(t)
        reasons.append(sampler.stop_reason)
    return reasons


def test_stop_reasons():
    tok = byte_tokenizer()
    eos = ids_of("!")[0]
    assert ids_of("go STOP") == ids_of("go ") + [256, 257]  # the stop string spans the two tokens ST, OP
    # eos
    s = RequestSampler(SamplingParams(max_new_tokens=10), vocab_size=V, eos_ids=[eos], tokenizer=tok)
    assert _feed(s, ids_of("hi!")) == [None, None, "eos"]
    assert s.text() == "hi"
    # a stop string across two tokens, and one ("TO") that overhangs both of them
    for stop in ("STOP", "TO"):
        s = RequestSampler(SamplingParams(max_new_tokens=10, stop=[stop, "zzz"]), vocab_size=V, tokenizer=tok)
        assert _feed(s, ids_of("go STOP")) == [None] * 4 + ["stop_string"]
        assert s.text() == ("go " if stop == "STOP" else "go S")
    # a multi-byte stop string, one byte per token
    s = RequestSampler(SamplingParams(stop=("日本",)), vocab_size=V, tokenizer=tok)
    reasons = _feed(s, ids_of("café 日本"))
    assert reasons[-1] == "stop_string" and reasons[:-1] == [None] * (len(reasons) - 1)
    # max_new_tokens
    s = RequestSampler(SamplingParams(max_new_tokens=3, stop=["STOP"]), vocab_size=V, eos_ids=[eos], tokenizer=tok)
    assert _feed(s, ids_of("abc")) == [None, None, "max_new_tokens"]
    with pytest.raises(RuntimeError, match="already stopped \\(max_new_tokens\\)"):
        s.record(ids_of("d")[0])


def test_stop_reason_precedence_eos_stop_string_max():
    tok = byte_tokenizer()
    # the last token is EOS, completes a stop string and reaches max_new_tokens: eos
    s = RequestSampler(SamplingParams(max_new_tokens=2, stop=["STOP"]), vocab_size=V, eos_ids=[257], tokenizer=tok)
    assert _feed(s, [256, 257]) == [None, "eos"]
    # a stop string completed at the max_new_tokens-th token: stop_string
    s = RequestSampler(SamplingParams(max_new_tokens=2, stop=["STOP"]), vocab_size=V, eos_ids=[0], tokenizer=tok)
    assert _feed(s, [256, 257]) == [None, "stop_string"]


def test_stop_strings_of_a_tokenizer_without_vocabulary():
    """Any tokenizer with decode: the stop string is looked for in the decoded text."""
    s = RequestSampler(SamplingParams(stop=["zz"]), vocab_size=256, tokenizer=CharTokenizer())
    assert _feed(s, [ord(c) for c in "a zz"]) == [None, None, None, "stop_string"]
    assert s.text() == "a "


class CountingTokenizer(CharTokenizer):
    """Records every decode call's length; any other use of the tokenizer fails the test."""

    def __init__(self):
        self.decoded: list[int] = []

    def decode(self, ids, skip_special_tokens=True):
        self.decoded.append(len(ids))
        return super().decode(ids, skip_special_tokens)

    def __getattr__(self, name):
        raise AssertionError(f"stop strings must not read the tokenizer's {name} (a vocabulary scan)")


def test_stop_strings_cost_nothing_up_front_and_decode_a_bounded_tail():
    """Issue 28: stop strings used to be transformers' StopStringCriteria, which walks the whole vocabulary per
    stop string when a request starts (64 strings stalled the engine loop for 25 s on SmolLM2). Now nothing is
    read up front, and each token decodes only the tail a stop string can end in -- yet a stop string is found
    after a long answer, across tokens and inside a multi-byte character."""
    tok = CountingTokenizer()
    stops = [f"stop-{i}" for i in range(MAX_STOP_STRINGS - 1)] + ["日本"]
    s = RequestSampler(SamplingParams(max_new_tokens=5000, stop=stops), vocab_size=2**16, tokenizer=tok)
    assert tok.decoded == [], "building the stop criteria decoded something"
    text = "x " * 1000 + "a stop-7"
    reasons = _feed(s, [ord(c) for c in text])
    assert reasons[-1] == "stop_string" and set(reasons[:-1]) == {None}
    window = max(len(x.encode()) for x in stops) + 8
    assert max(tok.decoded) == window and len(tok.decoded) == len(text), "a decode longer than the tail"
    # byte tokens: the stop string is found at the byte that completes its last character
    bt = byte_tokenizer()
    crit = StopStrings(bt, ("日本",))
    ids = ids_of("abc 日本 d")
    hits = [bool(crit(torch.tensor([ids[:n]]))[0]) for n in range(1, len(ids) + 1)]
    assert hits.index(True) == len(ids_of("abc 日本")) - 1


def test_choose_records_the_token():
    s = RequestSampler(SamplingParams(max_new_tokens=2, temperature=1.0, seed=1), vocab_size=V)
    first = s.choose(step_logits(0))
    second = s.choose(step_logits(1))
    assert s.token_ids == [first, second] and s.stop_reason == "max_new_tokens"
    with pytest.raises(RuntimeError, match="already stopped"):
        s.choose(step_logits(2))


# -- streaming --------------------------------------------------------------------------------------------
def _stream(text: str, *, stop=(), eos_ids=()) -> tuple[list[str], str]:
    """The deltas of ``text``'s tokens pushed one by one, and the finish() delta."""
    deltas = TextDeltas(byte_tokenizer(), stop=stop, eos_ids=eos_ids)
    return [deltas.push(t) for t in ids_of(text)], deltas.finish()


def test_text_deltas_join_to_the_decoded_text():
    text = "naïve café 日本語 ok\nsecond line"
    pushed, last = _stream(text)
    assert "".join(pushed) + last == byte_tokenizer().decode(ids_of(text)) == text
    for i, d in enumerate(pushed + [last]):
        assert "\ufffd" not in d, f"delta {i} {d!r} ends inside a multi-byte character"
    # TextStreamer's rule: whole words, a whole line at a newline, CJK characters at once
    assert pushed[len(ids_of("naïve caf")) - 1] == ""  # nothing of the unfinished word
    assert "".join(pushed[: len(ids_of("naïve café 日"))]) == "naïve café 日"
    assert "".join(pushed[: len(ids_of("naïve café 日本語 ok\n"))]) == "naïve café 日本語 ok\n"
    assert last == "line"


def test_text_deltas_never_show_text_past_a_stop_string():
    text = "naïve café 日本語 ok"
    pushed, last = _stream(text, stop=["日本"])
    assert "".join(pushed) + last == "naïve café "
    assert "".join(pushed[: len(ids_of("naïve café 日"))]) == "naïve café ", "the start of the stop is held back"
    assert last == ""
    # text that may begin a stop string is held back until a later token decides, then shown
    pushed, last = _stream("a b d b c e", stop=["b c"])
    shown = ["".join(pushed[:n]) for n in range(1, len(pushed) + 1)]
    assert shown[len(ids_of("a b ")) - 1] == "a "
    assert shown[len(ids_of("a b d ")) - 1] == "a b d "
    assert shown[-1] + last == "a b d "
    # an unfinished prefix of a stop string at the end is text after all
    pushed, last = _stream("x ST", stop=["STOP"])
    assert "".join(pushed) + last == "x ST"


def test_text_deltas_equal_the_sampler_text():
    tok = byte_tokenizer()
    eos = ids_of("!")[0]
    for text, stop in (("one two! three", ()), ("go STOP now", ("STOP",)), ("ab", ("b",))):
        s = RequestSampler(SamplingParams(stop=stop), vocab_size=V, eos_ids=[eos], tokenizer=tok)
        deltas = TextDeltas(tok, stop=stop, eos_ids=[eos])
        pieces = []
        for t in ids_of(text):
            s.record(t)
            pieces.append(deltas.push(t))
            if s.stop_reason:
                break
        pieces.append(deltas.finish())
        assert "".join(pieces) == s.text(), text


@pytest.mark.model
def test_real_tokenizer_stop_strings_and_deltas(smollm2_tokenizer):
    """SmolLM2's byte-level BPE: tokens that hold parts of UTF-8 characters, a newline stop string inside a run of
    newline tokens, a special EOS token."""
    tok = smollm2_tokenizer
    ids = tok("Naïve café: 日本語 ok.\n\nQuestion: 2+2?<|im_end|>", add_special_tokens=False)["input_ids"]
    cases = {(): ("eos", "Naïve café: 日本語 ok.\n\nQuestion: 2+2?"),
             ("\n\n",): ("stop_string", "Naïve café: 日本語 ok."),
             ("Question:", "zz"): ("stop_string", "Naïve café: 日本語 ok.\n\n"),
             ("ok.\n",): ("stop_string", "Naïve café: 日本語 ")}
    for stop, (reason, text) in cases.items():
        s = RequestSampler(SamplingParams(stop=stop, max_new_tokens=100), vocab_size=len(tok),
                           eos_ids=[tok.eos_token_id], tokenizer=tok)
        deltas = TextDeltas(tok, stop=stop, eos_ids=[tok.eos_token_id])
        pieces = []
        for t in ids:
            s.record(t)
            pieces.append(deltas.push(t))
            if s.stop_reason:
                break
        pieces.append(deltas.finish())
        assert (s.stop_reason, s.text(), "".join(pieces)) == (reason, text, text), stop
        assert not any("\ufffd" in p for p in pieces)


# -- parameters -------------------------------------------------------------------------------------------
def test_params_defaults_from_decode_config_and_replace():
    p = SamplingParams.from_decode_config(DecodeConfig(temperature=0.5, top_k=7, top_p=0.8, seed=9),
                                          max_new_tokens=5, stop=["\n"])
    assert p == SamplingParams(max_new_tokens=5, temperature=0.5, top_k=7, top_p=0.8, seed=9, stop=("\n",))
    assert SamplingParams.from_decode_config(DecodeConfig()).greedy
    q = p.replace(temperature=0, stop=None)
    assert q.greedy and q.stop == () and q.seed == 9
    assert SamplingParams(temperature=1, top_p=1).temperature == 1.0 and isinstance(p.replace(top_p=1).top_p, float)
    import numpy as np

    n = SamplingParams(top_k=np.int64(3), temperature=np.float32(0.5), seed=np.int32(2))
    assert type(n.top_k) is int and type(n.temperature) is float and type(n.seed) is int


BAD_PARAMS = [
    (dict(max_new_tokens=0), "max_new_tokens", ">= 1"),
    (dict(max_new_tokens=True), "max_new_tokens", "bool"),
    (dict(max_new_tokens=2.5), "max_new_tokens", "float 2.5"),
    (dict(max_new_tokens=2**63), "max_new_tokens", "2**63"),
    (dict(temperature=-0.1), "temperature", ">= 1e-05"),
    (dict(temperature=1e-9), "temperature", "0 (greedy)"),
    (dict(temperature=float("nan")), "temperature", "finite"),
    (dict(temperature=float("inf")), "temperature", "finite"),
    (dict(temperature=True), "temperature", "bool"),
    (dict(temperature="0.7"), "temperature", "str '0.7'"),
    (dict(top_p=0.0), "top_p", "(0, 1]"),
    (dict(top_p=1.5), "top_p", "(0, 1]"),
    (dict(top_p=float("nan")), "top_p", "finite"),
    (dict(top_k=-1), "top_k", ">= 0"),
    (dict(top_k=2.5), "top_k", "nothing is rounded"),
    (dict(top_k=False), "top_k", "bool"),
    (dict(seed=-1), "seed", "[0, 2**63)"),
    (dict(seed=2**63), "seed", "[0, 2**63)"),
    (dict(seed=10**5000), "seed", "bits"),
    (dict(seed=1.0), "seed", "nothing is rounded"),
    (dict(stop="\n"), "stop", "wrap it"),
    (dict(stop=[""]), "stop[0]", "non-empty"),
    (dict(stop=["a", 3]), "stop[1]", "int 3"),
    (dict(stop={"a"}), "stop", "set"),
    (dict(stop=["x"] * (MAX_STOP_STRINGS + 1)), "stop", f"at most {MAX_STOP_STRINGS}"),
    (dict(stop=["a", "x" * (MAX_STOP_CHARS + 1)]), "stop[1]", f"at most {MAX_STOP_CHARS}"),
]


@pytest.mark.parametrize("kwargs,field,fragment", BAD_PARAMS,
                         ids=[f"{i}-{field}-{fragment}" for i, (_, field, fragment) in enumerate(BAD_PARAMS)])
def test_bad_params_name_the_field(kwargs, field, fragment):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert str(e.value).startswith(field) and fragment in str(e.value), str(e.value)
    with pytest.raises(ValueError) as e:  # replace validates the same way
        SamplingParams().replace(**kwargs)
    assert str(e.value).startswith(field), str(e.value)


def test_bad_sampler_arguments_name_the_argument():
    tok = byte_tokenizer()
    cases = [
        (lambda: SamplingParams().replace(topk=1), "no field 'topk'"),
        (lambda: SamplingParams.from_decode_config({"temperature": 1.0}), "cfg must be a magnetar.config.DecodeConfig"),
        (lambda: RequestSampler({"temperature": 1.0}, vocab_size=V), "params must be a SamplingParams"),
        (lambda: RequestSampler(SamplingParams(), vocab_size=0), "vocab_size must be an int >= 1"),
        (lambda: RequestSampler(SamplingParams(), vocab_size=True), "vocab_size must be an int >= 1"),
        (lambda: RequestSampler(SamplingParams(), vocab_size=V, eos_ids=2), "eos_ids must be a list"),
        (lambda: RequestSampler(SamplingParams(), vocab_size=V, eos_ids=[-1]), "eos_ids[0] must be a token id"),
        (lambda: RequestSampler(SamplingParams(), vocab_size=V, eos_ids=[1, "2"]), "eos_ids[1] must be a token id"),
        (lambda: RequestSampler(SamplingParams(stop=["x"]), vocab_size=V), "stop ['x'] needs a tokenizer"),
        (lambda: RequestSampler(SamplingParams(), vocab_size=V, tokenizer="gpt2"), "tokenizer must be None or"),
        (lambda: RequestSampler(SamplingParams(), vocab_size=V).choose(torch.zeros(V + 1)), "logits must have shape"),
        (lambda: RequestSampler(SamplingParams(), vocab_size=V).choose(torch.zeros(1, V)), "logits must have shape"),
        (lambda: RequestSampler(SamplingParams(), vocab_size=V).choose(torch.zeros(V, dtype=torch.long)),
         "logits must be a float tensor"),
        (lambda: RequestSampler(SamplingParams(), vocab_size=V).choose([0.0] * V), "logits must be a float tensor"),
        (lambda: RequestSampler(SamplingParams(), vocab_size=V).record(V), "token must be a token id"),
        (lambda: RequestSampler(SamplingParams(), vocab_size=V).record(True), "token must be a token id"),
        (lambda: TextDeltas(tok, stop="x"), "stop must be a list of strings"),
        (lambda: TextDeltas(None), "tokenizer must be a tokenizer"),
        (lambda: TextDeltas(tok, skip_special_tokens=1), "skip_special_tokens must be True or False"),
        (lambda: TextDeltas(tok, eos_ids=[1.0]), "eos_ids must be a list or tuple of int"),
        (lambda: TextDeltas(tok).push(3.0), "token_id must be an int"),
    ]
    for call, fragment in cases:
        with pytest.raises(ValueError) as e:
            call()
        assert fragment in str(e.value), f"{fragment!r} not in {e.value}"
