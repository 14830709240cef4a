"""One cpu_decode call of SmolLM2-135M's decode shapes (9 query heads over 3 KV heads, D 64), the AVX2 pass against the
AVX-512 BF16 pass, alternated in one process. cold: 40 layers' KV cycled (each call's KV out of the caches), warm: one
layer's KV again and again. Also the paged call of an 8-request batch (own contexts). Usage:
    python kernel_call.py [--threads 1] [--keys 4096] [--rounds 4]"""
import argparse
import time

import torch

from magnetar.ops.backends.cpu_decode import DECODE_ATTENTION_OP

ap = argparse.ArgumentParser()
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--keys", type=int, default=4096)
ap.add_argument("--rounds", type=int, default=4)
ap.add_argument("--dim", type=int, default=64)
args = ap.parse_args()
torch.set_num_threads(args.threads)
op = DECODE_ATTENTION_OP.load("cpu")
assert op.avx512_bf16(), "this CPU has no AVX-512 BF16"
dt, n, D = torch.bfloat16, args.keys, args.dim
layers = [(torch.randn(1, 3, n, D, dtype=dt), torch.randn(1, 3, n, D, dtype=dt)) for _ in range(40)]
q = torch.randn(1, 9, 1, D, dtype=dt)
kv_bytes = 2 * 3 * n * D * 2
batch = [(torch.randn(1, 3, n // 4, D, dtype=dt), torch.randn(1, 3, n // 4, D, dtype=dt)) for _ in range(8 * 10)]
qb = torch.randn(8, 9, 1, D, dtype=dt)


def time_calls(fn, calls):
    fn(0)
    t = time.perf_counter()
    for i in range(calls):
        fn(i)
    return (time.perf_counter() - t) / calls * 1e6


def cold(i):
    k, v = layers[i % 40]
    op.decode_attention(q, k, v, 0.125)


def warm(i):
    op.decode_attention(q, layers[0][0], layers[0][1], 0.125)


def paged(i):
    pages = batch[(i % 10) * 8:(i % 10) * 8 + 8]
    op.decode_attention_pages(qb, [p[0] for p in pages], [p[1] for p in pages], list(range(9)), 3, 0.125)


ref = op.decode_attention(q, *layers[0], 0.125)
for rnd in range(args.rounds):
    for on in (False, True):
        op.set_avx512_bf16(on)
        name = "avx512_bf16" if on else "avx2"
        c, w, p = time_calls(cold, 200), time_calls(warm, 200), time_calls(paged, 100)
        print(f"round {rnd} {name:12s} n={n} D={D} threads={args.threads}: cold {c:6.0f} us ({kv_bytes / c / 1e3:4.1f} GB/s)"
              f"  warm {w:6.0f} us ({kv_bytes / w / 1e3:4.1f} GB/s)  paged 8 x {n // 4}: {p:6.0f} us", flush=True)
op.set_avx512_bf16(False)
a = op.decode_attention(q, *layers[0], 0.125)
op.set_avx512_bf16(True)
b = op.decode_attention(q, *layers[0], 0.125)
print("max |out avx2 - out avx512| =", (a[0].float() - b[0].float()).abs().max().item(),
      " max |lse diff| =", (a[1] - b[1]).abs().max().item())
