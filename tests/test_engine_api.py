"""Single-process engine tests: config, plan, prompt split, streaming, and the errors users see."""
from __future__ import annotations

import argparse
import copy
import json

import pytest
import torch

import magnetar
from magnetar.config import EngineConfig, add_cli_args
from magnetar.engine.engine import weight_bytes
from magnetar.engine.plan import assign_blocks, block_bounds, kept_token_count
from magnetar.engine.strategy import plan_rank
from tests.conftest import assert_close, assert_differs, repo_pythonpath
from tests.tiny_models import reference, tiny_model


# ------------------------------------------------------------------------------------------------- config
def test_config_flat_nested_file_and_cli(tmp_path):
    c = EngineConfig.create(method="pulsar", cp_size=4, scorer="bm25", block_size=128)
    assert (c.method, c.cp_size, c.scorer, c.block_size) == ("pulsar", 4, "bm25", 128)
    assert c.parallel.cp_size == 4 and c.pulsar.scorer == "bm25"
    nested = EngineConfig.from_dict({"method": "pulsar", "parallel": {"cp_size": 4}, "pulsar": {"scorer": "bm25"},
                                     "blocks": {"block_size": 128}})
    assert nested == c
    (tmp_path / "c.json").write_text(json.dumps(c.to_dict()))
    (tmp_path / "c.yaml").write_text("method: pulsar\ncp_size: 4\nscorer: bm25\nblock_size: 128\n")
    assert EngineConfig.from_file(tmp_path / "c.json") == c == EngineConfig.from_file(tmp_path / "c.yaml")
    args = add_cli_args(argparse.ArgumentParser()).parse_args(
        ["--config", str(tmp_path / "c.yaml"), "--summary-budget", "0.25", "--discard-summary-kv", "false"])
    cli = EngineConfig.from_cli(args)
    assert cli.summary_budget == 0.25 and cli.discard_summary_kv is False and cli.scorer == "bm25"
    with pytest.raises(dataclasses_frozen_error()):
        c.method = "dense"


def test_every_config_flag_says_what_its_field_is():
    """Each config flag's --help is the comment that documents its field in magnetar/config/sections.py, with the
    default: a field added without one fails here."""
    from magnetar.config.cli import field_help
    from magnetar.config.tree import FLAT_FIELDS, SECTIONS

    assert not [n for n, sec in FLAT_FIELDS.items() if not field_help(SECTIONS[sec]).get(n)]
    parser = add_cli_args(argparse.ArgumentParser())
    helps = {a.dest: a.help for a in parser._actions}
    assert helps["context_store_mb"].startswith("the store folder's bound") and "(default: 10240)" in \
        helps["context_store_mb"]
    assert "(default" not in helps["block_size"]  # None: the comment says what it defaults to
    assert "ranks sharing one context" in parser.format_help()


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


@pytest.mark.parametrize("kw,match", [
    ({"method": "sparse"}, "unknown method 'sparse'.*dense"),
    ({"scorer": "idf"}, r"scorer \(--scorer\): unknown scorer 'idf'"),
    ({"summary_budget": 0.0}, r"summary_budget \(--summary-budget\)"),
    ({"method": "dense", "cp_size": 2}, "runs on one rank"),
    ({"chunk_size": 0}, "chunk_size"),
    ({"no_such_field": 1}, "unknown config field 'no_such_field'"),
])
def test_config_errors_name_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.create(**kw)


# --------------------------------------------------------------------------------------------------- plan
def test_plan_worked_example_from_docstring():
    assert block_bounds(10, 3) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert assign_blocks(4, 2) == [[0, 1], [2, 3]] and assign_blocks(5, 2) == [[0, 1, 2], [3, 4]]
    cfg = EngineConfig.create(method="star", cp_size=2, block_size=3, anchor_size=3)
    ids = torch.arange(10)
    p0, p1 = plan_rank(cfg, ids, 0), plan_rank(cfg, ids, 1)
    assert [s.indices.tolist() for s in p0.segments] == [[0, 1, 2], [0, 1, 2, 3, 4, 5]]
    assert [s.indices.tolist() for s in p1.segments] == [[0, 1, 2, 6, 7, 8], [0, 1, 2, 9]]
    assert kept_token_count(p0) + kept_token_count(p1) == 10
    ring = EngineConfig.create(method="ring", cp_size=2)
    assert plan_rank(ring, ids, 0).ring_shard.tolist() == [0, 1, 2, 8, 9]  # zigzag chunks 0 and 3


