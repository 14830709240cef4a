"""torch's CPU flash kernel (aten::_scaled_dot_product_flash_attention_for_cpu) by key count, bf16, two threads:
SmolLM2's query shapes (9 query heads over 3 KV heads, D 64, 975 query rows). Run from the repo root:
    .venv/bin/python docs/results/rms_norm_2026-12-07/key_block.py"""
import time

import torch

torch.set_num_threads(2)
K = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def t(f, n=20):
    for _ in range(3):
        f()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t0) / n * 1e3


def pad(x, n):
    return torch.cat([x, x.new_zeros(1, 3, n - x.shape[2], 64)], 2)


q = torch.randn(1, 9, 975, 64).to(torch.bfloat16)
print("no mask (a query over a cached context): ms a call")
for sk in (15, 16, 31, 32, 33, 46, 47, 48, 63, 64):
    k, v = torch.randn(1, 3, sk, 64).to(torch.bfloat16), torch.randn(1, 3, sk, 64).to(torch.bfloat16)
    P = -(-sk // 16) * 16
    row = torch.zeros(1, 1, 1, P, dtype=torch.bfloat16)
    row[..., sk:] = float("-inf")
    a = t(lambda: K(q, k, v, 0.0, False, scale=0.125))
    b = t(lambda: K(q, pad(k, P), pad(v, P), 0.0, False, attn_mask=row.expand(1, 1, 975, P), scale=0.125))
    print(f"  {sk:4d} keys: {a:.3f}; padded to {P} under a -inf row: {b:.3f}")
print("is_causal square (the query's own tokens): ms a call")
for S in (975, 1000, 1023, 4095):
    qs, k, v = (torch.randn(1, h, S, 64).to(torch.bfloat16) for h in (9, 3, 3))
    P = -(-S // 16) * 16
    a = t(lambda: K(qs, k, v, 0.0, True, scale=0.125), 10)
    b = t(lambda: K(qs, pad(k, P), pad(v, P), 0.0, True, scale=0.125), 10)
    print(f"  {S:4d}: {a:.3f}; keys padded to {P}: {b:.3f}")
