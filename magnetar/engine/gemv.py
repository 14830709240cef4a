"""The weight layout of the CPU's decode steps (issue 47, item 6: decode on the CPU at vLLM's speed).

A decode step multiplies one row per request by every weight matrix: a matrix-vector product, bound by reading the
weights. ``nn.Linear`` keeps its weight ``(out, in)`` row-major and computes ``x @ W.T``; for a single row, MKL's
kernel for that transposed operand reads the weights at about half the rate of the one that takes ``(in, out)``
rows when a matrix has more outputs than inputs (SmolLM2's MLP up / gate projections, 576 -> 1536, and its LM head,
576 -> 49152, on the 2-core AMD EPYC VM: 9-11 GB/s against 16 GB/s for one thread; docs/results.md "Decode on the
CPU against vLLM's, the default step"). :func:`relayout_for_decode` stores those weights transposed in memory
(``W.t().contiguous().t()``: the same parameter, shape and values, strides ``(1, out)``), so the unchanged model
code's ``F.linear(x, W)`` reaches the faster kernel, and keeps it only when a timed pass over the model's own
matrices says it is faster on this machine (it depends on the CPU and the BLAS build). Matrices with fewer outputs
than inputs (the down projection, k / v) and every other device keep their layout; a tied LM head is transposed
with the embedding it shares (an embedding lookup reads one strided row per token: nothing at decode, a few
milliseconds in a long prefill). Prefill's matrix products are as fast either way (measured: 2048-row products
within noise).

:func:`fuse_siblings` goes one step further for the projections that read the same input -- an attention's
``q_proj`` / ``k_proj`` / ``v_proj``, an MLP's ``gate_proj`` / ``up_proj`` (the names of every Hugging Face
decoder Magnetar serves) --: their weights move into one ``(in, out_q + out_k + out_v)`` buffer (each parameter a
view of its columns: the same names, shapes and values, no second copy), and the first of them called computes the
product for all (one matrix-vector product reads the buffer at the rate of a large one, where three small ones
each pay a small product's overhead: SmolLM2, 30 layers, one thread, 6.4 -> 4.4 ms for q/k/v and 13.3 -> 10.5 ms
for gate/up on the AVX-512 EPYC VM); the others take their columns of it -- vLLM's ``QKVParallelLinear`` and
``MergedColumnParallelLinear`` for a model whose code calls the three layers apart. The product is kept for the
siblings only while its input is the same tensor, unchanged (identity and version); a sibling called with another
input computes the product anew (right, only slower); under ``torch.compile``, and for more than
:data:`_FUSED_ROWS` rows (a prefill: as fast apart), each layer computes its own.
Kept, like the layout, only when a timed pass over the model's own groups says it is faster.

:func:`pack_for_batches` serves the products of a decode step of several requests (2 to :data:`_FUSED_ROWS` rows):
MKL's sgemm runs a few rows far below the core's rate on the AMD EPYC VM (25-30 GFLOP/s: eight rows cost 2.9x one),
where oneDNN's matmul over a weight prepacked in its blocked layout reads the weights at near the single-row rate
(1.5-3.3x MKL's at 4-16 rows; ``benchmarks/bench_gemm.py``, docs/results.md "The CPU's matrix products by kernel").
For bf16 weights it serves one request's step too (1 to :data:`_FUSED_ROWS` rows): torch's own bf16 products of a
few rows read the weights at ~10 GB/s there, no faster than fp32's, so a bf16 model decoded slower than fp32
(docs/results.md "bf16 on the CPU beside vLLM's bf16"). Where the CPU has AVX-512 BF16, bf16 weights are offered a
second kind of copy, the small GEMM op's (:mod:`magnetar.ops.small_gemm`: 32 outputs side by side per pair of inputs,
read in order at 18-22 GB/s on one core where oneDNN's read 10-13): the decision times both kinds over the same
products and keeps the faster one (docs/results.md "bf16 products at the core's read rate").
The packed weight is a second copy (the model's parameters stay as they are: names, ties, the embedding lookup, one
row's faster layout), so it is made only for fp32 and bf16 weights, only once a product that uses it comes (fp32: a
few-row product of several requests -- a model that never decodes a batch pays nothing; bf16: any decode step),
while the copies take at most :data:`_PACKED_SHARE` of the host's available memory, and kept only when a timed pass
(8 rows; bf16: 1 and 8) then says it is faster; fp32's product of one row, a product of more than
:data:`_FUSED_ROWS` rows (a prefill: oneDNN's own), with autograd on, under ``torch.compile``, or after the weight
was cast or moved (its storage is no longer the packed one's source) takes the layer's own path.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from magnetar.models.dummy import free_memory
from magnetar.ops.small_gemm import SmallGemm, small_gemm_unavailable, weight_reason

log = logging.getLogger(__name__)

_TIMED_BYTES = 256 * 2**20  # the timed pass reads at most this much of the candidates' weights (beyond the caches)
_MIN_BYTES = 32 * 2**20  # smaller candidates stay in the caches: nothing to gain, and a timing's noise decides
_GAIN = 0.9  # the transposed layout is kept when its pass takes at most this fraction of the row-major one's
_PASSES = 3
_FUSED_ROWS = 64  # the most input rows (a decode step's requests) fused layers compute as one product
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # child layers fed the same input
_PACKED_SHARE = 0.25  # oneDNN's packed copies take at most this share of the host's available memory
_PACKED_HINT = 8  # the row count the packed layout is made for (any count runs; measured at 1-16)
# the weight dtypes oneDNN's copies serve -> the fewest rows they serve: fp32's single row stays on the layout above
# (faster there), bf16's goes to the copy too (1.3-2.7x torch's bf16 product at one row and 1.4-2.0x at eight on the
# AVX-512 EPYC VM, where torch's own bf16 decode products were no faster than fp32's; docs/results.md "bf16 on the
# CPU beside vLLM's bf16")
_PACKED_DTYPES = {torch.float32: 2, torch.bfloat16: 1}


def _candidates(model) -> list[nn.Parameter]:
    """The distinct 2-D weights of ``model``'s ``nn.Linear`` layers with more outputs than inputs, row-major."""
    seen, out = set(), []
    for m in model.modules():
        w = getattr(m, "weight", None)
        if (isinstance(m, nn.Linear) and isinstance(w, torch.Tensor) and w.dim() == 2 and m.out_features > m.in_features
                and w.is_floating_point() and w.is_contiguous() and id(w) not in seen):
            seen.add(id(w))
            out.append(w)
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _timed_prefix(items: list, nbytes) -> list:
    """The first of ``items`` (the model's own matrices, or groups of them) whose ``nbytes`` reach
    :data:`_TIMED_BYTES`: enough to leave the caches, as the decode step reads them."""
    out, total = [], 0
    for item in items:
        out.append(item)
        total += nbytes(item)
        if total >= _TIMED_BYTES:
            break
    return out


