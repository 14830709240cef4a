"""What the scripts of this folder share: SmolLM2-135M in bf16 on two threads behind Magnetar's engine, a cached system
prompt ``h``, four ~1000-token queries ``sets["equal"]`` (1000 each) and ``sets["unequal"]`` (1019, 1001, 1014, 997:
right-padded to the longest when joined), and ``joined(queries)``: the seconds of one forward of them joined (their
first tokens chosen). Imported from the repo root."""
import os
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
import magnetar  # noqa: E402
from bench_serve import documents  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

torch.set_num_threads(2)
path = os.path.expanduser("~/.cache/magnetar/models/smollm2-135m-instruct")
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
eng = magnetar.init_inference(model, tokenizer=tok, deepspeed_inference=False, dtype="bfloat16")
h = eng.encode("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
docs = [tok(d, return_tensors="pt").input_ids[0] for d, _, _ in documents(tok, 1100, 4, 40)]
sets = {"equal": [d[:1000] for d in docs], "unequal": [d[:n] for d, n in zip(docs, (1019, 1001, 1014, 997))]}


def joined(queries) -> float:
    b = eng.open_batch()
    t0 = time.perf_counter()
    b.join([b.prepare(h, q, eng.sampling_params(max_new_tokens=2, temperature=0.0)) for q in queries])
    return time.perf_counter() - t0
