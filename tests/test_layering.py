"""The package layering of docs/design.md, read from the source: every import of every module (function-local
and TYPE_CHECKING ones included) must follow the table below, and no two files may import each other through
any chain (no import cycle between files)."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "magnetar"

# What the runtime strategy packages may import: the engine's protocols, plan and KV, and the layers below.
STRATEGY_BASE = ("engine.strategy", "engine.plan", "engine.kv", "config", "ops", "parallel", "models", "utils")
BELOW_TOP = ("config", "version", "utils", "ops", "parallel", "models", "data", "engine", "methods", "sparse", "luka",
             "prefill")
# package (or top-level module) -> what it may import besides itself; "engine.kv" allows that module (and below)
ALLOWED: dict[str, tuple[str, ...]] = {
    "config": (),
    "version": (),
    "utils": (),
    "models": ("utils",),
    "data": ("utils",),
    "ops": ("utils",),
    "parallel": ("ops", "utils"),
    "engine": ("parallel", "ops", "config", "models", "utils"),
    "methods": STRATEGY_BASE,
    "sparse": STRATEGY_BASE,
    "luka": STRATEGY_BASE,
    "prefill": STRATEGY_BASE,
    # the command lines' shared checks, below every command line
    "cli": ("config", "ops", "parallel", "models", "utils"),
    "eval": BELOW_TOP + ("<root>", "cli"),  # the top: the engine's public API, the strategies' reports
    "calibrate": BELOW_TOP + ("<root>", "cli"),
    "launch": BELOW_TOP + ("<root>", "cli"),  # no eval
    "serve": BELOW_TOP + ("<root>", "cli"),  # the HTTP server: the engine's API; no launch, no eval
    "commands": ("cli", "launch", "serve", "eval", "calibrate", "utils", "version"),  # `magnetar COMMAND`: the top
    "__main__": ("commands",),  # `python -m magnetar COMMAND`
    "<root>": ("version", "config", "engine", "ops", "parallel"),  # magnetar/__init__.py: the public API
}


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def _imports(source: str, package: str, mods) -> set[str]:
    """The magnetar modules ``source`` (a module of ``package``) imports, anywhere in the file; ``from pkg import
    sub`` names the submodule."""

    def resolve(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        else:
            continue
        found.update(resolve(t) for t in targets if t == "magnetar" or t.startswith("magnetar."))
    return found


def _edges(mods: dict[str, tuple[Path, bool]]) -> dict[str, set[str]]:
    """module -> the magnetar modules it imports."""
    edges: dict[str, set[str]] = defaultdict(set)
    for mod, (path, is_pkg) in mods.items():
        edges[mod] = _imports(path.read_text(), mod if is_pkg else mod.rpartition(".")[0], mods) - {mod}
    return edges


def _layer(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "<root>"


def _allowed(src: str, dst: str) -> bool:
    a, b = _layer(src), _layer(dst)
    if a == b:
        return True
    rel = dst.split(".", 1)[1] if "." in dst else "<root>"
    return any(rel == rule or rel.startswith(rule + ".") or (rule == b and "." not in rule)
               for rule in ALLOWED[a])


def _cycles(nodes, edges) -> list[list[str]]:
    """Strongly connected components of more than one file (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_every_layer_is_in_the_table():
    mods = _modules()
    assert {_layer(m) for m in mods} <= set(ALLOWED), "a new package needs its row in ALLOWED (and docs/design.md)"


def test_imports_point_down():
    mods = _modules()
    bad = sorted(f"{src} -> {dst}" for src, dsts in _edges(mods).items() for dst in dsts if not _allowed(src, dst))
    assert not bad, "imports the layering forbids (docs/design.md, 'Layers'):\n  " + "\n  ".join(bad)


def test_no_import_cycle_between_files():
    mods = _modules()
    cycles = _cycles(list(mods), _edges(mods))
    assert not cycles, "import cycles between files:\n  " + "\n  ".join(" <-> ".join(c) for c in cycles)


def test_the_checker_sees_function_local_and_relative_imports():
    mods = _modules()
    src = "import torch\ndef f():\n    from magnetar.eval import runner\nfrom .kv import KVShard\nfrom . import plan\n"
    assert _imports(src, "magnetar.engine", mods) == {"magnetar.eval.runner", "magnetar.engine.kv",
                                                       "magnetar.engine.plan"}
    assert not _allowed("magnetar.engine.engine", "magnetar.sparse.select")
    assert not _allowed("magnetar.engine.engine", "magnetar.launch.run")
    assert not _allowed("magnetar.serve.cli", "magnetar.launch.run")  # the CLI checks live below both: magnetar.cli
    assert not _allowed("magnetar.launch.run", "magnetar.eval.common")
    assert _allowed("magnetar.serve.cli", "magnetar.cli.args") and not _allowed("magnetar.cli.args", "magnetar.eval")
    assert _allowed("magnetar.methods.star", "magnetar.engine.plan")
    assert not _allowed("magnetar.methods.star", "magnetar.engine.phase1")
    assert not _allowed("magnetar.sparse.select", "magnetar.eval.report")
    assert not _allowed("magnetar.config", "magnetar.prefill.schedule")
    assert _cycles(["a", "b", "c", "d"], {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