def _best_seconds(run) -> float:
    """The fastest of :data:`_PASSES` calls of ``run()`` (after one unmeasured call), without autograd."""
    best = float("inf")
    with torch.no_grad():
        for i in range(_PASSES + 1):
            t0 = time.perf_counter()
            run()
            if i:
                best = min(best, time.perf_counter() - t0)
    return best


def _pass_seconds(weights: list[torch.Tensor]) -> float:
    """The fastest of :data:`_PASSES` single-row products over ``weights``."""
    rows = {w.shape[1]: torch.randn(1, w.shape[1], dtype=w.dtype) for w in weights}

    def run():
        for w in weights:
            F.linear(rows[w.shape[1]], w)
    return _best_seconds(run)


def _set_layout(weights: list[torch.Tensor], transposed: bool) -> None:
    with torch.no_grad():
        for w in weights:
            w.data = w.data.t().contiguous().t() if transposed else w.data.contiguous()


def relayout_for_decode(model, device: torch.device) -> Optional[str]:
    """On a CPU, the weights of ``model``'s linear layers with more outputs than inputs stored transposed when one
    timed pass over them is faster so (each model once: later engines over the same model object reuse the
    decision); what was decided, for the log (None: nothing to decide -- another device, or such layers' weights
    under :data:`_MIN_BYTES` in all)."""
    if device.type != "cpu":
        return None
    done = getattr(model, "_magnetar_gemv_layout", None)
    if done is not None:
        return done
    weights = _candidates(model)
    if sum(_nbytes(w) for w in weights) < _MIN_BYTES:
        return None
    timed = _timed_prefix(weights, _nbytes)
    before = _pass_seconds(timed)
    _set_layout(timed, True)
    after = _pass_seconds(timed)
    keep = after <= _GAIN * before
    _set_layout(weights if keep else timed, keep)
    what = (f"{len(weights)} linear weights with more outputs than inputs stored (in, out) for the decode step's "
            f"matrix-vector products: {1e3 * before:.1f} -> {1e3 * after:.1f} ms over {len(timed)} of them"
            if keep else f"linear weights kept (out, in): (in, out) measured {1e3 * after:.1f} ms against "
            f"{1e3 * before:.1f} over {len(timed)} of them")
    model._magnetar_gemv_layout = what
    log.info("decode on the CPU: %s", what)
    return what


