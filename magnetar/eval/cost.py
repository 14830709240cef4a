"""Analytic cost model of the engine's methods: tokens, FLOPs, memory and communication, per rank.

    python -m magnetar.eval.cost --model smollm2-135m-instruct --lengths 16k,128k,1m --cp 4
    python -m magnetar.eval.cost --model path/to/config.json --methods star,pulsar --lengths 64k --cp 8 \
        --dtype bfloat16                                # any Hugging Face config: no weights are read

Generalises the Phase-1 cost model of Pulsar Attention (Sood & Acharya, Sec. 5.2, Eq. 4-7, Tables 4-5) from
"Llama-3.1-8B, B = 4 blocks, one block per GPU" to any Hugging Face causal-LM config and any
:class:`magnetar.config.EngineConfig` (dense, ring, star, pulsar, streaming; any ``cp_size``, block size,
anchor, sink, chunk size and summary budget), and from ``n^2`` to exact causal pair counts.

What is counted (``E = H_Q d_h`` query width, ``K = H_KV d_h`` key/value width, ``h`` hidden, ``I`` MLP width)

* **Phase-1 inputs** come from the engine's own planner (:func:`magnetar.engine.strategy.plan_rank`), so they
  are the segments the engine runs: dense ``[0, L)``; ring the (zigzag) shard; star ``anchor ‖ block``;
  pulsar ``sink ‖ Σ_0 … Σ_{i-1} ‖ block`` with ``num_summary_chunks`` rounding; streaming window chunks.
  Pulsar's summaries depend on the tokens: without ``context_ids`` the model assumes the sink and ``Σ_0``
  do not overlap (Eq. 4's ``k + (B-1)s``, an upper bound of the engine's de-duplicated prefix; exact for
  the ``even`` scorer, whose positions do not depend on the tokens); with ``context_ids`` it is exact.
* **Attention FLOPs** ``= 4 · pairs · E`` per layer (``QKᵀ`` and ``PV``, 2 FLOPs per multiply-add), where
  ``pairs`` counts the visible ``(query, key)`` pairs exactly, by position: causal inside a segment (the
  prefix of a star/pulsar block is fully visible to the block), a ring shard sees every earlier key of the
  whole context, a streaming chunk sees its sinks, the previous window and itself, and sliding-window
  layers (Gemma-3, Mistral) only see ``k_pos > q_pos - window``. Softmax/RoPE/norms are not counted.
* **Linear FLOPs** ``= 2 · (2hE + 2hK + 3hI)`` per token per layer (Q, K, V, O projections and the SwiGLU
  MLP's 3 matrices); Phase 1 runs the base model (no LM head); Phase 2 adds ``2hV`` for one logits row.
* **Activation memory** per layer of the longest segment ``n``: ``n (h + E + 2K)`` elements (hidden states
  and the segment's Q, K, V: Pulsar Table 4's convention, 20 KB/token for Llama-3.1-8B in fp16), plus the
  ``H_Q · n · n_keys`` score matrix only when ``flash=False``; the MLP's ``n (h + 2I)`` is reported apart.
* **KV kept** per rank after Phase 1: ``2 · layers · K`` elements per token (128 KiB/token for Llama-8B
  fp16); anchors and (by default) summaries are discarded, so the ranks' kept tokens add up to ``L``.
* **Phase 2**: the query (``Q`` tokens) runs on every rank over its KV (rank 0 also over the query
  itself); per decode token each rank reads all its KV; per layer one packed all-gather of ``(out, lse)``:
  every rank contributes ``S · H_Q · (d_h · bytes + 4)`` bytes (lse in float32). Ring's Phase 1 moves every
  other rank's KV shard past each rank once per layer.

The paper's own convention, ``F = 2 n^2 (H_Q + H_KV) d_h`` per layer for the critical block, is kept in
:func:`paper_phase1_flops_per_layer` so Table 4 can be reproduced number for number.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import torch

from magnetar.config import EngineConfig
from magnetar.engine.plan import kept_token_count
from magnetar.engine.strategy import context_method, plan_for_length, plan_rank
from magnetar.models.dims import ModelDims

__all__ = ["CostEstimate", "estimate", "format_table", "paper_phase1_flops_per_layer", "attention_pairs",
           "priced_seconds", "format_priced"]

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ------------------------------------------------------------------------------------------------ counting
def attention_pairs(q_pos: torch.Tensor, k_pos: torch.Tensor, window: Optional[int] = None) -> int:
    """Visible ``(q, k)`` pairs: ``k_pos <= q_pos`` (and ``k_pos > q_pos - window``); any q order."""
    if q_pos.numel() == 0 or k_pos.numel() == 0:
        return 0
    k = torch.sort(k_pos.long()).values
    q = q_pos.long()
    hi = torch.searchsorted(k, q, right=True)
    if window is not None:
        hi = hi - torch.searchsorted(k, q - window, right=True)
    return int(hi.sum())


def _pairs_per_layer(q_pos, k_pos, dims: ModelDims) -> list[int]:
    cache = {w: attention_pairs(q_pos, k_pos, w) for w in set(dims.windows)}
    return [cache[w] for w in dims.windows]


def paper_phase1_flops_per_layer(n: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """Pulsar Sec. 5.2: ``F = 2 n^2 (H_Q + H_KV) d_h`` (the convention of Table 4)."""
    return 2 * n * n * (heads + kv_heads) * head_dim


# --------------------------------------------------------------------------------------------- the estimate
@dataclass
class CostEstimate:
    """Per-rank lists (index = CP rank) and the critical path (the slowest rank by Phase-1 FLOPs).

    FLOPs are totals over all layers; ``*_per_layer`` fields are per layer. Bytes use the config's dtype."""

    method: str
    context_len: int
    query_len: int
    cp_size: int
    dtype_bytes: int
    model: dict
    # Phase 1, per rank
    phase1_input_lengths: list[list[int]]  # model input length of every segment (prefix + block) on the rank
    phase1_tokens: list[int]  # sum of the above: tokens through the linear layers
    phase1_attention_pairs: list[int]  # visible (q, k) pairs, summed over layers
    phase1_attention_flops: list[int]
    phase1_linear_flops: list[int]
    phase1_flops: list[int]
    activation_bytes_per_layer: list[int]  # longest segment: hidden + Q + K + V (+ scores if not flash)
    mlp_activation_bytes_per_layer: list[int]  # longest segment: hidden + gate + up
    phase1_comm_bytes_per_layer: list[int]  # KV bytes sent per rank in each exchanging layer (ring, hybrid); else 0
    kv_tokens: list[int]  # context KV tokens kept after Phase 1 (streaming: after eviction)
    kv_bytes: list[int]
    peak_memory_bytes: list[int]  # weights + kept KV + the larger activation stage
    # Phase 2, per rank
    phase2_query_flops: list[int]
    decode_flops_per_token: list[int]
    decode_kv_read_bytes_per_token: list[int]
    phase2_comm_bytes_per_layer_query: int  # bytes each rank contributes to the per-layer all-gather (query)
    phase2_comm_bytes_per_layer_decode: int  # same, per decode token
    # critical path
    critical_rank: int = 0
    critical_input_len: int = 0  # the longest Phase-1 segment on any rank (Pulsar's n, Eq. 4)
    critical_phase1_flops: int = 0
    critical_attention_flops: int = 0
    critical_activation_bytes_per_layer: int = 0
    max_kv_bytes: int = 0
    critical_decode_flops_per_token: int = 0
    critical_decode_kv_read_bytes: int = 0
    paper_flops_per_layer: int = 0  # 2 n^2 (H_Q + H_KV) d_h at critical_input_len
    phase1_comm_layers: int = 0  # layers whose Phase 1 exchanges KV over the CP group (ring: all; hybrid: exact_layers)
    weight_bytes: int = 0
    assumptions: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _model_dims(model_config) -> ModelDims:
    return model_config if isinstance(model_config, ModelDims) else ModelDims.from_config(model_config)


