"""The A/B of joined_queries.py in one process, alternated query by query, so that the VM's drift hits both alike:
"before" = transformers' own rotary embedding (restore_rotary) and the padded query rows attended as before this
commit (Phase2Context._local / _attend_part of the worktree given as BEFORE=<path to its magnetar/engine/phase2.py>);
"rotary" = the op with the old padded rows; "after" = both changes. Seconds a forward: best and median of seven.
Run from the repo root: BEFORE=/tmp/w/before/magnetar/engine/phase2.py .venv/bin/python <this file>"""
import importlib.util, os, statistics, sys, time
import torch
sys.path.insert(0, "benchmarks")
import magnetar
from magnetar.engine import phase2
from magnetar.engine.rotary import fuse_rotary, restore_rotary
from transformers import AutoModelForCausalLM, AutoTokenizer
from bench_serve import documents

spec = importlib.util.spec_from_file_location("phase2_before", os.environ["BEFORE"])
old = importlib.util.module_from_spec(spec)
sys.modules["phase2_before"] = old  # its dataclasses look their module up
spec.loader.exec_module(old)
new_code = (phase2.Phase2Context._local, phase2.Phase2Context._attend_part)
old_code = (old.Phase2Context._local, old.Phase2Context._attend_part)

torch.set_num_threads(2)
path = os.path.expanduser("~/.cache/magnetar/models/smollm2-135m-instruct")
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
eng = magnetar.init_inference(model, tokenizer=tok, deepspeed_inference=False, dtype="bfloat16")
h = eng.encode("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
docs = [tok(d, return_tensors="pt").input_ids[0] for d, _, _ in documents(tok, 1100, 4, 40)]
sets = {"equal": [d[:1000] for d in docs], "unequal": [d[:n] for d, n in zip(docs, (1019, 1001, 1014, 997))]}


def setup(variant):
    (fuse_rotary(model, torch.device("cpu")) if variant != "before" else restore_rotary(model))
    phase2.Phase2Context._local, phase2.Phase2Context._attend_part = new_code if variant == "after" else old_code


def joined(qs):
    b = eng.open_batch()
    t0 = time.perf_counter()
    b.join([b.prepare(h, q, eng.sampling_params(max_new_tokens=2, temperature=0.0)) for q in qs])
    return time.perf_counter() - t0


variants = ("before", "rotary", "after")
times = {(v, k, n): [] for k in sets for n in (1, 4) for v in variants}
for _ in range(7):
    for k in sets:
        for n in (1, 4):
            for v in variants:
                setup(v)
                times[(v, k, n)].append(joined(sets[k][:n]))
for (v, k, n), t in times.items():
    print(f"{k:8s} {n} queries {v:7s}: best {min(t):.3f} s, median {statistics.median(t):.3f} s")
