"""One 1000-token query's forward over the cached system prompt (smollm2_queries.py: SmolLM2-135M, bf16, two threads),
`auto` with cpu_amx and without it (AUTO_ORDER less cpu_amx: cpu_flash takes the calls), alternated six rounds: the
median and best seconds of each. Run from the repo root."""
import sys, statistics, os
sys.path.insert(0, "docs/results/rotary_join_2026-12-07")
from smollm2_queries import joined, magnetar, sets
import magnetar.ops.backends as B
order = list(B.AUTO_ORDER)
res = {"amx": [], "flash": []}
for r in range(6):
    for name in ("amx", "flash"):
        B.AUTO_ORDER[:] = order if name == "amx" else [n for n in order if n != "cpu_amx"]
        B._auto_order.cache_clear()
        res[name].append(joined(sets["equal"][:1]))
for k, v in res.items(): print(k, "median", round(statistics.median(v), 3), "best", round(min(v), 3))
