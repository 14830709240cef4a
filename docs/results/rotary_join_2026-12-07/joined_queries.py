"""One query and two / four joined queries of unequal lengths (1019, 1001, 1014, 997 tokens: right-padded to the
longest) and of equal lengths (1000 each), bf16, over a cached system prompt (SmolLM2-135M, two threads): seconds a
forward, the best and the median of five. Compare commits with PYTHONPATH=<a worktree of one>. Run from the repo root:
.venv/bin/python docs/results/rotary_join_2026-12-07/joined_queries.py"""
import os, statistics, sys, time
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


def joined(qs):
    b = eng.open_batch()
    t0 = time.perf_counter()
    b.join([b.prepare(h, q, eng.sampling_params(max_new_tokens=2, temperature=0.0)) for q in qs])
    return time.perf_counter() - t0


print(magnetar.__file__)
times = {(k, n): [] for k in sets for n in (1, 2, 4)}
for _ in range(5):
    for (k, n), t in times.items():
        t.append(joined(sets[k][:n]))
for (k, n), t in times.items():
    print(f"{k:8s} {n} queries: best {min(t):.3f} s, median {statistics.median(t):.3f} s")