@pytest.mark.parametrize("kw,L,match", [
    ({"method": "star", "cp_size": 4}, 3, "shorter than the number of blocks"),
    ({"method": "star", "cp_size": 2, "block_size": 50}, 20, "larger than the context"),
    ({"method": "pulsar", "cp_size": 2}, 0, "context is empty|shorter"),
])
def test_plan_errors(kw, L, match):
    with pytest.raises(ValueError, match=match):
        plan_rank(EngineConfig.create(**kw), torch.arange(L), 0)


# ------------------------------------------------------------------------------------------------- engine
def _engine(model, **kw):
    return magnetar.init_inference(copy.deepcopy(model), deepspeed_inference=False, **kw)


def test_streaming_with_window_covering_the_context_equals_dense():
    model = tiny_model("llama", seed=3)
    ctx, q = torch.randint(0, 256, (50,)), torch.randint(0, 256, (4,))
    ref_logits, ref_tokens = reference(model, ctx, q, 5)
    res = _engine(model, method="streaming", window_size=64, sink_tokens=4).generate(ctx, q, max_new_tokens=5,
                                                                                   return_logits=True)
    assert_close(res.first_token_logits, ref_logits, what="logits", msg="streaming, window 64")
    assert res.token_ids == ref_tokens
    # a short window really evicts: 4 sinks + 8 recent tokens stay, and the answer changes
    res = _engine(model, method="streaming", window_size=8, sink_tokens=4).generate(ctx, q, max_new_tokens=5,
                                                                                  return_logits=True)
    assert res.context_kv_tokens_per_rank == [12]
    assert_differs(res.first_token_logits, ref_logits, msg="streaming, window 8")


def test_sampling_is_seeded_and_stop_reasons():
    model = tiny_model("qwen2", seed=4)
    ctx, q = torch.randint(0, 256, (30,)), torch.randint(0, 256, (3,))
    a = _engine(model, temperature=1.0, seed=5, top_k=20).generate(ctx, q, max_new_tokens=8)
    b = _engine(model, temperature=1.0, seed=5, top_k=20).generate(ctx, q, max_new_tokens=8)
    c = _engine(model, temperature=1.0, seed=6, top_k=20).generate(ctx, q, max_new_tokens=8)
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids and a.stop_reason == "max_new_tokens"
    eos_model = copy.deepcopy(model)
    eos_model.generation_config.eos_token_id = a.token_ids[2]
    d = _engine(eos_model, temperature=1.0, seed=5, top_k=20).generate(ctx, q, max_new_tokens=8)
    assert d.token_ids == a.token_ids[:3] and d.stop_reason == "eos"
    # ignore_eos (vLLM's extension): the EOS token is kept and the answer goes on to max_new_tokens
    e = _engine(eos_model, temperature=1.0, seed=5, top_k=20).generate(ctx, q, max_new_tokens=8, ignore_eos=True)
    assert e.token_ids == a.token_ids and e.stop_reason == "max_new_tokens"
    with pytest.raises(ValueError, match="ignore_eos must be True or False"):
        _engine(eos_model).generate(ctx, q, max_new_tokens=8, ignore_eos=1)


def test_engine_input_errors():
    model = tiny_model("mistral", seed=1)
    eng = _engine(model)
    with pytest.raises(ValueError, match="query is empty"):
        eng.generate(torch.arange(10), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="exceeds the model's 1024 positions"):
        eng.generate(torch.zeros(1020, dtype=torch.long), torch.arange(3), max_new_tokens=8)
    with pytest.raises(ValueError, match="need a tokenizer"):
        eng.generate("some context", "a question?")
    with pytest.raises(ValueError, match="needs torch.distributed"):
        _engine(model, method="star", cp_size=2)


def test_unsupported_architecture_lists_supported():
    import transformers as tf

    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="model type 'gpt2' is not supported; supported: llama, qwen2, qwen3, mistral"):
        magnetar.init_inference(gpt2, deepspeed_inference=False)