def estimate(model_config, engine_config: EngineConfig, context_len: int, query_len: int = 32, *,
             context_ids: Optional[torch.Tensor] = None, flash: bool = True,
             dtype_bytes: Optional[int] = None) -> CostEstimate:
    """Cost of one request of ``context_len`` context and ``query_len`` query tokens under ``engine_config``.

    ``model_config``: an HF config (or dict with its field names, or :class:`ModelDims`). ``context_ids``
    (optional) makes Pulsar's summary selection exact; ``flash=False`` adds the score matrices to the
    activation memory; ``dtype_bytes`` overrides the config's ``runtime.dtype`` (``auto``: the dtype the model
    config names, float32 if none -- what the engine loads).

    The stages: the units (:class:`_Units`: bytes and FLOPs per token, pair and weight under the dtype and the
    TP split), the method's plan of every rank, each rank's Phase 1 (:func:`_phase1`) and Phase 2
    (:func:`_phase2`), then the critical rank and totals.
    """
    _check_request(engine_config, context_len, query_len, context_ids)
    dims = _model_dims(model_config)
    cfg, L, Q, W = engine_config, context_len, query_len, engine_config.parallel.cp_size
    u = _Units.of(dims, cfg, dtype_bytes)
    method = context_method(cfg.method)  # what the method says of its costs: no method is named here
    assumptions = u.assumptions + method.cost_assumptions(cfg, with_ids=context_ids is not None)
    # the cost of the method's own plan (without token ids: the plan it assumes for the length)
    if context_ids is not None:
        plans = [plan_rank(cfg, context_ids.reshape(-1).long(), r) for r in range(W)]
    else:
        plans = [plan_for_length(cfg, L, r) for r in range(W)]
    # shards that circulate (ring): their communication and all-earlier-keys attention
    ring_lengths = [int(p.segments[0].indices.numel()) for p in plans] if method.lockstep_ranks else None
    # hybrid layers: those layers' queries see every earlier key, the ranks' kept blocks circulate as ring's shards
    exact = frozenset(method.exact_layers(cfg, dims.layers)) if W > 1 else frozenset()
    if exact:
        assumptions.append(f"exact_layers: {len(exact)} of {dims.layers} layers attend every earlier block and send "
                           f"the ranks' kept KV around the ring in those layers (traffic not in the FLOPs)")
    blocks = [kept_token_count(p) for p in plans]
    fields_ = {k: [] for k in _PER_RANK}
    for r, plan in enumerate(plans):
        phase1, kept = _phase1(method, cfg, plan, r, L, dims, u, flash, ring_lengths, exact, blocks)
        for k, v in {**phase1, **_phase2(plan.query_position, Q, r, kept, dims, u)}.items():
            fields_[k].append(v)
    per_tok = dims.heads // u.tp * (dims.head_dim * u.b + 4) if W > 1 else 0
    crit = max(range(W), key=lambda r: fields_["phase1_flops"][r])
    n_crit = max((max(l) for l in fields_["phase1_input_lengths"] if l), default=0)
    return CostEstimate(
        method=cfg.method, context_len=L, query_len=Q, cp_size=W, dtype_bytes=u.b,
        model={k: v for k, v in asdict(dims).items()},
        **fields_,
        phase2_comm_bytes_per_layer_query=Q * per_tok, phase2_comm_bytes_per_layer_decode=per_tok,
        critical_rank=crit, critical_input_len=n_crit,
        critical_phase1_flops=fields_["phase1_flops"][crit],
        critical_attention_flops=fields_["phase1_attention_flops"][crit],
        critical_activation_bytes_per_layer=max(fields_["activation_bytes_per_layer"]),
        max_kv_bytes=max(fields_["kv_bytes"]),
        critical_decode_flops_per_token=max(fields_["decode_flops_per_token"]),
        critical_decode_kv_read_bytes=max(fields_["decode_kv_read_bytes_per_token"]),
        paper_flops_per_layer=paper_phase1_flops_per_layer(n_crit, dims.heads, dims.kv_heads, dims.head_dim),
        weight_bytes=u.weight_bytes, assumptions=assumptions,
        phase1_comm_layers=dims.layers if ring_lengths is not None else len(exact),
    )