class _Group:
    """Sibling linear layers' fused weight ``W (in, out total)`` (their biases joined, or None) and the product of
    the last input, kept until every sibling has read it."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], size: int):
        self.weight, self.bias, self.size = weight, bias, size
        self.x: Optional[torch.Tensor] = None
        self.version = -1
        self.y: Optional[torch.Tensor] = None
        self.unread = 0
        # a oneDNN copy for few-row products, and the model's decision on those copies (pack_for_batches): the names
        # a PackedLinear holds them under (_packed_for reads either)
        self._magnetar_packed: Optional[_Packed] = None
        self._magnetar_batches: Optional[_Batches] = None

    def product(self, x: torch.Tensor) -> torch.Tensor:
        version = _version(x)
        if self.x is not x or self.version != version or self.unread == 0:
            packed = _packed_for(self, x, self.weight)
            y = packed(x) if packed is not None else torch.matmul(x, self.weight)
            self.x, self.version, self.y = x, version, y if self.bias is None else y + self.bias
            self.unread = self.size
        y = self.y
        self.unread -= 1
        if self.unread == 0:  # every sibling has its columns: hold nothing
            self.x = self.y = None
        return y


def _version(x: torch.Tensor) -> int:
    """``x``'s version counter (an in-place change bumps it); -1 for an inference tensor, which has none (nothing
    changes a layer's input in place between its siblings' calls in the models' code)."""
    return -1 if x.is_inference() else x._version


class FusedLinear(nn.Linear):
    """An ``nn.Linear`` whose weight is a view of its siblings' fused buffer (:func:`fuse_siblings`): its output is
    its columns of the group's product."""

    _magnetar_group: _Group
    _magnetar_cols: slice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self._magnetar_group
        # a prefill's many rows: each layer its own product (as fast, and no strided slices for the model's
        # elementwise ops: a fused 4K prefill measured 2-4 % slower); compiled: no state carried between a graph's
        # layers; a model cast or moved since fusing: its own weight
        if x.numel() > _FUSED_ROWS * x.shape[-1] or torch.compiler.is_compiling() or \
                self.weight.untyped_storage().data_ptr() != group.weight.untyped_storage().data_ptr():
            return F.linear(x, self.weight, self.bias)
        return group.product(x)[..., self._magnetar_cols]


def _sibling_groups(model) -> list[list[nn.Linear]]:
    """Each module's children named as one of :data:`SIBLINGS`: plain ``nn.Linear`` layers of one input size,
    dtype and device, all with a bias or none, each weight its own (not tied)."""
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    out = []
    for m in model.modules():
        for names in SIBLINGS:
            layers = [getattr(m, n, None) for n in names]
            if not all(type(c) is nn.Linear for c in layers):
                continue
            w0, first = layers[0].weight, layers[0]
            if all(c.in_features == first.in_features and c.weight.dtype == w0.dtype and c.weight.is_floating_point()
                   and c.weight.device == w0.device and (c.bias is None) == (first.bias is None)
                   and counts.get(id(c.weight)) == 1 for c in layers):
                out.append(layers)
    return out


def _fuse(layers: list[nn.Linear]) -> None:
    with torch.no_grad():
        fused = torch.cat([c.weight.data.t() for c in layers], dim=1).contiguous()  # (in, out total)
        bias = torch.cat([c.bias.data for c in layers]) if layers[0].bias is not None else None
        group = _Group(fused, bias, len(layers))
        start = 0
        for c in layers:
            n = c.out_features
            c.weight.data = fused[:, start:start + n].t()  # the same parameter: its columns of the buffer
            if bias is not None:
                c.bias.data = bias[start:start + n]
            c.__class__ = FusedLinear
            c._magnetar_group, c._magnetar_cols = group, slice(start, start + n)
            start += n


