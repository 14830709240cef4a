"""Per-request generation parameters: choosing the next token, deciding when to stop, streaming text.

* :class:`SamplingParams` -- one request's parameters (``max_new_tokens``, ``temperature``, ``top_p``,
  ``top_k``, ``seed``, ``stop``), validated when built.
* :class:`RequestSampler` -- one per request: its own ``torch.Generator`` seeded with ``params.seed`` (so the
  tokens a request samples never depend on its position in a batch or on the other requests), the token
  history, the choice of the next token (temperature, top-k, top-p as transformers' logits warpers apply them)
  and the stop decision.
* :func:`sample_rows` -- a batch's sampled tokens drawn together on the logits' device, each row with its own
  request's parameters and generator, without reading the device (issue 47: sampling on the device); a request's
  :meth:`RequestSampler.choose` draws through it too, so its tokens are the same alone or in a batch.
* :class:`TextDeltas` -- the text of a request as it grows, in deltas (transformers' ``TextStreamer``), never
  showing text past a stop string.

This module knows nothing about models, ranks or batches: the engine hands each request's logits to its
sampler on the rank that chooses, and the chosen token to the samplers of the ranks that follow.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from transformers.generation.stopping_criteria import StoppingCriteria
from transformers.generation.streamers import TextStreamer

from magnetar.config import DecodeConfig, FieldError, describe
from magnetar.engine.grammar import TokenMask
from magnetar.engine.inputs import check_max_new_tokens, check_stop, is_int
from magnetar.utils.sync import to_device

# The smallest temperature that samples: below it, logits of a few units divided by the temperature overflow
# float32 and softmax turns them into NaN (vLLM treats temperatures under 1e-5 as greedy; here they are refused).
MIN_TEMPERATURE = 1e-5
MAX_TOP_LOGPROBS = 20  # alternatives per token, at most (OpenAI's limit)
_MAX_INT = 2**63  # seeds go to torch.Generator.manual_seed, counts to int64 tensors (the ranks' agreement gather)


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """One request's generation parameters.

    * ``max_new_tokens``: an int >= 1, the most tokens generated.
    * ``temperature``: a finite number; 0 is greedy (argmax), else >= :data:`MIN_TEMPERATURE` samples from
      ``softmax(logits / temperature)``. With 0, ``top_k`` / ``top_p`` / ``seed`` are unused.
    * ``top_k``: an int >= 0, 0 = off; else only the ``top_k`` most likely tokens can be drawn.
    * ``top_p``: a number in (0, 1], 1 = off; else the smallest set of most likely tokens whose probability
      reaches ``top_p`` (nucleus sampling).
    * ``seed``: an int in [0, 2**63), the seed of the request's own generator.
    * ``stop``: stop strings, a list or tuple of non-empty ``str`` (stored as a tuple; None means none). A single
      ``str`` is refused rather than wrapped, as ``Engine.generate(stop=...)`` refuses it: pass ``stop=["\\n"]``.
    * ``logprobs``: None (none), or an int in 0..:data:`MAX_TOP_LOGPROBS`: each generated token's log-probability
      under the model (``log_softmax`` of the logits the sampler is given, before temperature and top-k/top-p)
      and that many most likely alternatives (``DecodeResult.logprobs``).
    * ``prompt_logprobs``: also the query tokens' log-probabilities (each given the context and the query
      before it; with ``logprobs`` alternatives), from the query's own forward (``DecodeResult.prompt_logprobs``).
    * ``grammar``: None, or an llguidance grammar the answer must follow (structured outputs: a JSON schema's,
      a regex's, a Lark grammar; :mod:`magnetar.engine.grammar`); the answer ends when it is complete.
    * ``ignore_eos``: True: an EOS token does not end the answer (it is kept in the token ids, dropped from the
      text); ``max_new_tokens``, a stop string or a complete grammar still do -- vLLM's extension, what
      throughput benchmarks send so that every server generates the same number of tokens.

    Every bad value is a ``ValueError`` naming the field and what to pass; nothing is coerced (a bool is not an
    int, 2.5 is not 2, NaN and inf are refused). numpy-style scalars become plain ``int`` / ``float``.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    logprobs: Optional[int] = None
    prompt_logprobs: bool = False
    grammar: Optional[str] = None
    ignore_eos: bool = False

    def __post_init__(self):
        check_max_new_tokens(self.max_new_tokens)
        _require(self.max_new_tokens < _MAX_INT, "max_new_tokens",
                 f"must be < 2**63, got {describe(self.max_new_tokens)}")
        _number("temperature", self.temperature, "0 for greedy or a temperature such as 0.7")
        _require(self.temperature == 0 or self.temperature >= MIN_TEMPERATURE, "temperature",
                 f"must be 0 (greedy) or >= {MIN_TEMPERATURE:g} (smaller ones overflow the scaled logits), "
                 f"got {self.temperature!r}")
        _number("top_p", self.top_p, "a number in (0, 1], 1 for off")
        _require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1] (1: off), got {self.top_p!r}")
        _integer("top_k", self.top_k, "an int >= 0 (0: off)")
        _integer("seed", self.seed, "an int in [0, 2**63)")
        check_stop(self.stop)
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, f"None or an int in 0..{MAX_TOP_LOGPROBS}")
            _require(self.logprobs <= MAX_TOP_LOGPROBS, "logprobs",
                     f"must be None or an int in 0..{MAX_TOP_LOGPROBS}, got {describe(self.logprobs)}")
        _require(isinstance(self.prompt_logprobs, bool), "prompt_logprobs",
                 f"must be True or False, got {describe(self.prompt_logprobs)}")
        _require(isinstance(self.ignore_eos, bool), "ignore_eos",
                 f"must be True or False, got {describe(self.ignore_eos)}")
        _require(self.grammar is None or isinstance(self.grammar, str), "grammar",
                 f"must be None or an llguidance grammar string (magnetar.engine.grammar), got "
                 f"{describe(self.grammar)}")
        stop = () if self.stop is None else tuple(self.stop)
        # plain Python numbers (numpy ones become them): the params are compared, hashed and made into tensors
        for name, value in (("max_new_tokens", int(self.max_new_tokens)), ("temperature", float(self.temperature)),
                            ("top_p", float(self.top_p)), ("top_k", int(self.top_k)), ("seed", int(self.seed)),
                            ("stop", stop)):
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_decode_config(cls, cfg: DecodeConfig, *, max_new_tokens: int = 64,
                           stop: Optional[Sequence[str]] = None) -> "SamplingParams":
        """The engine's defaults: ``cfg``'s temperature, top_k, top_p and seed, with these two per-call values."""
        if not isinstance(cfg, DecodeConfig):
            raise ValueError(f"cfg must be a magnetar.config.DecodeConfig (EngineConfig.decode), got {describe(cfg)}")
        return cls(max_new_tokens=max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                   seed=cfg.seed, stop=stop)

    def replace(self, **changes: Any) -> "SamplingParams":
        """A copy with ``changes`` (field=value), validated like a new one; an unknown field is a ValueError."""
        names = [f.name for f in dataclasses.fields(self)]
        for name in changes:
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"SamplingParams has no field {name!r} (fields: {', '.join(names)}){hint}")
        return dataclasses.replace(self, **changes)


