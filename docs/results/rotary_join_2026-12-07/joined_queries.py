"""One query and two / four joined queries of unequal lengths (1019, 1001, 1014, 997 tokens: right-padded to the
longest) and of equal lengths (1000 each), bf16, over a cached system prompt (SmolLM2-135M, two threads): seconds a
forward, the best and the median of five. Compare commits with PYTHONPATH=<a worktree of one>. Run from the repo root:
.venv/bin/python docs/results/rotary_join_2026-12-07/joined_queries.py"""
import statistics
import sys

sys.path.insert(0, "docs/results/rotary_join_2026-12-07")
from smollm2_queries import joined, magnetar, sets  # noqa: E402

print(magnetar.__file__)
times = {(k, n): [] for k in sets for n in (1, 2, 4)}
for _ in range(5):
    for (k, n), t in times.items():
        t.append(joined(sets[k][:n]))
for (k, n), t in times.items():
    print(f"{k:8s} {n} queries: best {min(t):.3f} s, median {statistics.median(t):.3f} s")
