"""Packaging: the PEP 621 metadata, the install-time prebuild of the fused ops (``DS_BUILD_MAGNETAR_OPS=1``), the
loader's prebuilt-first choice, and the op report ``python -m magnetar.ops``.

One test builds a real wheel with the CPU merge op prebuilt (one C++ compile, about a minute) and imports it; the
loader's decisions for stale, mismatched or broken prebuilds are checked with a stand-in module and no compiler.
"""
from __future__ import annotations

import importlib
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import tomllib
import types
import zipfile
from pathlib import Path

import pytest
import torch
from packaging.specifiers import SpecifierSet

import magnetar
from magnetar.ops import op_builder
from magnetar.ops.jit import LazyOp
from magnetar.ops.op_builder import ALL_OPS, BUILD_ALL_VAR, MergeStatesBuilder, prebuild_plan, prebuilt_record
from tests.conftest import assert_close

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
EXTRAS = {"test", "models", "gemma", "eval", "gpu", "mpi", "serve"}


def _clean_env(**extra) -> dict:
    """This process's environment without any DS_BUILD_MAGNETAR_* flag, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DS_BUILD_MAGNETAR_")}
    return dict(env, **extra)


def _python(code: str, **env) -> subprocess.CompletedProcess:
    """``python -c code`` in the repository, in :func:`_clean_env` (plus ``env``), its output captured."""
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_clean_env(**env), capture_output=True,
                          text=True, timeout=120)


# ------------------------------------------------------------------------------------------------- metadata


def test_pyproject_metadata():
    project = PYPROJECT["project"]
    assert project["name"] == "magnetar"
    assert project["dynamic"] == ["version"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "magnetar.version.__version__"}
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    license_text = (REPO / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text  # the full text, not a stub
    assert project["requires-python"] == ">=3.11"  # what the suite runs on (and transformers 5.x needs)
    assert SpecifierSet(project["requires-python"]).contains(platform.python_version())
    deps = project["dependencies"]
    assert "deepspeed>=0.19.8,<0.20" in deps
    assert not any(d.split(">")[0].split("=")[0].split("<")[0].strip() == "torch" for d in deps), \
        "torch must not be an install requirement (an unpinned torch pulls a multi-GB CUDA wheel)"
    assert set(project["optional-dependencies"]) == EXTRAS
    assert "Programming Language :: Python :: 3.11" in project["classifiers"]


def test_console_scripts_resolve():
    scripts = PYPROJECT["project"]["scripts"]
    assert set(scripts) == {"magnetar-demo", "magnetar-run", "magnetar-ops-demo", "magnetar-eval", "magnetar-bench",
                            "magnetar-calibrate", "magnetar"}
    for name, target in scripts.items():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func)), f"{name} -> {target}"


def test_plain_setup_needs_no_torch():
    """Without DS_BUILD_MAGNETAR_* setup.py builds nothing and imports neither torch nor DeepSpeed (pip's isolated
    build has neither); asking for a prebuild there fails with the fix in the message."""
    code = ("import sys\n"
            "sys.modules['torch'] = sys.modules['deepspeed'] = None  # importing either raises ImportError\n"
            "sys.argv = ['setup.py', '--version']\n"
            "import runpy; runpy.run_path('setup.py', run_name='__main__')\n")
    res = _python(code)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip().splitlines()[-1] == magnetar.__version__
    res = _python(code, **{BUILD_ALL_VAR: "1"})
    assert res.returncode != 0
    assert "--no-build-isolation" in res.stderr and "torch" in res.stderr, res.stderr


def test_import_magnetar_imports_no_torch_until_a_name_is_used():
    """``import magnetar``, ``magnetar --help``, ``magnetar serve|run|eval|bench|calibrate|demo|ops-demo --help``
    and a bad flag of theirs come without torch or transformers: the package's names load when first used, those
    commands' flags import no engine."""
    code = ("import sys, magnetar\n"
            "assert 'torch' not in sys.modules, 'import magnetar imported torch'\n"
            "from magnetar.commands import main\n"
            "assert main(['--help']) == 0 and 'torch' not in sys.modules\n"
            "import contextlib, io\n"
            "with contextlib.redirect_stdout(io.StringIO()) as said:\n"
            "    assert main(['--version']) == 0\n"
            "assert said.getvalue().startswith('magnetar ' + magnetar.__version__ + ' (Python ') and 'torch ' in "
            "said.getvalue(), said.getvalue()\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'magnetar --version'\n"
            "for argv, code in ((['serve', '--help'], 0), (['serve', '--model', 'm', '--port', '99999'], 2),\n"
            "                   (['run', '--help'], 0), (['run', '--model', 'm', '--no-such-flag'], 2),\n"
            "                   (['eval', '--help'], 0), (['eval', '--methods', 'nope', '--model', 'm'], 2),\n"
            "                   (['bench', '--help'], 0), (['bench', '--methods', 'nope', '--model', 'm'], 2),\n"
            "                   (['calibrate', '--help'], 0), (['calibrate', 'indexer', '--help'], 0),\n"
            "                   (['calibrate', 'spotlight', '--out', 'h.pt', '--bits', 'many'], 2),\n"
            "                   (['demo', '--help'], 0), (['demo', '--context-tokens', '0'], 2),\n"
            "                   (['ops-demo', '--help'], 0), (['ops-demo', '--seq-len', '0'], 2)):\n"
            "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            "        try:\n            main(argv)\n            got = 'returned'\n"
            "        except SystemExit as e:\n            got = e.code\n"
            "    assert got == code, (argv, got)\n"
            "    assert 'torch' not in sys.modules and 'transformers' not in sys.modules, argv\n"
            "assert 'init_inference' in dir(magnetar) and set(magnetar.__all__) == {'__version__', *magnetar._LAZY}\n"
            "from magnetar import Engine, merge_states\n"
            "import magnetar.engine, magnetar.ops\n"
            "assert Engine is magnetar.engine.Engine and magnetar.merge_states is magnetar.ops.merge_states\n"
            "assert magnetar.sparse.__name__ == 'magnetar.sparse'  # a subpackage, as an attribute\n"
            "try:\n    magnetar.no_such_name\nexcept AttributeError as e:\n    assert 'no_such_name' in str(e)\n"
            "else:\n    raise SystemExit('no AttributeError')\n")
    res = _python(code)
    assert res.returncode == 0, res.stdout + res.stderr


