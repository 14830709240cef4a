"""The checks every command line shares, made before a model is loaded: the length notation (``4k``), comma
lists of names, the engine config of the flags (``--cp-size`` from the launched world size), the attention
backend, ``--model`` and the files the config reads; and how benchmark-style flags (``--block-size`` ...) become
an :class:`~magnetar.config.EngineConfig`.

Below every CLI (``magnetar-run``, ``magnetar serve``, ``magnetar-eval``, ``magnetar-bench``,
``magnetar-calibrate``), so that none of them imports another; it knows methods only through
:data:`magnetar.config.METHODS`. Errors are ``ValueError`` / ``FileNotFoundError`` naming the flag
(:func:`magnetar.utils.cli.user_errors` prints them as ``PROG: error: MESSAGE``).
"""
from __future__ import annotations

import difflib
import re
from fractions import Fraction
from typing import Sequence

from magnetar.config import METHODS, EngineConfig
from magnetar.config.registry import METHOD_OPTIONS
from magnetar.utils.cli import check_input_file

# The model checks (magnetar.models: transformers) and the launcher's (torch) are imported where they run: building
# a command's parser, its --help and a bad flag's error import neither (magnetar serve --help).

__all__ = ["add_model_args", "load_tokenizer_arg",
           "engine_config", "parse_length", "parse_lengths", "parse_names", "check_attention_backend",
           "check_cp_size", "config_from_args", "check_engine_args"]

_LENGTH = re.compile(r"(\d{1,12}(?:\.\d*)?|\.\d{1,12})([km]?)")


def parse_length(text: str, minimum: int = 1) -> int:
    """``"4k"`` -> 4096, ``"1.5k"`` -> 1536, ``"1m"`` -> 1048576 (k = 1024 tokens), ``"3000"`` -> 3000.

    ValueError for anything that is not a whole number of tokens >= ``minimum`` (``"abc"``, ``"-5"``, ``"0"``,
    ``"1.3k"`` = 1331.2: nothing is rounded). ``minimum=0`` admits ``"0"``: the eval runner's "each task's own
    length" (wikisalad)."""
    m = _LENGTH.fullmatch(text.strip().lower()) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"length {text!r} is not a token count like 3000, 4k or 1.5k (k = 1024, m = 1024 * 1024)")
    tokens = Fraction(m.group(1)) * {"k": 1024, "m": 1024 * 1024, "": 1}[m.group(2)]
    if tokens.denominator != 1:
        raise ValueError(f"length {text!r} is {float(tokens):g} tokens, not a whole number; write e.g. "
                         f"{int(tokens)} or {int(tokens) + 1}")
    if tokens < minimum:
        raise ValueError(f"length {text!r} must be at least {minimum} token{'s' if minimum != 1 else ''}")
    return int(tokens)


def _items(text: str, flag: str) -> list[str]:
    parts = [p.strip() for p in text.split(",")]
    if not any(parts):
        raise ValueError(f"{flag} is empty; give a comma-separated list")
    if not all(parts):
        raise ValueError(f"{flag} {text!r} has an empty entry (two commas in a row, or one at an end)")
    return parts


def parse_lengths(text: str, flag: str = "--lengths", minimum: int = 1) -> list[int]:
    """``"2k,4k"`` -> ``[2048, 4096]``; ValueError naming ``flag`` for a bad, empty or repeated entry (each entry
    as :func:`parse_length` with ``minimum``)."""
    lengths = []
    for part in _items(text, flag):
        try:
            lengths.append(parse_length(part, minimum))
        except ValueError as e:
            raise ValueError(f"{flag}: {e}") from None
    repeated = sorted({x for x in lengths if lengths.count(x) > 1})
    if repeated:
        raise ValueError(f"{flag} {text!r} lists {repeated} more than once; give each length once")
    return lengths


def parse_links(text: str, flag: str = "--links") -> list[float]:
    """``"450,50"`` -> ``[450.0, 50.0]`` (link bandwidths in GB/s); ValueError naming ``flag`` for an entry that is
    not a finite number > 0."""
    links = []
    for part in text.split(","):
        try:
            g = float(part)
        except ValueError:
            g = float("nan")
        if not g > 0 or g == float("inf"):
            raise ValueError(f"{flag}: {part.strip()!r} is not a link bandwidth in GB/s (a number > 0, e.g. "
                             f"{flag} 450,50)")
        links.append(g)
    return links


