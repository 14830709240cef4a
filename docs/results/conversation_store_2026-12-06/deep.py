"""A conversation of many turns stored as a chain: the last turn's load time after a restart."""
import sys, time, shutil, torch, magnetar, json
from magnetar.data.texts import paul_graham_essays
turns, store = int(sys.argv[1]), sys.argv[2]
shutil.rmtree(store, ignore_errors=True)
mk = lambda: magnetar.init_inference("smollm2-135m-instruct", method="dense", timeout_s=3600, context_store=store)
e = mk()
ids = e.tokenizer("\n\n".join(paul_graham_essays()), add_special_tokens=False)["input_ids"]
q = torch.tensor(e.tokenizer(" What next?", add_special_tokens=False)["input_ids"])
ctx = torch.tensor(ids[:2000])
t0 = time.perf_counter()
if turns == 0:
    ctx = torch.tensor(ids[:5000]); r = e.generate(ctx, q, max_new_tokens=1)
for t in range(turns):
    ctx = torch.tensor(ids[:2000 + 30 * (t + 1)])
    r = e.generate(ctx, q, max_new_tokens=1)
print("turns", turns, "seconds", round(time.perf_counter() - t0, 1), file=sys.stderr)
e.flush_store()
st = e.cache_stats()["store"]
again = mk()
ts = []
for i in range(3):
    again.cache.clear()
    t1 = time.perf_counter(); r2 = again.generate(ctx, q, max_new_tokens=1); ts.append(time.perf_counter() - t1)
    assert r2.cached_context_tokens == r2.context_tokens and r2.token_ids == r.token_ids
print(json.dumps(dict(turns=turns, stored=st["contexts"], store_bytes=st["bytes"], load_seconds=[round(x, 3) for x in ts])))
