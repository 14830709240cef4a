"""Attention over a long context split into blocks, merged exactly (what every Magnetar rank does in Phase 2).

    python examples/split_and_merge.py --blocks 4 --seq-len 8192
"""
import argparse

import torch

from magnetar.ops import attention_with_lse, merge_states


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--blocks", type=int, default=4)
    args = p.parse_args()
    S, n = args.seq_len, args.blocks
    q = torch.randn(1, 9, 1, 64)  # one decode query, SmolLM2-135M geometry
    k, v = torch.randn(1, 3, S, 64), torch.randn(1, 3, S, 64)
    q_pos = torch.tensor([S])
    parts = [attention_with_lse(q, kb, vb, q_pos=q_pos, k_pos=pb)
             for kb, vb, pb in zip(k.chunk(n, 2), v.chunk(n, 2), torch.arange(S).chunk(n))]
    out, lse = merge_states([o for o, _ in parts], [l for _, l in parts])
    ref, ref_lse = attention_with_lse(q, k, v, q_pos=q_pos)
    print(f"{n} blocks of {S // n} tokens: max |out - dense| = {(out - ref).abs().max():.2e}, "
          f"max |lse - dense| = {(lse - ref_lse).abs().max():.2e}")


if __name__ == "__main__":
    main()