def parse_names(text: str, options: Sequence[str], flag: str) -> list[str]:
    """``"dense,star"`` -> ``["dense", "star"]``, each one of ``options``; ValueError naming ``flag`` (and the
    nearest option) for an unknown, empty or repeated entry."""
    names = _items(text, flag)
    for name in names:
        if name not in options:
            close = difflib.get_close_matches(name, list(options), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{flag}: unknown {name!r}{hint} (choose from {', '.join(options)})")
    repeated = sorted({x for x in names if names.count(x) > 1})
    if repeated:
        raise ValueError(f"{flag} {text!r} lists {repeated} more than once; give each once")
    return names


def check_attention_backend(config: EngineConfig) -> None:
    """ValueError naming ``--attention-backend`` when the config's backend is not registered (checked before a
    model is loaded; the engine would only find out at its first attention call)."""
    from magnetar.ops.backends import list_backends

    name = config.runtime.attention_backend
    if name != "auto" and name not in list_backends():
        raise ValueError(f"--attention-backend: unknown attention backend {name!r}; choose 'auto' or one of "
                         f"{', '.join(list_backends())}")


def check_cp_size(cp_size: int, world_size: int, flag: str, tp_size: int = 1) -> None:
    """ValueError naming ``flag`` and ``WORLD_SIZE`` when ``cp_size`` ranks per context (each ``tp_size`` processes)
    do not divide the launched processes (world = tp_size x cp_size x data-parallel groups)."""
    if world_size % (cp_size * tp_size):
        per = world_size // tp_size if world_size % tp_size == 0 else 0
        divisors = [d for d in range(1, per + 1) if per % d == 0]
        with_tp = f" x --tp-size {tp_size} = {cp_size * tp_size}" if tp_size > 1 else ""
        hint = f"pass {flag} one of {divisors}" if divisors else f"choose a --tp-size that divides {world_size}"
        raise ValueError(f"{flag} {cp_size}{with_tp} does not divide the launched world size "
                         f"(WORLD_SIZE={world_size}): launch a multiple of {cp_size * tp_size} processes, or {hint}")


# the engine fields magnetar bench (and the cost model's CLI) take as flags, made from the config's own fields
ENGINE_FLAGS = ("block_size", "anchor_size", "halo_size", "halo_blocks", "exact_layers", "sink_size", "chunk_size",
                "summary_budget", "window_size", "attention_backend", "decode_step", "sparse_policy", "sparse_budget",
                "prefill_policy", "prefill_indexer_path", "prefill_indexer_random_init")


def engine_config(args, method: str, cp: int) -> EngineConfig:
    """The EngineConfig of ``method`` from the command line's engine options (``magnetar-bench`` and the cost
    model's CLI): ``cp`` ranks for the context-parallel methods, one for dense and streaming; ``--tp-size``
    (where the CLI has it) ranks share each one's weights."""
    # context_cache_mb 0: every timed request runs its Phase 1 (a cached context would skip it)
    flat = dict(method=method, cp_size=cp if METHODS[method].distributed else 1, dtype=args.dtype,
                tp_size=getattr(args, "tp_size", 1), context_cache_mb=0)
    for name in ENGINE_FLAGS:
        if name in METHOD_OPTIONS and method not in METHOD_OPTIONS[name][0]:
            continue  # another method's own option (the config refuses it elsewhere): one command compares them
        if getattr(args, name, None) is not None:
            flat[name] = getattr(args, name)
    return EngineConfig.create(**flat)


def config_from_args(args) -> EngineConfig:
    """The engine config of the flags; ``--cp-size`` defaults to the launched world size (any launcher:
    :func:`magnetar.parallel.launcher.launched_world_size`) over ``--tp-size`` for ring/star/pulsar, and
    ``--cp-size`` x ``--tp-size`` must divide it (unless ``--simulate true``: one process stands in for the ranks)."""
    config = EngineConfig.from_cli(args)
    from magnetar.parallel.launcher import launched_world_size

    world, tp = launched_world_size(), config.parallel.tp_size
    if args.cp_size is None and METHODS[config.method].distributed and world % tp == 0:
        config = config.replace(cp_size=world // tp)
    if not config.parallel.simulate:
        check_cp_size(config.parallel.cp_size, world, "--cp-size", tp_size=tp)
    check_attention_backend(config)
    return config


def add_model_args(p) -> None:
    """The flags naming the model (``magnetar-run``, ``magnetar serve``): ``--model``, ``--revision``,
    ``--trust-remote-code`` and ``--tokenizer`` (vLLM's: the tokenizer of another model or folder, e.g. for dummy
    weights)."""
    p.add_argument("--model", required=True, help="a magnetar.models name, a local HF directory or a Hub id org/name")
    p.add_argument("--revision", help="--model's Hub revision: a branch, tag or commit hash (default main)")
    p.add_argument("--trust-remote-code", action="store_true", help="let --model run its own modelling code")
    p.add_argument("--tokenizer", metavar="NAME|FOLDER",
                   help="read text with this tokenizer instead of --model's (a magnetar.models name, a folder holding "
                        "a tokenizer or a Hub id): e.g. --model dummy:llama-3.1-8b --tokenizer smollm2-135m-instruct")


def load_tokenizer_arg(args):
    """``--tokenizer``'s tokenizer (None when not given: the model's own)."""
    if getattr(args, "tokenizer", None) is None:
        return None
    from magnetar.models import load_tokenizer

    return load_tokenizer(args.tokenizer, trust_remote_code=args.trust_remote_code)


def check_engine_args(args) -> EngineConfig:
    """The engine config of the flags, ``--model``, ``--tokenizer`` and the files the config reads (``--hash-path``,
    ``--prefill-indexer-path``); ValueError / FileNotFoundError name the flag. Shared with ``magnetar serve``."""
    from magnetar.models import check_model, check_tokenizer
    from magnetar.models.dummy import check_text_model

    config = config_from_args(args)
    check_model(args.model, revision=args.revision)
    tokenizer = getattr(args, "tokenizer", None)
    if tokenizer is not None:
        check_tokenizer(tokenizer)
    check_text_model(args.model, tokenizer=tokenizer)
    for name in ("hash_path", "prefill_indexer_path"):
        path = getattr(config, name)
        if path is not None:
            check_input_file(path, flag="--" + name.replace("_", "-"))
    return config
