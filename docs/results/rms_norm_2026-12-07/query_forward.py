"""One, two and four ~1000-token bf16 queries joined in one forward over a cached system prompt (SmolLM2-135M,
two threads), seconds; OLD=1: the finiteness sums in float32 as before, OLDPAD=1: no key padding in cpu_flash.
Run from the repo root: .venv/bin/python docs/results/rms_norm_2026-12-07/query_forward.py"""
import sys, time, os, torch
sys.path.insert(0, "benchmarks")
import magnetar
if os.environ.get('OLDPAD'):
    import magnetar.ops.backends.cpu_flash as cf; cf._PAD_MIN_ROWS = 10**9
if os.environ.get('OLD'):
    import magnetar.ops.nonfinite as nf; nf.finite_sum_dtype = lambda t: torch.float64 if t.dtype == torch.float64 else torch.float32
from transformers import AutoTokenizer, AutoModelForCausalLM
torch.set_num_threads(2)
path = os.path.expanduser("~/.cache/magnetar/models/smollm2-135m-instruct")
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
eng = magnetar.init_inference(model, tokenizer=tok, deepspeed_inference=False, dtype="bfloat16")
ctx = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
from bench_serve import documents
qs = [tok(d, return_tensors="pt").input_ids[0][:1000] for d, _, _ in documents(tok, 1100, 4, 40)]
h = eng.encode(ctx)
def joined(n):
    b = eng.open_batch()
    t0 = time.perf_counter()
    b.join([b.prepare(h, qs[i], eng.sampling_params(max_new_tokens=2, temperature=0.0)) for i in range(n)])
    return time.perf_counter() - t0
for r in range(3):
    print({n: round(joined(n), 3) for n in (1, 2, 4)}, flush=True)
