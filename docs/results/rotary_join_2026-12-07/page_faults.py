"""Page faults of one forward of four joined bf16 queries (SmolLM2-135M, two threads) -- equal lengths (1000 each)
and unequal (1019, 1001, 1014, 997: right-padded) -- with glibc's malloc as it is, then (KEEP=1) after
magnetar.utils.malloc.keep_freed_memory(). Run from the repo root, each mode in its own process:
.venv/bin/python docs/results/rotary_join_2026-12-07/page_faults.py; KEEP=1 .venv/bin/python <the same>"""
import os, resource, sys, time
import torch
sys.path.insert(0, "benchmarks")
import magnetar
from transformers import AutoModelForCausalLM, AutoTokenizer
from bench_serve import documents

torch.set_num_threads(2)
path = os.path.expanduser("~/.cache/magnetar/models/smollm2-135m-instruct")
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
eng = magnetar.init_inference(model, tokenizer=tok, deepspeed_inference=False, dtype="bfloat16")
h = eng.encode("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
docs = [tok(d, return_tensors="pt").input_ids[0] for d, _, _ in documents(tok, 1100, 4, 40)]
sets = {"equal": [d[:1000] for d in docs], "unequal": [d[:n] for d, n in zip(docs, (1019, 1001, 1014, 997))]}
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