# ------------------------------------------------------------------------------------ which ops get prebuilt


def test_prebuild_plan_follows_deepspeed_flags():
    compatible = {name: cls().is_compatible() for name, cls in ALL_OPS.items()}
    assert prebuild_plan({}) == [] and prebuild_plan({BUILD_ALL_VAR: "0"}) == []

    plan = prebuild_plan({BUILD_ALL_VAR: "1"})
    assert [b.NAME for b, _ in plan] == list(ALL_OPS)
    for builder, skipped in plan:  # incompatible ops are skipped with the reason, the rest are built
        assert (skipped is None) == compatible[builder.NAME], (builder.NAME, skipped)
        if skipped is not None:
            assert skipped == builder.error_log and skipped

    # an op's own flag overrides DS_BUILD_MAGNETAR_OPS, both ways
    names = [b.NAME for b, _ in prebuild_plan({BUILD_ALL_VAR: "1", MergeStatesBuilder.BUILD_VAR: "0"})]
    assert "magnetar_merge_states" not in names and "magnetar_hamming" in names
    assert [b.NAME for b, _ in prebuild_plan({"DS_BUILD_MAGNETAR_HAMMING": "1"})] == ["magnetar_hamming"]

    with pytest.raises(ValueError, match="DS_BUILD_MAGNETAR_OPS='yes'.*1.*0"):
        prebuild_plan({BUILD_ALL_VAR: "yes"})
    if not compatible["magnetar_merge_states_cuda"]:  # asked for by name but impossible here: an error, not a skip
        with pytest.raises(ValueError, match="DS_BUILD_MAGNETAR_MERGE_STATES_CUDA=1 .*cannot be built here"):
            prebuild_plan({"DS_BUILD_MAGNETAR_MERGE_STATES_CUDA": "1"})


