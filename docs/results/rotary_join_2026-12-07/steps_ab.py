"""Decode steps at batch 8 of the served shape -- eight ~1K queries (two joins of four) over the cached system prompt, 48
tokens each -- with a short shared store read in one call of its own (SHARED_MIN_KEYS 0, as before) and with each
request's pages (256), alternated run by run: the median ms a step per run. Run from the repo root."""
import sys, time, statistics
sys.path.insert(0, "docs/results/rotary_join_2026-12-07")
from smollm2_queries import eng, h, tok
from bench_serve import documents
import magnetar.engine.phase2 as p2
qs = [tok(d, return_tensors="pt").input_ids[0][:1000 + 7 * i] for i, (d, _, _) in enumerate(documents(tok, 1100, 8, 77))]
res = {}
for rep in range(3):
    for thr in (0, 256):
        p2.SHARED_MIN_KEYS = thr
        b = eng.open_batch()
        for part in (qs[:4], qs[4:]):
            b.join([b.prepare(h, q, eng.sampling_params(max_new_tokens=48, temperature=0.0, ignore_eos=True)) for q in part])
        ts = []
        while b.active:
            t0 = time.perf_counter(); b.step(); ts.append(time.perf_counter() - t0)
        res.setdefault(thr, []).append(1000 * statistics.median(ts))
for thr, v in res.items(): print("SHARED_MIN_KEYS", thr, "median ms a step per run", [round(x, 1) for x in v])
