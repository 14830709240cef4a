"""Pulsar Attention's statistical context summaries: which context tokens each block's Phase 1 sees.

Specification: *Dropping the Anchor: Statistical Context Summarization for Distributed Systems via Pulsar
Attention* (Sood & Acharya), Section 3.1, Algorithm 1, Eqs. (1)-(3) and Appendices C-F. Section and
equation numbers below refer to that paper.

What it does
------------
The context (``L`` token ids) is split into contiguous blocks ``B_0 .. B_{n-1}``. Phase 1 encodes each block
on its own; block ``i > 0`` is encoded with a prefix (Eq. 3, Algorithm 1 line 6)::

    Input_0 = [B_0]
    Input_i = [S_sink || Sigma_0 || ... || Sigma_{i-1} || B_i]

* ``S_sink = B_0[0:sink_size]`` -- the attention sink (Section 3.1, default 64 tokens, Table 9).
* ``Sigma_j`` -- the summary of block ``j``: the top-``k`` non-overlapping contiguous chunks of
  ``chunk_size`` tokens (default 32) of ``B_j``, scored with a corpus statistic and returned in positional
  order (Section 3.1, Appendix C). The budget is ``budget * |B_j|`` tokens (default 0.125, Table 9).
* The statistic comes from a corpus IDF table built from the token ids alone (Eq. 2 / Eq. 8): the
  *documents* are the blocks, so ``df(t)`` = number of blocks containing ``t`` and ``N`` = number of blocks.
  It needs no model and no communication: every rank computes the same table from the whole context.

This module computes, for every block, the *global indices* of its prefix tokens and the RoPE positions to
give them ("sparse": original positions, the paper's default; "contiguous": renumbered, Appendix E), plus
the position at which Phase 2's query starts. After the forward pass only the block's own ``|B_i|`` KV
entries are kept (Appendix F): they are the last ``|B_i|`` entries of the assembled input.

What it does not know
---------------------
No model, no tokenizer, no ranks, no devices: pure CPU torch/python on integer token ids, deterministic
(identical input gives identical output on every rank). Which rank owns which block, the forward pass, the
KV discard and Phase 2 belong to the engine. The scorer names, position modes and Table 9 defaults are
:mod:`magnetar.config`'s (``SCORERS``, ``POSITION_MODES``, :class:`~magnetar.config.PulsarConfig`), which also
checks them: the options reach this module validated, and it does not check them again. One planner,
:func:`plan_pulsar`, serves both the engine (token ids given) and the cost model (``context_ids=None``: the
summaries are then placed to give the largest prefix, Eq. 4's upper bound -- exact for ``even``).

Choices where the paper is silent (each is repeated where it applies)
----------------------------------------------------------------------
* Chunk count ``k = clamp(ceil(budget * |B| / chunk_size), 1, n_chunks)`` (:func:`num_summary_chunks`). The
  paper only gives the exact case 4096 * 0.125 / 32 = 16 (Table 9). Ceil keeps at least one chunk for any
  budget > 0 and makes ``budget = 1.0`` select every chunk, including a partial last one.
* A block whose length is not a multiple of ``chunk_size`` ends with one shorter chunk, scored on its
  actual tokens and length (``|C|`` in Eqs. 9-11 is that length).
* Ties in score: the earlier chunk wins.
* The sink and ``Sigma_0`` can overlap (both come from ``B_0``). Eq. 3 would then repeat tokens. Here the
  prefix is the sorted union, so every token appears once at its one position. Because the sink is
  ``B_0``'s first tokens and every summary lies inside its own block, the sorted union is Eq. 3's order
  with repeats removed. With ``budget = 1.0`` the prefix of block ``i`` is exactly ``arange(start_i)``.
* ``even`` follows Eq. 13 literally: ``s = k * chunk_size`` single tokens (capped at ``|B|``) at
  ``floor(linspace(0, |B|-1, s))``, not whole chunks.
* BM25's mean chunk length ``l_bar`` (Eq. 10) is taken over all chunks of all blocks of the corpus.

Worked example
--------------
12 tokens, 3 blocks of 4, ``chunk_size=2``, ``budget=0.5`` (one chunk of 2 per block), ``sink_size=2``::

    ids    = [5, 6, 7, 8 | 5, 9, 7, 8 | 5, 6, 7, 3]        blocks [0,4) [4,8) [8,12)
    df     : 5,7 -> 3 blocks; 6,8 -> 2; 9,3 -> 1           N = 3
    IDF    : log(3/3)=0 for 5,7; log(3/2)=0.405 for 6,8; log(3)=1.099 for 9,3
    max_idf chunk scores: B_0 (5,6)=0.405 (7,8)=0.405 -> tie, earlier chunk wins: Sigma_0 = local [0,1]
                          B_1 (5,9)=1.099 (7,8)=0.405 -> Sigma_1 = local [0,1] = global [4,5]
    (select_summary returns local indices; pulsar_prefix and PulsarPlan.summaries use global ones)
    sink = [0,1]
    prefix(B_1) = sink U Sigma_0           = [0,1]           (token 0,1 appear once)
    prefix(B_2) = sink U Sigma_0 U Sigma_1 = [0,1,4,5]
    sparse     B_2 input positions [0,1,4,5 | 8,9,10,11], query starts at 12 (= L)
    contiguous B_2 input positions [0,1,2,3 | 4,5,6,7]; assembled lengths 4, 6, 8 -> query starts at 8

>>> import torch
>>> plan = plan_pulsar(torch.tensor([5, 6, 7, 8, 5, 9, 7, 8, 5, 6, 7, 3]), 4, chunk_size=2, budget=0.5,
...                    sink_size=2, position_mode="contiguous")
>>> plan.blocks[2].prefix.tolist(), plan.blocks[2].input_positions.tolist(), plan.query_start
([0, 1, 4, 5], [0, 1, 2, 3, 4, 5, 6, 7], 8)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch

from magnetar.config import POSITION_MODES, SCORERS, PulsarConfig
from magnetar.engine.plan import block_bounds as _tile

__all__ = ["SCORERS", "POSITION_MODES", "DEFAULT_CHUNK_SIZE", "DEFAULT_BUDGET", "DEFAULT_SINK_SIZE", "DEFAULT_SCORER",
           "DEFAULT_POSITION_MODE", "BM25_K1", "BM25_B", "IdfTable", "BlockPlan", "PulsarPlan", "corpus_idf",
           "num_chunks", "num_summary_chunks", "chunk_scores", "select_summary", "sink_indices", "pulsar_prefix",
           "prefix_positions", "query_start_position", "plan_pulsar"]

# The names (SCORERS: Appendix C's heuristics, ``max_idf`` the paper's; POSITION_MODES: Appendix E, ``sparse``
# the paper's) and the Table 9 defaults have one source, magnetar.config; the defaults are PulsarConfig's.
_PULSAR = PulsarConfig()
DEFAULT_CHUNK_SIZE = _PULSAR.chunk_size
DEFAULT_BUDGET = _PULSAR.summary_budget
DEFAULT_SINK_SIZE = _PULSAR.sink_size
DEFAULT_SCORER = _PULSAR.scorer
DEFAULT_POSITION_MODE = _PULSAR.positions
# Appendix C.3.
BM25_K1 = 1.2
BM25_B = 0.75

Bounds = List[Tuple[int, int]]
IdfLike = Union["IdfTable", torch.Tensor, None]


def _ids(ids) -> torch.Tensor:
    """Token ids as a 1-D int64 CPU tensor (lists are accepted)."""
    return torch.as_tensor(ids, dtype=torch.long).detach().reshape(-1).cpu()


def _bounds(block_bounds: Union[Sequence[Tuple[int, int]], int], context_len: int) -> Bounds:
    """``(start, end)`` pairs tiling ``[0, context_len)``; an int is a block size (the engine's tiling)."""
    if isinstance(block_bounds, int):
        return _tile(context_len, block_bounds)
    return [(int(s), int(e)) for s, e in block_bounds]


# ---------------------------------------------------------------------------------------------- IDF table
@dataclass(frozen=True)
class IdfTable:
    """Corpus statistics of Eq. 2 / Appendix C.1, indexed densely by token id.

    Attributes:
        idf: ``(vocab_size,)`` float64, ``IDF(t) = log(N / max(df(t), 1))`` (Eq. 2 = Eq. 8). A token present
            in every block gets 0; a token in one block (or absent from the context) gets ``log N``.
        df: ``(vocab_size,)`` int64, number of blocks containing ``t``.
        n_docs: ``N``, the number of blocks (the IDF "documents").
        doc_lengths: the blocks' lengths, for BM25's mean chunk length (Eq. 10).
    """

    idf: torch.Tensor
    df: torch.Tensor
    n_docs: int
    doc_lengths: Tuple[int, ...]

    @property
    def vocab_size(self) -> int:
        return int(self.idf.numel())

    def bm25_idf(self) -> torch.Tensor:
        """``IDF_BM25(t) = log((N - df(t) + 0.5) / (df(t) + 0.5) + 1)`` (Appendix C.3), ``(vocab_size,)`` float64."""
        df = self.df.to(torch.float64)
        return torch.log((self.n_docs - df + 0.5) / (df + 0.5) + 1.0)

    def mean_chunk_len(self, chunk_size: int) -> float:
        """``l_bar`` of Eq. 10: mean length over every chunk of every block (partial last chunks included)."""
        return sum(self.doc_lengths) / sum(num_chunks(n, chunk_size) for n in self.doc_lengths)


def corpus_idf(context_ids, block_bounds: Union[Sequence[Tuple[int, int]], int], *,
               vocab_size: Optional[int] = None) -> IdfTable:
    """The corpus IDF table of Eq. 2 (Appendix C.1) from the context's token ids alone.

    Documents are the *blocks* (Eq. 2: "df(t) is the number of blocks containing token t", ``n`` = number of
    blocks), i.e. the same blocks that get summarized -- not chunks, and not ranks when a rank holds several
    blocks. Every rank calling this with the same ids and bounds gets the same table. ``block_bounds``: ``(start,
    end)`` pairs tiling ``[0, L)`` or a block size; ``vocab_size``: the table's size (default ``max id + 1``; a
    smaller one is a ValueError). With a single block every IDF is ``log 1 = 0``.
    """
    ids = _ids(context_ids)
    bounds = _bounds(block_bounds, ids.numel())
    top = int(ids.max()) + 1
    if vocab_size is None:
        vocab_size = top
    elif vocab_size < top:
        raise ValueError(f"vocab_size must exceed every token id (max id {top - 1}); got {vocab_size!r}")
    lengths = torch.tensor([e - s for s, e in bounds], dtype=torch.long)
    doc = torch.repeat_interleave(torch.arange(len(bounds), dtype=torch.long), lengths)
    # One (block, token) pair per distinct token of each block; df(t) counts the pairs holding t.
    pairs = torch.unique(doc * vocab_size + ids)
    df = torch.bincount(pairs % vocab_size, minlength=vocab_size)
    n = len(bounds)
    idf = torch.log(n / df.clamp(min=1).to(torch.float64))
    return IdfTable(idf=idf, df=df, n_docs=n, doc_lengths=tuple(int(x) for x in lengths))


# ----------------------------------------------------------------------------------------------- scoring
def num_chunks(block_len: int, chunk_size: int) -> int:
    """Number of non-overlapping chunks of a block: ``ceil(block_len / chunk_size)`` (last one may be short)."""
    return -(-block_len // chunk_size)


def num_summary_chunks(block_len: int, chunk_size: int = DEFAULT_CHUNK_SIZE, budget: float = DEFAULT_BUDGET) -> int:
    """``k``, the chunks selected per block: ``clamp(ceil(budget * block_len / chunk_size), 1, n_chunks)``.

    Section 3.1 gives a budget of ``sigma = budget * |B_i|`` tokens and Table 9 the case 4096 -> 512 tokens
    -> 16 chunks of 32; the rounding is not specified. Chosen: ceil (at least one chunk for any budget > 0;
    ``budget = 1.0`` selects every chunk, partial last chunk included, so Pulsar reduces to dense). The
    selection can exceed ``sigma`` by less than one chunk. A 1e-9 slack absorbs float noise
    (e.g. ``0.1 * 320 / 32``).
    """
    k = math.ceil(budget * block_len / chunk_size - 1e-9)
    return max(1, min(num_chunks(block_len, chunk_size), k))


def _idf_tensor(idf: IdfLike, scorer: str, size_needed: int) -> torch.Tensor:
    if isinstance(idf, IdfTable):
        table = idf.idf
    elif isinstance(idf, torch.Tensor):
        table = idf.detach().to(device="cpu", dtype=torch.float64).reshape(-1)
    else:
        raise ValueError(f"scorer {scorer!r} needs the corpus IDF table: pass idf=corpus_idf(context_ids, "
                         f"block_bounds)")
    if size_needed > table.numel():
        raise ValueError(f"block_ids holds token id {size_needed - 1} but the idf table has {table.numel()} "
                         f"entries; build the table from the whole context (or pass a larger vocab_size)")
    return table


def chunk_scores(block_ids, idf: IdfLike, *, chunk_size: int = DEFAULT_CHUNK_SIZE, scorer: str = DEFAULT_SCORER,
                 k1: float = BM25_K1, b: float = BM25_B, avg_chunk_len: Optional[float] = None) -> torch.Tensor:
    """Score each chunk of one block (Appendix C); returns ``(n_chunks,)`` float64, higher is better.

    Chunk ``c`` is ``block_ids[c*chunk_size : (c+1)*chunk_size]``; the last chunk may be shorter and is scored
    on its actual tokens, with ``|C|`` its actual length.

    * ``max_idf`` -- ``max_{p in C} IDF(t_p)`` (Eq. 1 = Eq. 12).
    * ``tfidf``   -- ``(1/|C|) sum_{p in C} IDF(t_p)`` over positions (Eq. 9).
    * ``bm25``    -- ``sum_{t in types(C)} IDF_BM25(t) tf(t)(k1+1) / (tf(t) + k1(1 - b + b|C|/l_bar))`` (Eq. 10),
      ``k1 = 1.2, b = 0.75``. Needs an :class:`IdfTable` (for ``df`` and ``N``). ``l_bar`` defaults to the
      mean chunk length over all blocks of that table (the paper's "across the corpus");
      ``avg_chunk_len`` overrides it.
    * ``entropy`` -- type-token ratio ``|types(C)| / |C|`` (Eq. 11); ignores ``idf`` (may be None).
      A short last chunk is not penalised (a 1-token chunk scores 1.0), as Eq. 11 is written.
    * ``even`` has no per-chunk score (Eq. 13 picks single tokens by position): raises; use
      :func:`select_summary`.

    ``idf`` is an :class:`IdfTable` or a plain ``(vocab,)`` Eq. 2 tensor (enough for max_idf and tfidf).
    """
    if scorer == "even":
        raise ValueError("scorer 'even' selects evenly spaced tokens (Eq. 13), not scored chunks; call "
                         "select_summary(..., scorer='even') or choose a chunk scorer: "
                         + ", ".join(s for s in SCORERS if s != "even"))
    ids = _ids(block_ids)
    L = ids.numel()
    n = num_chunks(L, chunk_size)
    cid = torch.arange(L) // chunk_size
    lengths = torch.bincount(cid, minlength=n).to(torch.float64)

    if scorer == "entropy":
        width = int(ids.max()) + 1
        types = torch.unique(cid * width + ids)
        return torch.bincount(types // width, minlength=n).to(torch.float64) / lengths

    table = _idf_tensor(idf, scorer, int(ids.max()) + 1)
    if scorer == "max_idf":
        return torch.zeros(n, dtype=torch.float64).scatter_reduce_(0, cid, table[ids], "amax", include_self=False)
    if scorer == "tfidf":
        return torch.zeros(n, dtype=torch.float64).index_add_(0, cid, table[ids]) / lengths

    # bm25
    if not isinstance(idf, IdfTable):
        raise ValueError("scorer 'bm25' needs df and N: pass idf=corpus_idf(...) (an IdfTable), not a bare tensor")
    if avg_chunk_len is None:
        avg_chunk_len = idf.mean_chunk_len(chunk_size)
    V = table.numel()
    keys, tf = torch.unique(cid * V + ids, return_counts=True)
    c, t = keys // V, keys % V
    tf = tf.to(torch.float64)
    norm = k1 * (1.0 - b + b * lengths[c] / float(avg_chunk_len))
    contrib = idf.bm25_idf()[t] * tf * (k1 + 1.0) / (tf + norm)
    return torch.zeros(n, dtype=torch.float64).index_add_(0, c, contrib)


def select_summary(block_ids, idf: IdfLike = None, *, chunk_size: int = DEFAULT_CHUNK_SIZE,
                   budget: float = DEFAULT_BUDGET, scorer: str = DEFAULT_SCORER,
                   avg_chunk_len: Optional[float] = None) -> torch.LongTensor:
    """``Sigma``: indices *within the block* of its summary tokens, ascending (Algorithm 1 line 5).

    Chunk scorers keep the top ``k = num_summary_chunks(len, chunk_size, budget)`` chunks (ties: earlier
    chunk wins) and return all their tokens in positional order, so chunk boundaries are respected. ``even``
    follows Eq. 13: ``s = min(k * chunk_size, len)`` tokens at ``floor(linspace(0, len-1, s))``, computed in
    exact integer arithmetic; these are single tokens, not whole chunks. With ``budget = 1.0`` every scorer
    returns ``arange(len)``.
    """
    ids = _ids(block_ids)
    L = ids.numel()
    k = num_summary_chunks(L, chunk_size, budget)
    if scorer == "even":
        s = min(k * chunk_size, L)
        if s == 1:
            return torch.zeros(1, dtype=torch.long)
        return (torch.arange(s, dtype=torch.long) * (L - 1)) // (s - 1)
    scores = chunk_scores(ids, idf, chunk_size=chunk_size, scorer=scorer, avg_chunk_len=avg_chunk_len).tolist()
    order = sorted(range(len(scores)), key=lambda c: (-scores[c], c))
    return _chunk_tokens(order[:k], L, chunk_size)


def _chunk_tokens(chunks: Sequence[int], block_len: int, chunk_size: int) -> torch.LongTensor:
    """The ascending local indices of the tokens of ``chunks`` of a block."""
    chosen = torch.zeros(num_chunks(block_len, chunk_size), dtype=torch.bool)
    chosen[list(chunks)] = True
    return torch.nonzero(chosen[torch.arange(block_len) // chunk_size]).flatten()


def _largest_prefix_summary(block_len: int, block_index: int, chunk_size: int, budget: float,
                            sink_size: int) -> torch.LongTensor:
    """Without token ids: ``k`` chunks placed to give the largest de-duplicated prefix (Eq. 4's upper bound) --
    block 0's past the sink first (a chunk inside the sink adds no token to the prefix), other blocks' first."""
    k = num_summary_chunks(block_len, chunk_size, budget)
    chunks = list(range(num_chunks(block_len, chunk_size)))
    if block_index == 0:
        past = [c for c in chunks if c * chunk_size >= min(sink_size, block_len)]
        chunks = past + [c for c in chunks if c not in past]
    return _chunk_tokens(chunks[:k], block_len, chunk_size)


# ------------------------------------------------------------------------------------------------ prefix
def sink_indices(block0_len: int, sink_size: int = DEFAULT_SINK_SIZE) -> torch.LongTensor:
    """``S_sink = B_0[0:sink_size]`` (Algorithm 1 line 3) as global indices; clipped to ``B_0``."""
    return torch.arange(min(sink_size, block0_len), dtype=torch.long)


def pulsar_prefix(context_len: int, block_bounds: Union[Sequence[Tuple[int, int]], int], block_index: int,
                  summaries: Sequence, sink_size: int = DEFAULT_SINK_SIZE, halo: int = 0) -> torch.LongTensor:
    """Global indices of ``[S_sink || Sigma_0 || ... || Sigma_{i-1}]`` for block ``i`` (Eq. 3), each once.

    ``summaries[j]``: the *global* indices of ``Sigma_j`` (``select_summary(B_j, ...) + start_j``), for at least
    every ``j < i``; ``sink_size`` is clipped to ``|B_0|``. Ascending int64 global indices, no duplicates: Eq. 3
    would repeat a sink token that also lies in a selected chunk of ``B_0``; here it appears once (its one
    position). Since the sink opens ``B_0`` and each ``Sigma_j`` lies in ``B_j``, ascending order *is* Eq. 3's
    concatenation order minus repeats. With every earlier token selected (``budget = 1.0``) this is exactly
    ``arange(start_i)``; block 0 is encoded alone (empty prefix).

    ``halo`` W (Magnetar's option, issue 30, as Star's): the prefix also holds the W tokens just before block
    ``i``, ``[start_i - W, start_i)``, each token once with the sink and the summaries.
    """
    bounds = _bounds(block_bounds, context_len)
    if block_index == 0:
        return torch.zeros(0, dtype=torch.long)
    parts = [sink_indices(bounds[0][1], sink_size)] + [_ids(summaries[j]) for j in range(block_index)]
    start = bounds[block_index][0]
    if halo:
        parts.append(torch.arange(max(0, start - halo), start, dtype=torch.long))
    return torch.unique(torch.cat(parts), sorted=True)


# --------------------------------------------------------------------------------------------- positions
def prefix_positions(prefix_indices, block_start: int, block_len: int, *,
                     mode: str = DEFAULT_POSITION_MODE) -> Tuple[torch.LongTensor, torch.LongTensor]:
    """RoPE position ids ``(prefix_pos, block_pos)`` for the assembled input ``[prefix || B_i]`` (Appendix E).

    * ``sparse`` (default, Section 3.1 and Table 9): every token keeps its global position;
      ``prefix_pos = prefix_indices``, ``block_pos = arange(block_start, block_start + block_len)``; the
      sequence has gaps where unselected tokens were dropped.
    * ``contiguous``: the assembled input is renumbered ``0 .. L_i - 1`` with ``L_i = P + block_len``
      (``P = len(prefix)``): ``prefix_pos = arange(P)``, ``block_pos = arange(P, L_i)``. The query then starts
      past the longest assembled input (:func:`query_start_position`). Example: prefix ``[0, 1, 4, 5]``,
      block ``[8, 12)`` -> sparse ``[0,1,4,5] | [8,9,10,11]``, contiguous ``[0,1,2,3] | [4,5,6,7]``.

    For block 0 (empty prefix) both modes give ``arange(block_len)``.
    """
    pre = _ids(prefix_indices)
    if mode == "sparse":
        return pre.clone(), torch.arange(block_start, block_start + block_len, dtype=torch.long)
    P = pre.numel()
    return torch.arange(P, dtype=torch.long), torch.arange(P, P + block_len, dtype=torch.long)


def query_start_position(context_len: int, assembled_lengths: Sequence[int] = (), *,
                         mode: str = DEFAULT_POSITION_MODE) -> int:
    """Position id of the first Phase 2 query token (Appendix E).

    * ``sparse``: ``context_len`` -- the query continues the original sequence.
    * ``contiguous``: ``max_i L_i`` where ``L_i = len(prefix_i) + |B_i|`` is block ``i``'s assembled Phase 1
      length ("offset to start just past the longest assembled Phase 1 length"; positions used there are
      ``0 .. L_i - 1``). Generated tokens follow the query's positions in both modes.
    """
    return context_len if mode == "sparse" else max(int(x) for x in assembled_lengths)


# -------------------------------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class BlockPlan:
    """Phase 1 input of one block: global token indices and the position ids to use.

    ``input_indices`` gathers the assembled input from the context ids; ``input_positions`` are its RoPE
    positions; after the forward pass keep the last ``block_len`` KV entries (Appendix F).
    """

    index: int
    start: int
    end: int
    prefix: torch.LongTensor
    prefix_pos: torch.LongTensor
    block_pos: torch.LongTensor

    @property
    def block_len(self) -> int:
        return self.end - self.start

    @property
    def prefix_len(self) -> int:
        return int(self.prefix.numel())

    @property
    def assembled_len(self) -> int:
        """``L_i = len(prefix) + |B_i|``."""
        return self.prefix_len + self.block_len

    @property
    def input_indices(self) -> torch.LongTensor:
        return torch.cat([self.prefix, torch.arange(self.start, self.end, dtype=torch.long)])

    @property
    def input_positions(self) -> torch.LongTensor:
        return torch.cat([self.prefix_pos, self.block_pos])


@dataclass(frozen=True)
class PulsarPlan:
    """Everything Phase 1 needs to know about the context, for every block (no model, no ranks). ``idf`` is None
    for a plan without token ids."""

    block_bounds: Tuple[Tuple[int, int], ...]
    idf: Optional[IdfTable]
    summaries: Tuple[torch.LongTensor, ...]  # Sigma_j as global indices (ascending, inside block j)
    blocks: Tuple[BlockPlan, ...]
    query_start: int
    chunk_size: int
    budget: float
    scorer: str
    sink_size: int
    position_mode: str


def plan_pulsar(context_ids, block_bounds: Union[Sequence[Tuple[int, int]], int], *,
                chunk_size: int = DEFAULT_CHUNK_SIZE, budget: float = DEFAULT_BUDGET, scorer: str = DEFAULT_SCORER,
                sink_size: int = DEFAULT_SINK_SIZE, position_mode: str = DEFAULT_POSITION_MODE,
                vocab_size: Optional[int] = None, context_len: Optional[int] = None, halo: int = 0) -> PulsarPlan:
    """Algorithm 1 lines 3-6 for every block: IDF table, summaries, prefixes, positions, query start.

    ``block_bounds`` is a list of ``(start, end)`` pairs or an int block size. Every rank can call this with
    the whole context's ids and read its own blocks' entries; the result is identical everywhere. Without token
    ids (``context_ids=None``, give ``context_len``: the cost model) the summaries are placed to give the largest
    prefix (Eq. 4's upper bound); ``even`` depends on the length alone and is exact either way. ``halo``: see
    :func:`pulsar_prefix`.
    """
    ids = None if context_ids is None else _ids(context_ids)
    L = int(ids.numel()) if ids is not None else int(context_len)
    bounds = _bounds(block_bounds, L)
    if ids is None and scorer == "even":
        ids = torch.zeros(L, dtype=torch.long)
    table = corpus_idf(ids, bounds, vocab_size=vocab_size) if ids is not None and scorer != "even" else None
    if ids is not None:
        local = [select_summary(ids[s:e], table, chunk_size=chunk_size, budget=budget, scorer=scorer)
                 for s, e in bounds]
    else:
        local = [_largest_prefix_summary(e - s, j, chunk_size, budget, sink_size) for j, (s, e) in enumerate(bounds)]
    summaries = tuple(sel + s for sel, (s, _) in zip(local, bounds))
    blocks = []
    for i, (s, e) in enumerate(bounds):
        prefix = pulsar_prefix(L, bounds, i, summaries, sink_size, halo)
        ppos, bpos = prefix_positions(prefix, s, e - s, mode=position_mode)
        blocks.append(BlockPlan(index=i, start=s, end=e, prefix=prefix, prefix_pos=ppos, block_pos=bpos))
    qstart = query_start_position(L, [blk.assembled_len for blk in blocks], mode=position_mode)
    return PulsarPlan(block_bounds=tuple(bounds), idf=table, summaries=summaries, blocks=tuple(blocks),
                      query_start=qstart, chunk_size=chunk_size, budget=float(budget), scorer=scorer,
                      sink_size=sink_size, position_mode=position_mode)