def _require(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise FieldError(f"{name} {msg}", name)


def _number(name: str, value: Any, what: str) -> None:
    _require(isinstance(value, numbers.Real) and not isinstance(value, bool), name,
             f"must be {what}, got {describe(value)}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int too large for a float
        finite = False
    _require(finite, name, f"must be finite ({what}), got {describe(value)}")


def _integer(name: str, value: Any, what: str) -> None:
    rounded = isinstance(value, numbers.Real) and not isinstance(value, bool)
    _require(is_int(value), name, f"must be {what}, got {describe(value)}"
             + (" (write a whole number; nothing is rounded)" if rounded else ""))
    _require(0 <= value < _MAX_INT, name, f"must be {what}, got {describe(value)}")


# -- the stop criteria --------------------------------------------------------------------------------------
# Stop strings are looked for in the decoded text of the last tokens, as vLLM and SGLang detokenize to find them.
# transformers' StopStringCriteria was used before: it preprocesses the whole vocabulary once per stop string
# (~0.4 s for SmolLM2's 49k tokens), on the thread that runs the request -- a request with 64 stop strings
# stalled every rank's engine loop for 25 s. The decoded tail costs O(its length) per token and nothing up front.
_STOP_MARGIN = 8  # tokens decoded beyond the longest stop string's UTF-8 bytes (special tokens decode to nothing)


class StopStrings(StoppingCriteria):
    """True for a row when one of ``stop_strings`` occurs in ``tokenizer.decode(last ids, skip_special_tokens=
    True)``; called after every generated token (so a stop string is found at the token that completes it, also
    across token boundaries and inside a multi-byte character split over byte tokens). Only the last
    ``longest stop string's UTF-8 bytes + 8`` ids are decoded: every token but a special one adds at least a
    byte to the text, so a stop string that the newest token completes lies within them."""

    def __init__(self, tokenizer, stop_strings: Sequence[str]):
        self.tokenizer = tokenizer
        self.stop_strings = tuple(stop_strings)
        self.window = max(len(s.encode("utf-8", "surrogatepass")) for s in self.stop_strings) + _STOP_MARGIN

    def __call__(self, input_ids: torch.LongTensor, scores=None, **kwargs) -> torch.BoolTensor:
        done = []
        for row in input_ids:
            tail = self.tokenizer.decode(row[-self.window:].tolist(), skip_special_tokens=True)
            done.append(any(s in tail for s in self.stop_strings))
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` up to (without) the earliest occurrence of any stop string; all of it when none occurs."""
    ends = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[: min(ends)] if ends else text


# -- sampling rows on their device --------------------------------------------------------------------------
# transformers' warpers take one temperature / top-k / top-p for a whole batch, where the engine's batch mixes
# requests with their own: the same three steps run here row-wise, batched on the logits' device (their scores
# equal the warpers': tests/test_sampling.py), and the token is drawn by the exponential race -- the argmax of
# p / E, E ~ Exp(1) drawn from the request's own generator, is a draw from p (vLLM's sampler draws so) -- so a
# decode step samples every request without the host reading its logits.
NOTHING_TO_SAMPLE = ("logits hold NaN or +inf, or no finite value: nothing to sample from (runtime.check_finite "
                     "reports where non-finite logits come from)")


def warp_rows(logits: torch.Tensor, params: Sequence["SamplingParams"]) -> torch.Tensor:
    """``logits (N, V)`` in float32 after each row's temperature, then top-k, then top-p (``params[i]`` for row
    i, sampled ones), on their device: the values transformers' ``TemperatureLogitsWarper``,
    ``TopKLogitsWarper`` and ``TopPLogitsWarper`` (one token kept at least) give the row, ``-inf`` where they
    filter. Never reads the device."""
    scores = logits.float()
    n, v = scores.shape
    dev = scores.device
    if any(p.temperature != 1.0 for p in params):
        scores = scores / to_device(torch.tensor([[p.temperature] for p in params], dtype=torch.float32), dev)
    ks = [min(max(p.top_k, 1), v) if p.top_k else 0 for p in params]
    if any(ks):  # below the row's k-th largest value (ties at it kept)
        kth = torch.topk(scores, max(ks), dim=-1).values.gather(1, to_device(torch.tensor([[max(k, 1) - 1]
                                                                                            for k in ks]), dev))
        off = to_device(torch.tensor([[k == 0] for k in ks]), dev)
        scores = scores.masked_fill((scores < kth) & ~off, float("-inf"))
    if any(p.top_p < 1.0 for p in params):  # the least likely tokens whose mass is at most 1 - top_p
        ascending, order = torch.sort(scores, descending=False)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= to_device(torch.tensor([[1 - p.top_p] for p in params], dtype=torch.float32), dev)
        drop[..., -1:] = False
        drop &= to_device(torch.tensor([[p.top_p < 1.0] for p in params]), dev)
        scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return scores


def sample_rows(logits: torch.Tensor, samplers: Sequence["RequestSampler"]) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits (N, V)`` drawn from ``softmax(warp_rows(...))`` with ``samplers[i]``'s
    generator on the logits' device (each draws ``V`` numbers from its own generator: neither the other rows nor
    their order change a row's token), and whether each row could be sampled (False: NaN or +inf logits, or no
    finite one). Both stay on the device: nothing is read."""
    probs = warp_rows(logits, [s.params for s in samplers]).softmax(dim=-1)
    ok = torch.isfinite(probs).all(dim=-1)
    race = torch.empty_like(probs)
    for i, s in enumerate(samplers):
        race[i].exponential_(generator=s.generator_on(probs.device))
    return probs.div_(race.clamp_min_(torch.finfo(race.dtype).tiny)).argmax(dim=-1), ok


# -- one request --------------------------------------------------------------------------------------------
class RequestSampler:
    """One request's token choice and stop decision.

    ``vocab_size`` is the length of the model's logits (``model.config.vocab_size``); ``eos_ids`` (ints >= 0) end
    the request when generated; ``tokenizer`` (a transformers tokenizer, or any object with ``decode(ids,
    skip_special_tokens=True)``) is needed for stop strings and :meth:`text`.

    Each step, exactly one of two calls adds the step's token to the history: :meth:`choose` on the rank that
    chooses (it returns the token it records), :meth:`record` on the ranks that receive the chosen token (the
    broadcast). Both then update :attr:`stop_reason`; adding a token to a stopped request is a RuntimeError.
    The sampler draws from its own generator only, seeded with ``params.seed``: neither the global torch RNG nor
    other requests' samplers, nor the order in which they are called, change its tokens.
    """

    def __init__(self, params: SamplingParams, *, vocab_size: int, eos_ids: Sequence[int] = (), tokenizer=None):
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams (SamplingParams(temperature=..., ...) or "
                             f"SamplingParams.from_decode_config(config.decode)), got {describe(params)}")
        if not is_int(vocab_size) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an int >= 1 (model.config.vocab_size), got {describe(vocab_size)}")
        if not isinstance(eos_ids, (list, tuple)):
            raise ValueError(f"eos_ids must be a list or tuple of token ids, got {describe(eos_ids)}")
        for i, t in enumerate(eos_ids):  # one beyond the vocabulary (a tokenizer's) is never generated: harmless
            if not is_int(t) or not 0 <= t < _MAX_INT:
                raise ValueError(f"eos_ids[{i}] must be a token id, an int >= 0, got {describe(t)}")
        if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
            raise ValueError(f"tokenizer must be None or a tokenizer with .decode(ids), got {describe(tokenizer)}")
        if params.stop and tokenizer is None:
            raise ValueError(f"stop {list(params.stop)!r} needs a tokenizer to read the generated text: pass "
                             f"tokenizer=... (init_inference(model, config, tokenizer=...)) or no stop strings")
        self.params = params
        self.vocab_size = int(vocab_size)
        self.eos_ids = tuple(int(t) for t in eos_ids)
        self.tokenizer = tokenizer
        self._generators: dict[torch.device, torch.Generator] = {}  # per device, seeded with params.seed
        self._ids: list[int] = []
        self._stop_reason: Optional[str] = None
        self._stop = StopStrings(tokenizer, params.stop) if params.stop else None
        # the grammar's state, on every rank (the stop decision depends on it); it masks logits where one chooses
        self._mask = TokenMask(params.grammar, tokenizer, self.vocab_size, self.eos_ids) \
            if params.grammar is not None else None

    @property
    def token_ids(self) -> list[int]:
        """The generated tokens so far (a copy)."""
        return list(self._ids)

    @property
    def stop_reason(self) -> Optional[str]:
        """``"eos"`` (the last token is an EOS id), ``"stop_string"`` (a stop string appeared in the generated
        text; checked after every token), ``"grammar"`` (the request's grammar is complete), ``"max_new_tokens"``
        (that many were generated), in that precedence
        when several hold at once; None while the request goes on."""
        return self._stop_reason

    @property
    def device_choice(self) -> bool:
        """Whether the engine may choose this request's tokens with its batch's, on the device -- every request
        without a grammar: greedy ones by ``argmax``, sampled ones by :func:`sample_rows` (exactly :meth:`choose`'s
        choices), the token then given to :meth:`record`."""
        return self._mask is None

    def generator_on(self, device) -> torch.Generator:
        """This request's generator on ``device`` (made on first use, seeded with ``params.seed``): a seed draws
        the same tokens on every run on one kind of device, other ones on another (each has its own generator)."""
        device = torch.device(device)
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.params.seed)
        return self._generators[device]

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits (V,)`` (any float dtype, any device) after the warpers, on their device: float32, ``-inf``
        for the tokens top-k / top-p remove; unchanged values (as float32) for greedy requests."""
        self._check_logits(logits)
        scores = logits.detach().reshape(1, -1)
        return (scores.float() if self.params.greedy else warp_rows(scores, [self.params]))[0]

    def choose(self, logits: torch.Tensor) -> int:
        """The next token for ``logits (V,)`` of this request's last position, recorded in the history.

        Greedy: exactly ``int(torch.argmax(logits))`` (NaN logits are the engine's ``runtime.check_finite``
        to catch). Sampling: :func:`sample_rows` of this one row (the softmax of :meth:`process`'s scores, drawn
        with this request's generator on the logits' device); logits with NaN or +inf, or no finite entry, are a
        ValueError."""
        self._check_open()
        if self._mask is not None:  # the tokens the grammar does not allow next: -inf
            self._check_logits(logits)
            logits = self._mask.apply(logits)
        if self.params.greedy:
            self._check_logits(logits)
            token = int(torch.argmax(logits))
        else:
            self._check_logits(logits)
            tokens, ok = sample_rows(logits.detach().reshape(1, -1), [self])
            token, ok = torch.stack((tokens[0], ok[0].long())).tolist()
            if not ok:
                raise ValueError(NOTHING_TO_SAMPLE)
        self._add(token)
        return token

    def record(self, token: int) -> None:
        """Add ``token``, chosen on another rank, to the history (the ranks that do not call :meth:`choose`)."""
        self._check_open()
        if not is_int(token) or not 0 <= token < self.vocab_size:
            raise ValueError(f"token must be a token id, an int in [0, vocab_size={self.vocab_size}), "
                             f"got {describe(token)}")
        self._add(int(token))

    def text(self) -> str:
        """The generated text: the history without EOS ids, decoded with ``skip_special_tokens=True`` and cut at
        the first stop string (the stop string itself excluded); "" without a tokenizer."""
        if self.tokenizer is None:
            return ""
        ids = [t for t in self._ids if t not in self.eos_ids]
        return cut_at_stop(self.tokenizer.decode(ids, skip_special_tokens=True), self.params.stop)

    def _add(self, token: int) -> None:
        if self._mask is not None:
            self._mask.consume(token)
        self._ids.append(token)
        if token in self.eos_ids and not self.params.ignore_eos:  # what EosTokenCriteria decides, without a tensor
            self._stop_reason = "eos"
        elif self._stop is not None and bool(self._stop(torch.tensor([self._ids], dtype=torch.long), None)[0]):
            self._stop_reason = "stop_string"
        elif self._mask is not None and self._mask.done:
            self._stop_reason = "grammar"
        elif len(self._ids) >= self.params.max_new_tokens:
            self._stop_reason = "max_new_tokens"

    def _check_open(self) -> None:
        if self._stop_reason is not None:
            raise RuntimeError(f"this request already stopped ({self._stop_reason}) after {len(self._ids)} tokens; "
                               f"a finished request must leave the batch")

    def _check_logits(self, logits) -> None:
        if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
            raise ValueError(f"logits must be a float tensor (V,) of the request's last position, got "
                             f"{logits.dtype if isinstance(logits, torch.Tensor) else describe(logits)}")
        if tuple(logits.shape) != (self.vocab_size,):
            raise ValueError(f"logits must have shape ({self.vocab_size},) (vocab_size), got {tuple(logits.shape)}; "
                             f"pass one request's last position, e.g. logits[b, -1]")


# -- streaming ----------------------------------------------------------------------------------------------
class TextDeltas(TextStreamer):
    """A request's text in pieces as its tokens come: ``push(token_id)`` returns the new text (maybe ""),
    ``finish()`` the rest. The pieces joined equal :meth:`RequestSampler.text` of the same tokens (decoded in
    the pieces ``TextStreamer`` decodes: up to each newline).

    transformers' :class:`~transformers.generation.streamers.TextStreamer` decides what is final (the
    ``TextIteratorStreamer`` semantics): text up to the last space, a whole line at a newline, a CJK character
    at once; so a piece never ends in a word a later token may extend, nor inside a multi-byte character (its
    bytes decode to U+FFFD until complete, and that is never before a space). On top of it, with ``stop``
    strings, text that may begin a stop string is held back until the next token decides, and nothing from a
    stop string on is ever returned (later pushes return ""). EOS ids in ``eos_ids`` are dropped, as in
    :meth:`RequestSampler.text`.
    """

    def __init__(self, tokenizer, *, skip_special_tokens: bool = True, stop: Optional[Sequence[str]] = None,
                 eos_ids: Sequence[int] = ()):
        if not callable(getattr(tokenizer, "decode", None)):
            raise ValueError(f"tokenizer must be a tokenizer with .decode(ids), got {describe(tokenizer)}")
        if not isinstance(skip_special_tokens, bool):
            raise ValueError(f"skip_special_tokens must be True or False, got {describe(skip_special_tokens)}")
        check_stop(stop)
        if not isinstance(eos_ids, (list, tuple)) or not all(is_int(t) for t in eos_ids):
            raise ValueError(f"eos_ids must be a list or tuple of int token ids, got {describe(eos_ids)}")
        super().__init__(tokenizer, skip_prompt=False, skip_special_tokens=skip_special_tokens)
        self.stop = tuple(stop or ())
        self.eos_ids = frozenset(int(t) for t in eos_ids)
        self._final = ""  # the text TextStreamer has finalized
        self._sent = 0  # characters of it returned
        self._stopped = False  # a stop string was found: nothing more is returned
        self._finished = False

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self._final += text

    def push(self, token_id: int) -> str:
        """Add one generated token; returns the text that became final (maybe "")."""
        if self._finished:
            raise RuntimeError("TextDeltas.push after finish(): make a new TextDeltas for a new request")
        if not is_int(token_id):
            raise ValueError(f"token_id must be an int token id, got {describe(token_id)}")
        if int(token_id) not in self.eos_ids:
            self.put(torch.tensor([int(token_id)]))
        return self._release(end=False)

    def finish(self) -> str:
        """The rest of the text, when the request has ended."""
        if self._finished:
            return ""
        self._finished = True
        self.end()
        return self._release(end=True)

    def _release(self, end: bool) -> str:
        if self._stopped:
            return ""
        text, start = self._final, self._sent
        # a stop string starts at or after start: a suffix that could begin one was held back
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self._stopped = True
            upto = min(hits)
        elif end:
            upto = len(text)
        else:
            upto = len(text) - self._held(text, start)
        self._sent = upto
        return text[start:upto]

    def _held(self, text: str, start: int) -> int:
        """Length of the longest suffix of ``text[start:]`` that is a proper prefix of a stop string."""
        for k in range(min(len(text) - start, max((len(s) for s in self.stop), default=1) - 1), 0, -1):
            if any(s.startswith(text[-k:]) for s in self.stop):
                return k
        return 0