# the per-rank lists of a CostEstimate, in the order the stages fill them
_PER_RANK = ("phase1_input_lengths", "phase1_tokens", "phase1_attention_pairs", "phase1_attention_flops",
             "phase1_linear_flops", "phase1_flops", "activation_bytes_per_layer", "mlp_activation_bytes_per_layer",
             "phase1_comm_bytes_per_layer", "kv_tokens", "kv_bytes", "peak_memory_bytes", "phase2_query_flops",
             "decode_flops_per_token", "decode_kv_read_bytes_per_token")


def _check_request(engine_config, context_len, query_len, context_ids) -> None:
    if not isinstance(engine_config, EngineConfig):
        raise TypeError(f"engine_config must be a magnetar.config.EngineConfig, got {type(engine_config).__name__}")
    for name, v in (("context_len", context_len), ("query_len", query_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if context_ids is not None and int(context_ids.numel()) != context_len:
        raise ValueError(f"context_ids has {context_ids.numel()} tokens but context_len is {context_len}")


@dataclass(frozen=True)
class _Units:
    """Bytes and FLOPs per unit, for one TP rank: under tensor parallelism heads (so KV and attention), the
    layers' projections and the LM head split ``tp`` ways, embeddings and norms whole (DeepSpeed AutoTP)."""

    b: int  # bytes per element
    tp: int
    kv_tok_bytes: int  # KV of one token, all layers
    lin_tok: int  # projection + MLP FLOPs of one token, all layers
    attn_pair_flops: int  # per (query, key) pair per layer
    head_flops: int  # the LM head, per token
    weight_bytes: int
    assumptions: list

    @classmethod
    def of(cls, dims: ModelDims, cfg: EngineConfig, dtype_bytes: Optional[int]) -> "_Units":
        # runtime.dtype "auto" (the default): the checkpoint's, as its config names it (ModelDims.dtype)
        b = dtype_bytes if dtype_bytes is not None else _DTYPE_BYTES.get(cfg.runtime.dtype, _DTYPE_BYTES[dims.dtype])
        tp = cfg.parallel.tp_size
        emb = dims.vocab * dims.hidden
        weight_bytes = ((dims.params - emb) // tp + emb) * b if tp > 1 else dims.params * b
        assumptions = [f"tp_size {tp}: figures per TP rank (heads, projections and LM head split {tp} ways, "
                       f"embeddings whole); the two TP all-reduces per layer are not counted"] if tp > 1 else []
        return cls(b, tp, kv_tok_bytes=2 * dims.layers * dims.kv_dim * b // tp,
                   lin_tok=dims.layers * dims.linear_flops_per_token_layer // tp, attn_pair_flops=4 * dims.q_dim // tp,
                   head_flops=2 * dims.hidden * dims.vocab // tp, weight_bytes=weight_bytes, assumptions=assumptions)


def _phase1(method, cfg: EngineConfig, plan, r: int, L: int, dims: ModelDims, u: _Units, flash: bool,
            ring_lengths: Optional[list[int]], exact: frozenset = frozenset(),
            blocks: Sequence[int] = ()) -> tuple[dict, torch.Tensor]:
    """Rank ``r``'s Phase-1 figures of ``plan``, and the context positions whose KV it keeps. ``exact``: the hybrid
    layers, ``blocks``: every rank's kept token count (what circulates in those layers)."""
    b = u.b
    pairs = [0] * dims.layers
    lengths, act, mlp_act, comm = [], 0, 0, 0
    if ring_lengths is not None:  # every query of the shard sees all earlier keys of the context
        qp = plan.segments[0].indices
        pairs = _pairs_per_layer(qp, torch.arange(L), dims)
        lengths = [int(qp.numel())]
        kept = torch.sort(qp).values
        n, n_keys = lengths[0], max(ring_lengths)  # scores: one shard of keys per ring step
        act = n * (dims.hidden + dims.q_dim + 2 * dims.kv_dim) * b + (0 if flash else dims.heads * n * n_keys * b)
        mlp_act = n * (dims.hidden + 2 * dims.intermediate) * b
        comm = _ring_sends(ring_lengths, r, dims, b)
    else:
        kept_parts, seen = [], torch.zeros(0, dtype=torch.long)
        for seg in plan.segments:
            pos = seg.positions.long()
            n = int(pos.numel())
            lengths.append(n)
            keys = method.visible_keys(cfg, pos, seen)  # itself, and what the method lets it see before
            seen = torch.cat((seen, pos))
            local = _pairs_per_layer(pos, keys, dims)
            # a hybrid layer: every earlier position (the earlier blocks' KV, then its own block's), causally
            full = _pairs_per_layer(pos, torch.arange(int(pos.max()) + 1), dims) if exact and n else local
            for layer in range(dims.layers):
                pairs[layer] += full[layer] if layer in exact else local[layer]
            act = max(act, n * (dims.hidden + dims.q_dim + 2 * dims.kv_dim) * b
                      + (0 if flash else dims.heads * n * int(keys.numel()) * b))
            mlp_act = max(mlp_act, n * (dims.hidden + 2 * dims.intermediate) * b)
            kept_parts.append(pos[seg.keep])
        kept = torch.sort(torch.cat(kept_parts)).values if kept_parts else torch.zeros(0, dtype=torch.long)
        kept = method.kept_positions(cfg, kept, L)
        if exact:  # as ring, in each hybrid layer: the ranks' kept blocks circulate
            comm = _ring_sends(blocks, r, dims, b)
    tokens, attn, kv_tokens = sum(lengths), sum(pairs) * u.attn_pair_flops, int(kept.numel())
    lin = tokens * u.lin_tok
    return {"phase1_input_lengths": lengths, "phase1_tokens": tokens, "phase1_attention_pairs": sum(pairs),
            "phase1_attention_flops": attn, "phase1_linear_flops": lin, "phase1_flops": attn + lin,
            "activation_bytes_per_layer": act, "mlp_activation_bytes_per_layer": mlp_act,
            "phase1_comm_bytes_per_layer": comm, "kv_tokens": kv_tokens, "kv_bytes": kv_tokens * u.kv_tok_bytes,
            "peak_memory_bytes": u.weight_bytes + kv_tokens * u.kv_tok_bytes + max(act, mlp_act)}, kept


def _ring_sends(lengths: Sequence[int], r: int, dims: ModelDims, b: int) -> int:
    """KV bytes rank ``r`` sends in one layer of a ring pass of shards of ``lengths`` tokens: step s sends the shard
    that started on rank (r - s), W-1 sends of KV (+ int64 positions)."""
    W = len(lengths)
    return sum(lengths[(r - s) % W] * (2 * dims.kv_dim * b + 8) for s in range(W - 1))


def _phase2(qpos0: int, Q: int, r: int, kept: torch.Tensor, dims: ModelDims, u: _Units) -> dict:
    """Rank ``r``'s Phase-2 figures: the query on every rank over its context KV, rank 0 also over the
    query/generated tokens; the first decode step (one generated token in the KV)."""
    qp = torch.arange(qpos0, qpos0 + Q)
    own = qp if r == 0 else torch.zeros(0, dtype=torch.long)
    q_pairs = sum(_pairs_per_layer(qp, kept, dims)) + sum(_pairs_per_layer(qp, own, dims))
    dp = torch.tensor([qpos0 + Q])
    own_d = torch.arange(qpos0, qpos0 + Q + 1) if r == 0 else torch.zeros(0, dtype=torch.long)
    d_pairs = sum(_pairs_per_layer(dp, kept, dims)) + sum(_pairs_per_layer(dp, own_d, dims))
    return {"phase2_query_flops": q_pairs * u.attn_pair_flops + Q * u.lin_tok + u.head_flops,
            "decode_flops_per_token": d_pairs * u.attn_pair_flops + u.lin_tok + u.head_flops,
            "decode_kv_read_bytes_per_token": (int(kept.numel()) + (Q + 1 if r == 0 else 0)) * u.kv_tok_bytes}


# ---------------------------------------------------------------------------------------------------- table
def _fmt(x: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}"


def priced_seconds(est: CostEstimate, tflops: float, link_gbps: float) -> list[float]:
    """Each rank's Phase-1 seconds on a card computing ``tflops`` (dense TFLOP/s, what the kit measured) whose ranks
    exchange KV over a ``link_gbps`` GB/s link (NVLink ~450, a network ~50), with the overlap rule of a ring: a layer
    that exchanges KV costs max(its compute, its transfer) -- the sends overlap the attention they feed, an optimistic
    bound at layer granularity --, the others their compute alone (FLOPs spread evenly over the layers)."""
    if not (tflops > 0 and link_gbps > 0):
        raise ValueError(f"tflops and link_gbps must be > 0, got {tflops} and {link_gbps}")
    layers = int(est.model["layers"])
    out = []
    for flops, sent in zip(est.phase1_flops, est.phase1_comm_bytes_per_layer):
        compute = flops / layers / (tflops * 1e12)
        transfer = sent / (link_gbps * 1e9)
        out.append(est.phase1_comm_layers * max(compute, transfer) + (layers - est.phase1_comm_layers) * compute)
    return out


def format_table(estimates: Sequence[CostEstimate], baseline: Optional[str] = "dense") -> str:
    """A Markdown table, one row per estimate; ``x base`` = critical Phase-1 FLOPs relative to the first
    estimate of method ``baseline`` with the same context length (if any); ``P1 KV traffic/rank``: the KV one rank
    sends in Phase 1 (ring: every layer; hybrid layers: those layers; the others: none)."""
    base = {}
    for e in estimates:
        if e.method == baseline:
            base.setdefault(e.context_len, e.critical_phase1_flops)
    head = ("| method | L | cp | crit. input n | crit. P1 FLOPs | attn share | vs " + str(baseline)
            + " | act/layer | KV/rank (max) | decode KV read/tok | P1 KV traffic/rank | P2 comm/layer/tok |")
    rows = [head, "|" + "---|" * 12]
    for e in estimates:
        ratio = f"{e.critical_phase1_flops / base[e.context_len]:.3f}" if e.context_len in base else "-"
        share = e.critical_attention_flops / e.critical_phase1_flops if e.critical_phase1_flops else 0.0
        rows.append(f"| {e.method} | {e.context_len} | {e.cp_size} | {e.critical_input_len} | "
                    f"{_fmt(e.critical_phase1_flops, 'FLOP')} | {share:.0%} | {ratio} | "
                    f"{_fmt(e.critical_activation_bytes_per_layer, 'B')} | {_fmt(e.max_kv_bytes, 'B')} | "
                    f"{_fmt(e.critical_decode_kv_read_bytes, 'B')} | "
                    f"{_fmt(max(e.phase1_comm_bytes_per_layer, default=0) * e.phase1_comm_layers, 'B')} | "
                    f"{_fmt(e.phase2_comm_bytes_per_layer_decode, 'B')} |")
    return "\n".join(rows)


def format_priced(estimates: Sequence[CostEstimate], tflops: float, links: Sequence[float],
                  baseline: Optional[str] = "dense") -> str:
    """A Markdown table of each estimate's Phase-1 critical path in seconds at ``tflops`` over each link of
    ``links`` (GB/s; :func:`priced_seconds`), and its speed-up over ``baseline`` at the same length."""
    base = {}
    for e in estimates:
        if e.method == baseline:
            base.setdefault(e.context_len, max(priced_seconds(e, tflops, links[0])))
    head = "| method | L | cp | " + " | ".join(f"crit. P1 s @ {g:g} GB/s (vs {baseline})" for g in links) + " |"
    rows = [head, "|" + "---|" * (3 + len(links))]
    for e in estimates:
        cells = []
        for g in links:
            t = max(priced_seconds(e, tflops, g))
            cells.append(f"{t:.4g}" + (f" ({base[e.context_len] / t:.2f}x)" if e.context_len in base else ""))
        rows.append(f"| {e.method} | {e.context_len} | {e.cp_size} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


# ------------------------------------------------------------------------------------------------------ CLI
def _load_config(name: str):
    """A config.json file, a registry name (its prepared folder) or a local HF folder -> the HF config."""
    import json
    from pathlib import Path

    from transformers import AutoConfig

    from magnetar.models.prepare import model_path

    path = Path(name).expanduser()
    if path.is_file():
        with open(path) as f:
            data = json.load(f)
        if "model_type" in data:
            return AutoConfig.for_model(**data)
        return data  # a bare dict with the HF field names (ModelDims.from_config reads it)
    if name.startswith("dummy:"):
        from magnetar.models.dummy import dummy_config

        try:
            return dummy_config(name)
        except (FileNotFoundError, ValueError) as e:
            raise SystemExit(f"--model: {e}") from None
    try:
        return AutoConfig.from_pretrained(model_path(name), local_files_only=True)
    except FileNotFoundError as e:
        raise SystemExit(f"--model: {e}; or give a config.json file") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse
    import json
    import sys

    from magnetar.config import METHODS
    from magnetar.eval.common import engine_config, parse_length, parse_links

    p = argparse.ArgumentParser(prog="python -m magnetar.eval.cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="registry name, HF model folder, Hub id org/name already in the Hub cache (nothing is "
                        "downloaded) or config.json (only the config is read)")
    p.add_argument("--methods", default="dense,star,pulsar", help=f"comma-separated, from {','.join(METHODS)}")
    p.add_argument("--lengths", default="16k,64k", help="context lengths, e.g. 32k,128k,1m (k = 1024)")
    p.add_argument("--cp", type=int, default=4, help="CP ranks of ring/star/pulsar (dense, streaming: 1)")
    p.add_argument("--query-len", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPE_BYTES))
    p.add_argument("--no-flash", action="store_true", help="count the score matrices in activation memory")
    for name in ("--block-size", "--anchor-size", "--halo-size", "--sink-size", "--chunk-size", "--window-size"):
        p.add_argument(name, type=int, default=None)
    p.add_argument("--summary-budget", type=float, default=None)
    p.add_argument("--halo-blocks", type=float, default=None)
    p.add_argument("--exact-layers", default=None, help="star, pulsar: hybrid layers ('every:4', '0-3,29', 'all')")
    p.add_argument("--tflops", type=float, default=None, help="price Phase 1 in seconds at this dense TFLOP/s (e.g. "
                   "the GPU kit's measured rate) over each --links link")
    p.add_argument("--links", default="450,50", help="--tflops: link bandwidths in GB/s (NVLink ~450, network ~50)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        p.error(f"--methods: unknown {bad}; choose from {tuple(METHODS)}")
    try:
        lengths = [parse_length(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        p.error(f"--lengths must be comma-separated lengths like 16k,1m, got {args.lengths!r}")
    if not lengths or min(lengths) < 1 or args.cp < 1 or args.query_len < 1:
        p.error("--lengths, --cp and --query-len must be positive")
    if args.tflops is not None and not args.tflops > 0:
        p.error(f"--tflops must be > 0, got {args.tflops}")
    try:
        links = parse_links(args.links)
    except ValueError as e:
        p.error(str(e))
    model_config = _load_config(args.model)
    try:
        ests = [estimate(model_config, engine_config(args, m, args.cp), L, args.query_len, flash=not args.no_flash)
                for L in lengths for m in methods]
    except ValueError as e:
        raise SystemExit(f"cost model: {e}") from None
    print(f"model {args.model}, {args.dtype}, cp {args.cp}, query {args.query_len} "
          f"({'flash' if not args.no_flash else 'materialised scores'})")
    print(format_table(ests, baseline="dense" if "dense" in methods else methods[0]))
    if args.tflops is not None:
        print(f"\nPhase-1 critical path priced at {args.tflops:g} TFLOP/s (ring's KV exchange overlapping its compute, "
              f"layer by layer):")
        print(format_priced(ests, args.tflops, links, baseline="dense" if "dense" in methods else methods[0]))
    notes = sorted({a for e in ests for a in e.assumptions})
    for a in notes:
        print(f"assumed: {a}")
    print(json.dumps(dict(cost_model=args.model, dtype=args.dtype, cp=args.cp, query_len=args.query_len,
                          estimates=[e.to_dict() for e in ests])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