# ------------------------------------------------------------- the loader: prebuilt first, JIT as the fallback


class _StandIn(MergeStatesBuilder):
    """The CPU merge builder with its prebuilt module replaced by ``module_name`` and its JIT build by a stub."""

    def __init__(self, module_name: str, jit_module):
        super().__init__()
        self.module_name, self.jit_module, self.jit_calls = module_name, jit_module, 0

    def absolute_name(self):
        return self.module_name

    def jit_load(self, verbose=False):
        self.jit_calls += 1
        return self.jit_module


def _merge_module(tag: str):
    return types.SimpleNamespace(merge_states=lambda outs, lses: tag)


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """A usable prebuild of a stand-in module recorded in a temporary record; tests spoil one thing each."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))  # the JIT path's lock directory
    monkeypatch.setattr(op_builder, "PREBUILT_RECORD", tmp_path / "prebuilt_ops.json")
    name = "magnetar_test_prebuilt_merge_op"
    monkeypatch.setitem(sys.modules, name, _merge_module("prebuilt"))
    builder = _StandIn(name, _merge_module("jit"))
    record = prebuilt_record([builder])

    def load(record_text=None):
        op_builder.PREBUILT_RECORD.write_text(json.dumps(record) if record_text is None else record_text)
        module = LazyOp("test merge", lambda dtype: builder, ("merge_states",)).load("cpu")
        return module.merge_states(None, None)

    return builder, record, load


def test_loader_prefers_a_usable_prebuild(stand_in, caplog):
    builder, record, load = stand_in
    assert record["ops"]["magnetar_merge_states"]["module"] == builder.module_name
    assert record["torch"] == str(torch.__version__)
    with caplog.at_level(logging.WARNING):
        assert load() == "prebuilt"
    assert builder.jit_calls == 0 and not caplog.records
    assert builder.prebuilt_status().usable
    assert builder.load() is sys.modules[builder.module_name]  # DeepSpeed's entry point makes the same choice


@pytest.mark.parametrize("spoil,reason", [
    (lambda r: r.update(torch="1.0.0+other"), "prebuilt against torch 1.0.0\\+other, running torch"),
    (lambda r: r["ops"]["magnetar_merge_states"].update(sources_sha256="0" * 64), "other sources than"),
    (lambda r: r["ops"]["magnetar_merge_states"].update(module="magnetar.ops.elsewhere"), "recorded as module"),
    (lambda r: r.update(format=99), "not a format-1 prebuilt-ops record"),
])
def test_loader_jit_builds_instead_of_an_unusable_prebuild(stand_in, caplog, spoil, reason):
    builder, record, load = stand_in
    spoil(record)
    with caplog.at_level(logging.WARNING, logger="magnetar.ops.op_builder"):
        assert load() == "jit"
    assert builder.jit_calls == 1
    warnings = [r.getMessage() for r in caplog.records if r.name == "magnetar.ops.op_builder"]
    assert len(warnings) == 1 and "JIT-built instead" in warnings[0], warnings
    assert re.search(reason, warnings[0]), warnings[0]
    assert not builder.prebuilt_status().usable


def test_loader_jit_builds_on_a_broken_record_or_module(stand_in, caplog):
    builder, _, load = stand_in
    with caplog.at_level(logging.WARNING, logger="magnetar.ops.op_builder"):
        assert load("{not json") == "jit"
        sys.modules.pop(builder.module_name)  # recorded and usable on paper, but the module is gone
        assert load() == "jit"
    warnings = [r.getMessage() for r in caplog.records if r.name == "magnetar.ops.op_builder"]
    assert len(warnings) == 2, warnings
    assert "is not valid JSON" in warnings[0] and str(op_builder.PREBUILT_RECORD) in warnings[0]
    assert f"importing {builder.module_name} failed: ModuleNotFoundError" in warnings[1]
    assert builder.jit_calls == 2


def test_loader_without_a_record_jit_builds_quietly(stand_in, caplog):
    builder, record, load = stand_in
    with caplog.at_level(logging.WARNING):
        assert load(json.dumps(dict(record, ops={}))) == "jit"
        op_builder.PREBUILT_RECORD.unlink()
        module = LazyOp("test merge", lambda dtype: builder, ("merge_states",)).load("cpu")
        assert module.merge_states(None, None) == "jit"
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    status = builder.prebuilt_status()
    assert not status.recorded and BUILD_ALL_VAR in status.reason


# ------------------------------------------------------------------------------------------------ the report


def test_op_report_rows_and_table(tmp_path, monkeypatch, capsys):
    from magnetar.ops.__main__ import main, op_rows

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    hamming = ALL_OPS["magnetar_hamming"]().name  # a JIT build of this checkout's Hamming op, as torch names it
    from torch.utils.cpp_extension import LIB_EXT

    (tmp_path / hamming).mkdir()
    (tmp_path / hamming / f"{hamming}{LIB_EXT}").write_bytes(b"")
    rows = {r.op: r for r in op_rows()}
    assert list(rows) == list(ALL_OPS) == ["magnetar_merge_states", "magnetar_merge_states_cuda", "magnetar_hamming",
                                           "magnetar_hamming_cuda", "magnetar_sparse_attention",
                                           "magnetar_decode_attention", "magnetar_small_gemm",
                                           "magnetar_rms_norm", "magnetar_rotary",
                                           "magnetar_amx_attention"]
    for name, row in rows.items():
        assert row.device == ("cuda" if name.endswith("_cuda") else "cpu")
        assert row.jit_cached == (name == "magnetar_hamming"), row
        if not op_builder.PREBUILT_RECORD.is_file():
            assert not row.prebuilt, "no prebuild is usable without a record"
        if row.device == "cpu":
            assert row.compatible, row  # a C++ compiler is required wherever the suite runs
        elif not torch.cuda.is_available():
            assert not row.compatible and any(n.startswith("incompatible:") and "CUDA" in n for n in row.notes), row
    assert main([]) == 0
    out = capsys.readouterr().out
    for name in ALL_OPS:
        assert name in out
    assert "compatible  prebuilt  JIT-cached" in out
    assert f"torch .................. {torch.__version__}" in out
    assert f"torch extensions dir ... {tmp_path}" in out
    assert f"JIT build: {tmp_path / hamming}" in out


def test_op_report_json_cli():
    res = subprocess.run([sys.executable, "-m", "magnetar.ops", "--json"], cwd=REPO, env=_clean_env(),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)  # stdout is the report alone (DeepSpeed's log lines go to stderr)
    assert [r["op"] for r in report["ops"]] == list(ALL_OPS)
    assert all(isinstance(r[k], bool) for r in report["ops"] for k in ("compatible", "prebuilt", "jit_cached"))
    assert report["environment"]["torch"] == str(torch.__version__)
    import deepspeed

    assert report["environment"]["deepspeed"] == deepspeed.__version__
    # what auto picks for a bf16 decode call here, with cpu_decode's pass named (MAGNETAR_DECODE_AVX512=0: AVX2)
    from tests.test_cpu_decode import HAS_AVX512_BF16, RUNS

    if RUNS and not torch.cuda.is_available():
        avx512 = HAS_AVX512_BF16 and os.environ.get("MAGNETAR_DECODE_AVX512") != "0"
        assert (f"decode: cpu_decode ({'AVX-512 BF16' if avx512 else 'AVX2'} pass)"
                in report["environment"]["attention (auto)"]), report["environment"]["attention (auto)"]
        assert report["environment"]["attention (auto)"].endswith("a decode step's pages: cpu_decode")
    res = subprocess.run([sys.executable, "-m", "magnetar.ops", "--bogus"], cwd=REPO, env=_clean_env(),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "python -m magnetar.ops: error: unrecognized arguments: --bogus" in res.stderr


# ------------------------------------------------------------------- a real prebuild: wheel, install, import


def test_wheel_with_the_prebuilt_merge_op_is_imported_not_jit_built(tmp_path):
    """``DS_BUILD_MAGNETAR_MERGE_STATES=1 pip wheel --no-build-isolation`` of a copy of this checkout: the wheel
    holds the compiled op and its record; unpacked (what ``pip install`` does) the loader imports it, with no
    JIT build, and it merges like the torch reference."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "magnetar", src / "magnetar", ignore=shutil.ignore_patterns(
        "__pycache__", "*.so", "prebuilt_ops.json"))
    env = _clean_env(**{MergeStatesBuilder.BUILD_VAR: "1", "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")})
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                          str(tmp_path / "dist"), str(src)], env=env, capture_output=True, text=True, timeout=540)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    (wheel,) = (tmp_path / "dist").glob("magnetar-*.whl")
    assert "py3-none-any" not in wheel.name, "a wheel with a compiled op is platform-specific"
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        record = json.loads(z.read("magnetar/ops/prebuilt_ops.json"))
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        z.extractall(tmp_path / "site")
    assert any(n.startswith("magnetar/ops/magnetar_merge_states_op.") and n.endswith(".so") for n in names), names
    assert {f"magnetar/ops/csrc/{p.name}" for p in (REPO / "magnetar/ops/csrc").iterdir()} <= set(names)
    assert list(record["ops"]) == ["magnetar_merge_states"] and record["torch"] == str(torch.__version__)
    for line in ("License-Expression: Apache-2.0", "Requires-Dist: deepspeed<0.20,>=0.19.8",
                 f"Version: {magnetar.__version__}"):
        assert line in metadata.splitlines(), line

    code = ("import json, torch\n"
            "from magnetar.ops import fused_merge\n"
            "from magnetar.ops.__main__ import op_rows\n"
            "from magnetar.ops.merge import merge_states_torch\n"
            "g = torch.Generator().manual_seed(0)\n"
            "outs, lses = torch.randn(3, 2, 4, 5, 16, generator=g), torch.randn(3, 2, 4, 5, generator=g)\n"
            "lses[1, 0, 0] = float('-inf')\n"
            "out, lse = fused_merge.fused_merge_states(outs, lses)\n"
            "ref_out, ref_lse = merge_states_torch(outs, lses)\n"
            "torch.save(dict(out=out, lse=lse, ref_out=ref_out, ref_lse=ref_lse), 'merged.pt')\n"
            "print(json.dumps(dict(file=fused_merge.load_fused_merge_op('cpu').__file__,\n"
            "                      prebuilt={r.op: r.prebuilt for r in op_rows()})))\n")
    site = tmp_path / "site"
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env=dict(env, PYTHONPATH=str(site), MAGNETAR_VERBOSE_BUILD="1"))
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert Path(result["file"]).parent == site / "magnetar" / "ops", result["file"]
    assert result["prebuilt"] == {name: name == "magnetar_merge_states" for name in ALL_OPS}
    assert not (tmp_path / "ext").exists() or not any((tmp_path / "ext").rglob("*.so")), "nothing was JIT-built"
    merged = torch.load(tmp_path / "merged.pt")
    assert_close(merged["out"], merged["ref_out"], what="same_computation", msg="prebuilt op out")
    assert_close(merged["lse"], merged["ref_lse"], what="same_computation", msg="prebuilt op lse")