def test_tp1_serves_the_model_object_itself():
    # at tp_size 1 DeepSpeed has nothing to shard and is not called: the engine runs the very module it was given,
    # on the same parameter storage (tensor parallelism: tests/test_tensor_parallel.py)
    model = tiny_model("qwen3", seed=2)
    ctx, q = torch.randint(0, 256, (20,)), torch.randint(0, 256, (3,))
    ref_logits, ref_tokens = reference(model, ctx, q, 3)
    storage = {n: p.data_ptr() for n, p in model.named_parameters()}
    eng = magnetar.init_inference(model, deepspeed_inference=True)
    assert eng.model is model and {n: p.data_ptr() for n, p in eng.model.named_parameters()} == storage
    res = eng.generate(ctx, q, max_new_tokens=3, return_logits=True)
    assert res.token_ids == ref_tokens and res.weight_bytes_per_rank == [weight_bytes(model)]
    assert_close(res.first_token_logits, ref_logits, what="logits", msg="tp_size 1")


# ------------------------------------------------------------------------------------------------- plug-ins
def test_every_registered_strategy_satisfies_its_protocol():
    from magnetar.config import METHODS, LukaConfig, PrefillConfig, SparseConfig
    from magnetar.engine import strategy

    for name in METHODS:
        assert isinstance(strategy.context_method(name), strategy.ContextMethod), name
    model_config = tiny_model("llama").config
    for cfg in (SparseConfig(sparse_policy="oracle_topk", sparse_budget=4), LukaConfig(luka_mode="lined")):
        assert isinstance(strategy.decode_policy(cfg, model_config), strategy.DecodePolicy), cfg
    assert strategy.decode_policy(SparseConfig(), model_config) is None
    policy = strategy.prefill_policy(PrefillConfig(prefill_policy="oracle"), model_config)
    assert isinstance(policy, strategy.PrefillPolicy)
    assert strategy.prefill_policy(PrefillConfig(), model_config) is None
    with pytest.raises(ValueError, match="unknown method 'nope'; valid options are dense, ring"):
        strategy.context_method("nope")
    # every registered policy derives from its family's base (the engine calls the optional members, never probes)
    from magnetar.config import DECODE_SECTIONS, POLICIES
    from magnetar.utils.registry import load_class

    for name, spec in POLICIES.items():
        base = strategy.DecodePolicyBase if spec.section in DECODE_SECTIONS else strategy.PrefillPolicyBase
        assert issubclass(load_class(spec.impl), base), name


