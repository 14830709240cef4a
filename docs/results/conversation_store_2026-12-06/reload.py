import sys, time, cProfile, pstats, torch, magnetar
from magnetar.data.texts import paul_graham_essays
store = sys.argv[1]
e = magnetar.init_inference("smollm2-135m-instruct", method="ring", cp_size=2, simulate=True, timeout_s=3600, context_store=store)
ids = e.tokenizer("\n\n".join(paul_graham_essays()), add_special_tokens=False)["input_ids"]
ctx = torch.tensor(ids[:7000 + 150])
q = torch.tensor(e.tokenizer(" What next?", add_special_tokens=False)["input_ids"])
pr = cProfile.Profile(); t0 = time.perf_counter(); pr.enable()
r = e.generate(ctx, q, max_new_tokens=1)
pr.disable(); print("seconds", time.perf_counter() - t0, r.cached_context_tokens, r.context_tokens)
pstats.Stats(pr).sort_stats("cumulative").print_stats(18)
