"""Page faults of one forward of four joined bf16 queries (SmolLM2-135M, two threads) -- equal lengths (1000 each)
and unequal (1019, 1001, 1014, 997: right-padded) -- with glibc's malloc as it is, then (KEEP=1) after
magnetar.utils.malloc.keep_freed_memory(). Run from the repo root, each mode in its own process:
.venv/bin/python docs/results/rotary_join_2026-12-07/page_faults.py; KEEP=1 .venv/bin/python <the same>"""
import os
import resource
import sys
import time

sys.path.insert(0, "docs/results/rotary_join_2026-12-07")
from smollm2_queries import eng, h, sets  # noqa: E402

if os.environ.get("KEEP"):
    from magnetar.utils.malloc import keep_freed_memory
    print(keep_freed_memory())
for k in ("equal", "unequal") * 3:
    b = eng.open_batch()
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    b.join([b.prepare(h, q, eng.sampling_params(max_new_tokens=2, temperature=0.0)) for q in sets[k]])
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    print(f"{k:8s} wall {time.perf_counter() - t0:.3f} s, user {r1.ru_utime - r0.ru_utime:.3f} s, system "
          f"{r1.ru_stime - r0.ru_stime:.3f} s, minor page faults {r1.ru_minflt - r0.ru_minflt}")
