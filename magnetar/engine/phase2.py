"""Phase 2 and decoding: the query attends to the whole distributed KV cache, then tokens are generated.

Every CP rank runs the same forward on the same tokens (the query, then each generated token): attention
over its own context shard, and on the query rank (cp_rank 0, the only one that stores query/generated KV)
over those tokens causally; one packed all-gather of ``(out, lse)`` per layer and the merge make every
rank's output identical. The next token is chosen on the query rank (greedy or seeded sampling) and
broadcast, so all ranks decode the same sequence. Stops at EOS, a stop string or ``max_new_tokens``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from magnetar.config import DecodeConfig, EngineConfig
from magnetar.engine.hf import ForwardContext
from magnetar.engine.kv import KVShard
from magnetar.parallel import ParallelGroups
from magnetar.parallel.collectives import wait_all
from magnetar.utils.nvtx import nvtx_range


@dataclass
class DecodeResult:
    token_ids: list[int]
    ttft_seconds: float
    decode_seconds: list[float] = field(default_factory=list)  # per generated token after the first
    stop_reason: str = "max_new_tokens"
    first_logits: Optional[torch.Tensor] = None
    gen_kv_tokens: int = 0


def choose_token(logits: torch.Tensor, cfg: DecodeConfig, generator: Optional[torch.Generator]) -> int:
    """Greedy (temperature 0) or temperature / top-k / top-p sampling from ``logits (V,)``."""
    if cfg.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / cfg.temperature, dim=-1)
    if cfg.top_k:
        kth = torch.topk(probs, min(cfg.top_k, probs.numel())).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if cfg.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        drop = torch.cumsum(sorted_p, 0) - sorted_p > cfg.top_p * sorted_p.sum()
        sorted_p[drop] = 0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
    return int(torch.multinomial(probs.cpu() / probs.sum(), 1, generator=generator))


def _broadcast_token(token: int, groups: ParallelGroups, device) -> int:
    if groups.cp_size == 1:
        return token
    t = torch.tensor([token], dtype=torch.long, device=device)
    work = dist.broadcast(t, src=groups.cp_ranks[0], group=groups.cp_group, async_op=True)
    wait_all(work, groups.timeout, "next-token broadcast")
    return int(t.item())


@torch.inference_mode()
def run_phase2(model, config: EngineConfig, shard: KVShard, query_ids: torch.Tensor, query_position: int,
               groups: ParallelGroups, device, *, max_new_tokens: int, eos_ids: Sequence[int] = (),
               stop_check=None, keep_logits: bool = False) -> DecodeResult:
    """Run the query through the model over the distributed KV, then decode up to ``max_new_tokens``."""
    leader = groups.is_cp_leader
    gen = KVShard(model.config.num_hidden_layers) if leader else None
    if gen is not None:
        gen.freeze()
    generator = torch.Generator().manual_seed(config.decode.seed) if config.decode.temperature > 0 else None
    backend = config.runtime.attention_backend

    def step(ids: torch.Tensor, start: int) -> torch.Tensor:
        pos = torch.arange(start, start + ids.numel(), device=device)
        ctx = ForwardContext("phase2", pos, shard, gen=gen, group=groups.cp_group, timeout=groups.timeout,
                             backend=backend)
        out = model(input_ids=ids.to(device)[None], position_ids=pos[None], use_cache=False, logits_to_keep=1,
                    magnetar=ctx)
        return out.logits[0, -1]

    t0 = time.perf_counter()
    with nvtx_range("phase2/query"):
        logits = step(query_ids, query_position)
        token = _broadcast_token(choose_token(logits, config.decode, generator) if leader else -1, groups, device)
    result = DecodeResult([token], time.perf_counter() - t0,
                          first_logits=logits.float().cpu() if keep_logits else None)
    next_pos = query_position + int(query_ids.numel())
    while True:
        if token in eos_ids:
            result.stop_reason = "eos"
            break
        if stop_check is not None and stop_check(result.token_ids):
            result.stop_reason = "stop_string"
            break
        if len(result.token_ids) >= max_new_tokens:
            break
        t1 = time.perf_counter()
        with nvtx_range("phase2/decode_step"):
            logits = step(torch.tensor([token]), next_pos)
            token = _broadcast_token(choose_token(logits, config.decode, generator) if leader else -1, groups, device)
        result.decode_seconds.append(time.perf_counter() - t1)
        result.token_ids.append(token)
        next_pos += 1
    result.gen_kv_tokens = gen.tokens() if gen is not None else 0
    return result
