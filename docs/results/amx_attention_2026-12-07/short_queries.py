"""Short queries (3-16 tokens, SmolLM2's 9 query heads over 3, bf16, two threads) over 1000 and 8000 keys, bottom-right
causal: cpu_flash through the front end against the AMX op itself, interleaved, medians of 30 (ms). Run from the repo
root; short_queries.log is its output."""
import torch, time, statistics
torch.set_num_threads(2)
from magnetar.ops import attention_with_lse
from magnetar.ops.backends.cpu_amx import AMX_ATTENTION_OP
op = AMX_ATTENTION_OP.load("cpu")
for Sk in (1000, 8000):
  for Sq in (3, 4, 6, 8, 12, 16):
    q=torch.randn(1,9,Sq,64,dtype=torch.bfloat16); k=torch.randn(1,3,Sk,64,dtype=torch.bfloat16)
    fns={"flash": lambda: attention_with_lse(q,k,k,scale=0.125,backend="cpu_flash"), "amx": lambda: op.attention(q,k,k,0.125,True)}
    ts={n:[] for n in fns}
    for f in fns.values(): f(); f()
    for _ in range(30):
        for n,f in fns.items():
            t=time.perf_counter(); f(); ts[n].append(time.perf_counter()-t)
    print(Sk, Sq, "  ".join(f"{n} {statistics.median(v)*1e3:.3f}" for n,v in ts.items()), flush=True)