def _group_bytes(group: list[nn.Linear]) -> int:
    return sum(_nbytes(c.weight) for c in group)


def _group_seconds(groups: list[list[nn.Linear]], fused: bool) -> float:
    """The fastest of :data:`_PASSES` single-row passes over ``groups``: each layer apart, or one product per group
    (made here from the layers' weights, as :func:`_fuse` would)."""
    dtype = groups[0][0].weight.dtype
    rows = {g[0].in_features: torch.randn(1, g[0].in_features, dtype=dtype) for g in groups}
    with torch.no_grad():
        mats = [torch.cat([c.weight.t() for c in g], dim=1).contiguous() for g in groups] if fused else None

    def run():
        for j, g in enumerate(groups):
            x = rows[g[0].in_features]
            if fused:
                torch.matmul(x, mats[j])
            else:
                for c in g:
                    F.linear(x, c.weight, c.bias)
    return _best_seconds(run)


def fuse_siblings(model, device: torch.device) -> Optional[str]:
    """On a CPU, the sibling projections of ``model`` (:data:`SIBLINGS`) fused into one product each when a timed
    pass over them is faster so (each model once); what was decided, for the log (None: nothing to decide --
    another device, no such layers, or their weights under :data:`_MIN_BYTES` in all)."""
    if device.type != "cpu":
        return None
    done = getattr(model, "_magnetar_gemv_fused", None)
    if done is not None:
        return done
    groups = _sibling_groups(model)
    if sum(_group_bytes(g) for g in groups) < _MIN_BYTES:
        return None
    timed = _timed_prefix(groups, _group_bytes)
    apart, together = _group_seconds(timed, False), _group_seconds(timed, True)
    keep = together <= _GAIN * apart
    if keep:
        for g in groups:
            _fuse(g)
    what = (f"{len(groups)} groups of sibling projections ({', '.join('/'.join(n) for n in SIBLINGS)}) fused into one "
            f"product each: {1e3 * apart:.1f} -> {1e3 * together:.1f} ms over {len(timed)} of them" if keep else
            f"sibling projections kept apart: fused measured {1e3 * together:.1f} ms against {1e3 * apart:.1f}")
    model._magnetar_gemv_fused = what
    log.info("decode on the CPU: %s", what)
    return what


