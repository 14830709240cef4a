"""The A/B of joined_queries.py in one process, alternated query by query, so that the VM's drift hits both alike:
"before" = transformers' own rotary embedding (restore_rotary) and the padded query rows attended as before this
commit (Phase2Context._local / _attend_part of the worktree given as BEFORE=<path to its magnetar/engine/phase2.py>);
"rotary" = the op with the old padded rows; "after" = both changes. Seconds a forward: best and median of seven.
Run from the repo root: BEFORE=/tmp/w/before/magnetar/engine/phase2.py .venv/bin/python <this file>"""
import importlib.util
import os
import statistics
import sys

import torch

sys.path.insert(0, "docs/results/rotary_join_2026-12-07")
from smollm2_queries import joined, model, sets  # noqa: E402
from magnetar.engine import phase2  # noqa: E402
from magnetar.engine.rotary import fuse_rotary, restore_rotary  # noqa: E402

spec = importlib.util.spec_from_file_location("phase2_before", os.environ["BEFORE"])
old = importlib.util.module_from_spec(spec)
sys.modules["phase2_before"] = old  # its dataclasses look their module up
spec.loader.exec_module(old)
new_code = (phase2.Phase2Context._local, phase2.Phase2Context._attend_part)
old_code = (old.Phase2Context._local, old.Phase2Context._attend_part)


def setup(variant):
    fuse_rotary(model, torch.device("cpu")) if variant != "before" else restore_rotary(model)
    phase2.Phase2Context._local, phase2.Phase2Context._attend_part = new_code if variant == "after" else old_code


variants = ("before", "rotary", "after")
times = {(v, k, n): [] for k in sets for n in (1, 4) for v in variants}
for _ in range(7):
    for k in sets:
        for n in (1, 4):
            for v in variants:
                setup(v)
                times[(v, k, n)].append(joined(sets[k][:n]))
for (v, k, n), t in times.items():
    print(f"{k:8s} {n} queries {v:7s}: best {min(t):.3f} s, median {statistics.median(t):.3f} s")