def test_design_doc_worked_example_is_one_module_plus_one_registry_line(tmp_path, monkeypatch):
    """docs/design.md's example method, taken from the doc as written, registered with one line: it runs through
    the engine (simulated ranks) and equals Star with a 128-token anchor, which is what it is."""
    import re
    import sys
    from pathlib import Path

    from magnetar import config

    doc = (Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", doc, re.S)
                if b.startswith("# magnetar/methods/prefix.py"))
    line = next(b for b in re.findall(r"```python\n(.*?)```", doc, re.S)
                if b.startswith("# magnetar/config/registry.py"))
    (tmp_path / "prefix_plugin.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = eval(line.split(":", 1)[1].strip().rstrip(","), vars(config))  # the registry line's MethodSpec
    assert spec.impl == "magnetar.methods.prefix:PrefixMethod"
    monkeypatch.setitem(config.METHODS, "prefix", config.MethodSpec("prefix_plugin:PrefixMethod", spec.distributed,
                                                                     spec.local_prefill))
    sys.modules.pop("prefix_plugin", None)
    model = tiny_model("llama", seed=3)
    g = torch.Generator().manual_seed(3)
    ctx, q = torch.randint(0, 256, (300,), generator=g), torch.randint(0, 256, (5,), generator=g)
    plugin = _engine(model, method="prefix", cp_size=3, simulate=True).generate(ctx, q, max_new_tokens=3,
                                                                                 return_logits=True)
    star = _engine(model, method="star", cp_size=3, simulate=True, anchor_size=128).generate(
        ctx, q, max_new_tokens=3, return_logits=True)
    assert plugin.token_ids == star.token_ids and plugin.context_kv_tokens_per_rank == [100, 100, 100]
    assert torch.equal(plugin.first_token_logits, star.first_token_logits)


def test_design_doc_policy_example_is_one_module_plus_one_registry_line(tmp_path, monkeypatch):
    """Issue 29, item 5: docs/design.md's example decode policy, taken from the doc as written, registered with its
    one line: the config and the CLI accept it by name, the engine builds it (no probing: the base gives the
    rest), and over distributed KV it equals Quest with one key per page -- whose page bound is q.k itself."""
    import argparse
    import re
    import sys
    from pathlib import Path

    from magnetar import config
    from magnetar.config import EngineConfig, SparseConfig, add_cli_args

    doc = (Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, re.S)
    code = next(b for b in blocks if b.startswith("# magnetar/sparse/mips.py"))
    line = next(b for b in blocks if b.startswith("# magnetar/config/registry.py, POLICIES"))
    (tmp_path / "mips_plugin.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = eval(line.split("\n", 1)[1].split(":", 1)[1].strip().rstrip(","), vars(config))
    assert spec == config.PolicySpec("magnetar.sparse.mips:MipsSelector", "sparse")
    with pytest.raises(ValueError, match="unknown policy 'mips'"):
        SparseConfig(sparse_policy="mips", sparse_budget=8)
    monkeypatch.setitem(config.POLICIES, "mips", config.PolicySpec("mips_plugin:MipsSelector", spec.section))
    sys.modules.pop("mips_plugin", None)
    args = add_cli_args(argparse.ArgumentParser()).parse_args(["--sparse-policy", "mips", "--sparse-budget", "8",
                                                               "--dense-layers", "0"])
    assert EngineConfig.from_cli(args).decode_config.policy == "mips"
    model = tiny_model("llama", seed=3)
    g = torch.Generator().manual_seed(4)
    ctx, q = torch.randint(0, 256, (120,), generator=g), torch.randint(0, 256, (5,), generator=g)
    common = dict(method="star", cp_size=3, simulate=True, sparse_budget=8, dense_layers=0)
    mips = _engine(model, sparse_policy="mips", **common)
    assert type(mips.policy).__name__ == "MipsSelector" and mips.policy.stats(None, 0) is None
    got = mips.generate(ctx, q, max_new_tokens=3, return_logits=True)
    quest = _engine(model, sparse_policy="quest", page_size=1, **common).generate(ctx, q, max_new_tokens=3,
                                                                                  return_logits=True)
    dense = _engine(model, method="star", cp_size=3, simulate=True).generate(ctx, q, max_new_tokens=3,
                                                                            return_logits=True)
    assert_close(got.first_token_logits, quest.first_token_logits, what="logits", msg="mips vs quest(page 1)")
    assert got.token_ids == quest.token_ids
    assert (got.first_token_logits - dense.first_token_logits).abs().max() > 1e-3, "the budget really selects"


def test_eval_knows_a_new_method_only_through_the_registry(tmp_path, monkeypatch):
    """Issue 29, item 6: magnetar-eval ran a newly registered distributed method at cp 1 without a word (a name
    list in the runner), and the cost model, the benchmark and the report labels branched on method names. Now
    the design doc's plug-in, registered as a distributed method, gets its ranks, its label, its cost and its
    benchmark row like the built-in ones."""
    import re
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    from magnetar import config
    from magnetar.cli.args import engine_config
    from magnetar.engine.strategy import context_method
    from magnetar.eval.cost import estimate
    from magnetar.eval.runner import method_label

    doc = (Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", doc, re.S)
                if b.startswith("# magnetar/methods/prefix.py"))
    (tmp_path / "prefix_plugin2.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(config.METHODS, "prefix", config.MethodSpec("prefix_plugin2:PrefixMethod", True, True))
    sys.modules.pop("prefix_plugin2", None)
    args = SimpleNamespace(dtype="float32", tp_size=1, block_size=None, anchor_size=None, sink_size=None,
                           chunk_size=None, summary_budget=None, window_size=None, attention_backend=None)
    cfg = engine_config(args, "prefix", 4)
    assert cfg.parallel.cp_size == 4, "a registered distributed method runs on its ranks"
    assert method_label(cfg) == "prefix" and not context_method("prefix").lockstep_ranks
    est = estimate(tiny_model("llama").config, cfg, 400, 8)
    assert len(est.kv_tokens) == 4 and sum(est.kv_tokens) == 400, est.kv_tokens
    assert method_label(engine_config(args, "streaming", 4)).startswith("streaming(window")
    assert engine_config(args, "streaming", 4).parallel.cp_size == 1 and context_method("ring").lockstep_ranks


def test_a_half_precision_model_cast_to_float32_is_said(caplog):
    model = tiny_model("llama").to(torch.bfloat16)
    with caplog.at_level("WARNING", logger="magnetar.engine.load"):
        eng = magnetar.init_inference(copy.deepcopy(model), method="dense", dtype="float32")
    assert next(eng.model.parameters()).dtype == torch.float32
    assert "the given model is bfloat16; runtime.dtype 'float32' casts it to float32" in caplog.text
    for kw in ({"dtype": "auto"}, {}):  # auto, the default: the model's own dtype, nothing said
        caplog.clear()
        with caplog.at_level("WARNING", logger="magnetar.engine.load"):
            eng = magnetar.init_inference(copy.deepcopy(model), method="dense", **kw)
        assert next(eng.model.parameters()).dtype == torch.bfloat16 and "casts it" not in caplog.text, kw


_OPTION_CHECK = r"""
import argparse, sys
import torch
import magnetar
from magnetar.config import REQUEST_OPTIONS, EngineConfig, add_cli_args
from magnetar.config.registry import METHOD_OPTIONS
from tests.tiny_models import tiny_model

args = add_cli_args(argparse.ArgumentParser()).parse_args(["--method", "prefix", "--prefix-size", "64"])
assert EngineConfig.from_cli(args).blocks.prefix_size == 64
assert "prefix_size" in REQUEST_OPTIONS and METHOD_OPTIONS["prefix_size"][0] == ("prefix",)
for bad, words in ((dict(method="dense", prefix_size=5), "prefix_size is an option of prefix"),
                   (dict(method="prefix", prefix_size=2.5), "prefix_size")):
    try:
        EngineConfig.create(**bad)
        raise SystemExit(f"accepted {bad}")
    except ValueError as e:
        assert words in str(e), str(e)
model = tiny_model("llama", seed=3)
g = torch.Generator().manual_seed(3)
ctx, q = torch.randint(0, 256, (300,), generator=g), torch.randint(0, 256, (5,), generator=g)
eng = magnetar.init_inference(model, method="prefix", prefix_size=128, cp_size=3, simulate=True, timeout_s=60)
mine = eng.generate(ctx, q, max_new_tokens=3, return_logits=True)
star = magnetar.init_inference(model, method="star", anchor_size=128, cp_size=3, simulate=True,
                               timeout_s=60).generate(ctx, q, max_new_tokens=3, return_logits=True)
assert mine.token_ids == star.token_ids and torch.equal(mine.first_token_logits, star.first_token_logits)
try:  # a request's own bad value: the method's validate refuses it, naming the option
    eng.check(ctx, q, options={"prefix_size": 0})
    raise SystemExit("accepted prefix_size 0")
except ValueError as e:
    assert e.field == "options.prefix_size" and "prefix_size must be >= 1" in str(e), (e.field, str(e))
print("ok")
"""


def test_design_doc_method_with_an_option_of_its_own(tmp_path):
    """docs/design.md's "A method with an option of its own": its three snippets, applied as written to a copy of
    the package (the field line into BlockConfig, the module, the registry line), make a method whose option has a
    flag, a type check, a per-request form, a refusal for other methods and equals Star with that anchor."""
    import os
    import re
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "design.md").read_text()
    section = doc[doc.index("### A method with an option of its own"):]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)[:3]
    field_line = blocks[0].splitlines()[1]
    module, registry_line = blocks[1], "\n".join(blocks[2].splitlines()[1:])
    copy = tmp_path / "magnetar"
    shutil.copytree(root / "magnetar", copy, ignore=shutil.ignore_patterns("__pycache__"))
    sections = (copy / "config" / "sections.py").read_text()
    after = '    exact_layers: str = ""\n'
    assert sections.count(after) == 1
    (copy / "config" / "sections.py").write_text(sections.replace(after, after + field_line + "\n"))
    registry = (copy / "config" / "registry.py").read_text()
    end = "\n}\nDISTRIBUTED_METHODS"
    assert registry.count(end) == 1
    (copy / "config" / "registry.py").write_text(registry.replace(end, "\n" + registry_line + end))
    (copy / "methods" / "prefix.py").write_text(module)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{repo_pythonpath()}")  # the copy shadows this checkout
    res = subprocess.run([sys.executable, "-c", _OPTION_CHECK], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]