class _Packed:
    """A weight's copy in oneDNN's blocked layout (:func:`pack_for_batches`) and the storage it was made from."""

    KIND = "oneDNN"

    def __init__(self, weight_out_in: torch.Tensor):
        with torch.no_grad():
            self.w = self._copy(weight_out_in)
        self.out_features, self.in_features = weight_out_in.shape
        self.dtype = weight_out_in.dtype
        self.source = weight_out_in.untyped_storage().data_ptr()  # (a view of) the owner's weight

    @staticmethod
    def _copy(weight_out_in: torch.Tensor):
        return torch.ops.mkldnn._reorder_linear_weight(weight_out_in.detach().contiguous(), _PACKED_HINT)

    def applies(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether ``x`` is a few-row product (:func:`_few_rows`) this copy serves: ``weight`` is still the storage
        it was packed from."""
        return _few_rows(x) and x.dtype == self.dtype and weight.untyped_storage().data_ptr() == self.source

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.w, bias, "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)


class _SmallPacked(_Packed):
    """A bf16 weight's copy in the small GEMM op's blocked layout (:mod:`magnetar.ops.small_gemm`, AVX-512 BF16)."""

    KIND = "Magnetar's small GEMM"

    @staticmethod
    def _copy(weight_out_in: torch.Tensor):
        return SmallGemm(weight_out_in)

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.w(x, bias)


def _copy_kinds(targets: list) -> list[type]:
    """The kinds of copy :class:`_Batches` times for ``targets``: oneDNN's, and for bf16 weights with an even input
    size the small GEMM op's where it runs (an AVX-512 BF16 CPU; asked only then: it builds the op)."""
    kinds: list[type] = [_Packed]
    if all(weight_reason(w) is None for _, w, _ in targets):
        reason = small_gemm_unavailable()
        if reason is None:
            kinds.append(_SmallPacked)
        else:
            log.info("decode on the CPU: bf16 products without the small GEMM op (%s)", reason)
    return kinds


def _few_rows(x: torch.Tensor) -> bool:
    """Whether ``x`` is a product the oneDNN copies serve: fp32 with 2 to :data:`_FUSED_ROWS` rows, bf16 with 1 to
    :data:`_FUSED_ROWS` (:data:`_PACKED_DTYPES`), no autograd, not compiling."""
    least = _PACKED_DTYPES.get(x.dtype)
    rows = x.numel() // max(1, x.shape[-1])
    return (least is not None and least <= rows <= _FUSED_ROWS and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling())


def _decides(x: torch.Tensor) -> bool:
    """Whether ``x`` is a product that makes a model's copies: fp32, a few-row product of several requests ``(B >=
    2, S, in)`` -- a decode step of a batch, or their query forward -- (one request's short query alone does not:
    its one-row decode steps do not use them); bf16, any few-row product (one request's decode step uses them)."""
    return _few_rows(x) and (_PACKED_DTYPES[x.dtype] == 1 or (x.dim() >= 3 and x.shape[0] >= 2))


def _packed_for(owner, x: torch.Tensor, weight: torch.Tensor) -> Optional[_Packed]:
    """The oneDNN copy that serves ``owner``'s product of ``x`` (a :class:`PackedLinear` or a fused :class:`_Group`;
    ``weight`` its weight now), or None; the model's first product that decides (:func:`_decides`) makes the
    model's decision first."""
    batches = owner._magnetar_batches
    if owner._magnetar_packed is None and batches is not None and batches.pending and _decides(x):
        batches.decide()
    packed = owner._magnetar_packed
    return packed if packed is not None and packed.applies(x, weight) else None


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose products of a few rows may go to a oneDNN copy of its weight (:func:`pack_for_batches`:
    made, or not, at the model's first such product of several requests); any other product is its own."""

    _magnetar_packed: Optional[_Packed]
    _magnetar_batches: "_Batches"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = _packed_for(self, x, self.weight)
        return packed(x, self.bias) if packed is not None else F.linear(x, self.weight, self.bias)


def _packable() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _pack_targets(model) -> list[tuple[object, torch.Tensor, Optional[torch.Tensor]]]:
    """``(owner, weight (out, in) view, bias)`` of each product a decode step makes: each fused group once (its
    ``(in, out)`` buffer seen transposed) and each plain fp32 / bf16 ``nn.Linear`` (distinct weights; a tied head
    too)."""
    out, seen = [], set()
    for m in model.modules():
        if isinstance(m, FusedLinear):
            g = m._magnetar_group
            if id(g) not in seen and g.weight.dtype in _PACKED_DTYPES:
                seen.add(id(g))
                out.append((g, g.weight.t(), g.bias))
        elif type(m) is nn.Linear and m.weight.dtype in _PACKED_DTYPES and id(m) not in seen:
            seen.add(id(m))
            out.append((m, m.weight, m.bias))
    return out


def _batch_seconds(targets: list, packed: Optional[list], timed_rows: tuple[int, ...]) -> float:
    """The fastest of :data:`_PASSES` passes of products of each of ``timed_rows`` rows over ``targets``: each its
    own way (a group's buffer, a layer's ``F.linear``), or by the ``packed`` copies."""
    inputs = [{t[1].shape[1]: torch.randn(n, t[1].shape[1], dtype=t[1].dtype) for t in targets}
              for n in timed_rows]

    def run():
        for rows in inputs:
            for j, (owner, w, b) in enumerate(targets):
                x = rows[w.shape[1]]
                if packed is not None:
                    packed[j](x, b)
                elif isinstance(owner, _Group):
                    torch.matmul(x, owner.weight)
                else:
                    F.linear(x, owner.weight, b)
    return _best_seconds(run)


class _Batches:
    """One model's decision on oneDNN copies for its few-row products (:func:`pack_for_batches`): made once, at the
    first product that decides (:func:`_decides`; or when asked), over ``targets`` (:func:`_pack_targets`)."""

    def __init__(self, targets: list, total: int):
        self.targets, self.total, self.pending = targets, total, True
        least = min(_PACKED_DTYPES[w.dtype] for _, w, _ in targets)  # the fewest rows the copies serve
        # what the decision times: a batch's step, and a single request's where the copies serve it (bf16)
        self.rows = (_PACKED_HINT,) if least > 1 else (1, _PACKED_HINT)
        self.span = f"{least}-{_FUSED_ROWS}"
        self.what = (f"oneDNN copies for the products of {self.span} rows ({total / 2**20:.0f} MiB): decided at "
                     f"the first such product" + (" of several requests" if least > 1 else ""))

    def decide(self) -> str:
        if not self.pending:
            return self.what
        self.pending = False
        targets, total = self.targets, self.total
        room = int(_PACKED_SHARE * free_memory(torch.device("cpu")))
        if total > room:
            self.what = (f"no oneDNN copies for few-row products: they would take {total / 2**20:.0f} MiB, over "
                         f"{100 * _PACKED_SHARE:.0f} % of the available memory ({room / 2**20:.0f} MiB)")
        else:
            timed = _timed_prefix(targets, lambda t: _nbytes(t[1]))
            before = _batch_seconds(timed, None, self.rows)
            # each kind of copy timed over the same products; the fastest one's trial copies are kept if chosen
            best = None
            for kind in _copy_kinds(targets):
                trial = [kind(w) for _, w, _ in timed]
                seconds = _batch_seconds(timed, trial, self.rows)
                if best is None or seconds < best[1]:
                    best = (kind, seconds, trial)
                del trial
            kind, after, trial = best
            keep = after <= _GAIN * before
            if keep:
                for j, (owner, w, _) in enumerate(targets):
                    owner._magnetar_packed = trial[j] if j < len(trial) else kind(w)
            rows = " and ".join(str(n) for n in self.rows)
            self.what = (f"{len(targets)} linear products of {self.span} rows by {kind.KIND} copies of their "
                         f"weights ({total / 2**20:.0f} MiB more): {1e3 * before:.1f} -> {1e3 * after:.1f} ms at "
                         f"{rows} rows over {len(timed)} of them" if keep else
                         f"no copies for few-row products: {kind.KIND}'s measured {1e3 * after:.1f} ms against "
                         f"{1e3 * before:.1f} at {rows} rows")
        self.targets = []  # nothing held once decided
        log.info("decode on the CPU: %s", self.what)
        return self.what


def prepare_cpu_decode_ops(model, device: torch.device, attention_backend: str, decode_step: str = "eager") -> None:
    """On a CPU, build or load now -- at engine start, not inside a decode step, where a first build (~10-15 s) kept
    the other ranks waiting in a collective -- the JIT ops a decode step may reach: ``cpu_decode``'s kernel (when
    ``attention_backend`` is ``auto`` or it, and for a static or graph step, whose slots it reads whatever backend
    serves the eager calls: :func:`magnetar.ops.slots.slot_backend`) and, for a bf16 model, the small GEMM op the
    copies' decision times. Never raises (an op that cannot build is logged, and not used)."""
    if device.type != "cpu":
        return
    from magnetar.ops.backends.cpu_decode import DECODE_ATTENTION_OP

    if attention_backend in ("auto", "cpu_decode") or decode_step in ("static", "graph"):
        DECODE_ATTENTION_OP.available("cpu")
    if any(p.dtype == torch.bfloat16 for p in model.parameters()):
        small_gemm_unavailable()


def pack_for_batches(model, device: torch.device, *, now: bool = False) -> Optional[str]:
    """On a CPU, ``model``'s fp32 and bf16 linear products (after :func:`fuse_siblings` and
    :func:`relayout_for_decode`) made ready for oneDNN copies of their weights, which serve the products of a decode
    step -- of several requests in fp32, of one or more in bf16 (:data:`_PACKED_DTYPES`): the copies are made -- or
    not: :data:`_PACKED_SHARE` of the available memory, a timed pass -- at the model's first product that decides
    (:func:`_decides`: fp32, a batch's decode step or query forward; bf16, any decode step; ``now``: at once). Each
    model once; what was decided (or that it waits), for the log; None: nothing to decide (another device, no
    oneDNN, or the weights under :data:`_MIN_BYTES`)."""
    if device.type != "cpu" or not _packable():
        return None
    batches = getattr(model, "_magnetar_gemv_packed", None)
    if batches is None:
        targets = _pack_targets(model)
        total = sum(_nbytes(w) for _, w, _ in targets)
        if total < _MIN_BYTES:
            return None
        batches = model._magnetar_gemv_packed = _Batches(targets, total)
        for owner, _, _ in targets:
            if not isinstance(owner, _Group):
                owner.__class__ = PackedLinear
                owner._magnetar_packed = None
            owner._magnetar_batches = batches
    return batches.decide() if now else batches.what
