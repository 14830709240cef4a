"""Bytes a static batch's slots hold: 8 requests over copies of one 4K document (SmolLM2-135M, bf16)."""
import dataclasses
import time
import torch
import magnetar
from magnetar.models import load_model
torch.set_num_threads(2)
model, tok = load_model("smollm2-135m-instruct", dtype=torch.bfloat16, device="cpu")
for mode in ("static", "eager"):
    eng = magnetar.init_inference(model, tokenizer=tok, deepspeed_inference=False, context_cache_mb=1 << 20,
                                  dtype="bfloat16", method="dense", decode_step=mode)
    ids = torch.randint(0, model.config.vocab_size, (4096,), generator=torch.Generator().manual_seed(0))
    h = eng.encode(ids)
    hs = [h] + [dataclasses.replace(h, shard=h.shard.clone(), key=f"{h.key}:{i}") for i in range(1, 8)]
    b = eng.open_batch()
    t0 = time.perf_counter()
    params = eng.sampling_params(max_new_tokens=8, temperature=0.0)
    rids = [b.add(x, torch.randint(0, 1000, (12,)), params)[0] for x in hs]
    b.step()
    join = time.perf_counter() - t0
    st = b._batch.static
    nb = st.slots.nbytes() if st is not None else 0
    ctx = sum(x.shard.nbytes() for x in hs)
    print(f"{mode}: contexts {ctx / 2**20:.1f} MiB, slots {nb / 2**20:.1f} MiB"
          + (f" (capacity {st.slots.capacity})" if st else "") + f", 8 joins + 1 step {join:.2f} s")
