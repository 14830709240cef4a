"""The strategy protocols and their lazy registries: what the engine asks of a method or a policy.

The engine drives three kinds of plug-in, each found by its configuration name and imported on first use
(the pattern of :mod:`magnetar.ops.backends`, one level up), so the engine never imports a strategy module:

* :class:`ContextMethod` -- a Phase-1 method (dense, star, pulsar, ring, streaming; ``magnetar/methods/``):
  which tokens each rank encodes, the attention of every Phase-1 layer, what happens to the KV afterwards.
  Registry: :data:`magnetar.config.METHODS` (name -> ``"module:Class"`` plus the facts config validates).
* :class:`DecodePolicy` -- which context KV a Phase-2 token attends to (sparse decoding, LuKA).
* :class:`PrefillPolicy` -- sparse attention inside a local Phase 1 (oracle, indexer).
  Registry of both: :data:`magnetar.config.POLICIES` (policy name -> ``"module:Class"`` and the config section
  that configures it); :class:`DecodePolicyBase` / :class:`PrefillPolicyBase` give every optional member its
  default, so the engine asks a policy, never probes it.

The per-layer contexts the phase drivers hand to the model (:class:`LayerContext`) are declared here too, so
that strategies can read them (:class:`Phase1Layer`) without importing the drivers.

This module knows no strategy by name and imports none: a strategy module imports this one, never the reverse.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional, Protocol, Sequence, Union, runtime_checkable

import torch

from magnetar.config import DECODE_SECTIONS, METHODS, POLICIES, EngineConfig, PolicySection
from magnetar.engine.kv import KVShard, LayerKV
from magnetar.engine.plan import RankPlan
from magnetar.parallel.ring import ExchangeClock, ring_attention_local
from magnetar.utils.nvtx import FORWARD_LAYER
from magnetar.utils.registry import load_class


class LayerContext:
    """What one model forward computes, read by the registered attention function in every layer.

    A phase driver passes one to the model (keyword ``magnetar``); transformers hands it to
    :func:`magnetar.engine.hf.magnetar_attention`, which calls :meth:`attend`. ``wants_hidden``: the layer
    also needs the attention's input hidden states (sparse prefill's indexer); the capture hook of
    :func:`magnetar.engine.hf.capture_attention_inputs` then stores ``(layer, hidden)`` in ``hidden``.
    """

    layer_range = FORWARD_LAYER  # the profiler range of each layer's attend (magnetar.utils.nvtx.RANGES)
    wants_hidden = False
    hidden: Optional[tuple[int, torch.Tensor]] = None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: Optional[int] = None) -> torch.Tensor:
        """``out (B, Hq, S, D)`` of one layer for post-RoPE ``q (B, Hq, S, D)``, ``k, v (B, Hkv, S, D)``;
        ``window``: the layer's sliding window (None for global layers)."""
        raise NotImplementedError


@dataclass
class SimulatedRing:
    """What a ring exchange brings one simulated rank (one process runs the CP ranks one after another): the other
    ranks' KV shards in the order a ring delivers them (rank ``r-1``, ``r-2``, ...). A rank encoded after this one
    whose keys all follow this rank's queries (contiguous blocks: Star's and Pulsar's hybrid layers) is not there
    yet: its entry is its token count, so that the step still moves its bytes. ``clock`` times every step's
    attention beside the bytes it moves (priced at a link afterwards: :func:`magnetar.parallel.ring.exposed_seconds`).
    """

    shards: Sequence[Union[KVShard, int]]
    clock: ExchangeClock

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_pos: torch.Tensor,
               k_pos: torch.Tensor, scale: float, window: Optional[int], backend: str):
        """``(out, lse)`` of this rank's queries over its own KV ``k, v`` and every shard the ring brings at
        ``layer`` (:func:`~magnetar.parallel.ring.ring_attention_local`)."""
        received = []
        for s in self.shards:
            kv = None if isinstance(s, int) else s.layers[layer]
            if kv is None:
                received.append(int(s))
            elif kv.k is None:
                received.append(0)
            else:
                received.append((kv.k, kv.v, kv.pos))
        return ring_attention_local(q, k, v, q_pos=q_pos, k_pos=k_pos, received=received, scale=scale,
                                    window=window, backend=backend, clock=self.clock)


class Phase1Layer(Protocol):
    """What a :class:`ContextMethod` reads of the Phase-1 context of one forward (one plan segment).

    ``config`` the engine's configuration; ``positions (S,)`` RoPE positions of the input tokens; ``keep`` the slice
    whose KV the rank stores; ``shard`` receives it; ``group``/``timeout`` the CP group (ring); ``backend`` the
    attention backend; ``prefill`` the sparse-prefill run of this request (or None); ``mass`` the decode policy's
    recorder of the attention mass each kept key received (or None); ``hidden`` the captured attention input;
    ``ring`` when one process simulates the ranks: what a ring exchange would bring this rank (the other ranks'
    KV shards, :class:`SimulatedRing`); None otherwise.
    """

    config: EngineConfig
    positions: torch.Tensor
    keep: slice
    shard: KVShard
    group: Optional[torch.distributed.ProcessGroup]
    timeout: Optional[timedelta]
    backend: str
    prefill: Optional["PrefillRun"]
    mass: Optional[Callable[..., torch.Tensor]]
    hidden: Optional[tuple[int, torch.Tensor]]
    ring: Optional["SimulatedRing"]


@runtime_checkable
class ContextMethod(Protocol):
    """A Phase-1 method. One instance per name serves every engine (keep no request state on it).

    * :meth:`validate` -- its reasons to refuse a request (empty: it can run it);
    * :meth:`plan` -- pure: this rank's segments (model inputs, positions, kept slice) and the query position;
    * :meth:`begin` / :meth:`finish` -- the KV shard before the first and after the last segment;
    * :meth:`attend` -- the attention of one Phase-1 layer, storing the kept KV in ``ctx.shard``;
    * :meth:`lockstep` -- optional: one plan that stands in for every rank's when one process simulates the
      ranks (ring's shards exchange KV in every layer, so they run as one forward), or None;
    * :meth:`plan_for_length` -- the plan the cost model assumes when it has no token ids (Pulsar's summaries
      depend on the ids: it places them to give the largest prefix, an upper bound).

    What evaluation, the cost model and benchmarks ask of a method (so that they name no method):

    * :attr:`lockstep_ranks` -- its ranks exchange KV in every layer (ring): each rank's queries see every earlier
      key of the context and the shards circulate; simulated, the ranks run as one forward, so per-rank times
      are not measured that way;
    * :meth:`label_options` -- the options that set a run of it apart in a report (``["block 512", "bm25"]``);
    * :meth:`visible_keys` / :meth:`kept_positions` -- for the cost model: the key positions one segment's
      queries attend besides their own (given what the rank saw before), and the context positions whose KV the
      rank keeps after Phase 1;
    * :meth:`cost_assumptions` -- what the cost model assumes for it (without token ids);
    * :meth:`exact_layers` -- the layers whose Phase-1 queries see every earlier key of the context through a
      lock-step exchange of the ranks' kept KV (hybrid layers; the cost model counts their attention and traffic);
    * :meth:`model_problems` -- its reasons to refuse this model (a layer index outside it), asked before any
      compute.

    :class:`MethodBase` gives the defaults (nothing before or after, no lock-step, the plan of any ids).
    """

    name: str

    def validate(self, config: EngineConfig, context_len: int) -> list[str]: ...

    def plan(self, config: EngineConfig, context_ids: torch.Tensor, cp_rank: int) -> RankPlan: ...

    def begin(self, shard: KVShard) -> None: ...

    def attend(self, ctx: Phase1Layer, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: Optional[int]) -> torch.Tensor: ...

    def finish(self, shard: KVShard, config: EngineConfig, context_len: int) -> None: ...

    def lockstep(self, plans: list[RankPlan]) -> Optional[RankPlan]: ...

    def plan_for_length(self, config: EngineConfig, context_len: int, cp_rank: int) -> RankPlan: ...

    lockstep_ranks: bool

    def label_options(self, config: EngineConfig) -> list[str]: ...

    def visible_keys(self, config: EngineConfig, positions: torch.Tensor, seen: torch.Tensor) -> torch.Tensor: ...

    def kept_positions(self, config: EngineConfig, kept: torch.Tensor, context_len: int) -> torch.Tensor: ...

    def cost_assumptions(self, config: EngineConfig, with_ids: bool) -> list[str]: ...

    def exact_layers(self, config: EngineConfig, num_layers: int) -> tuple[int, ...]: ...

    def model_problems(self, config: EngineConfig, num_layers: int) -> list[str]: ...


class MethodBase:
    """Defaults of a :class:`ContextMethod`; a method defines ``name``, :meth:`plan` and :meth:`attend`."""

    name = "?"

    def validate(self, config: EngineConfig, context_len: int) -> list[str]:
        return []

    def plan(self, config: EngineConfig, context_ids: torch.Tensor, cp_rank: int) -> RankPlan:
        raise NotImplementedError

    def begin(self, shard: KVShard) -> None:
        pass

    def attend(self, ctx: Phase1Layer, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: Optional[int]) -> torch.Tensor:
        raise NotImplementedError

    def finish(self, shard: KVShard, config: EngineConfig, context_len: int) -> None:
        pass

    def lockstep(self, plans: list[RankPlan]) -> Optional[RankPlan]:
        return None

    def plan_for_length(self, config: EngineConfig, context_len: int, cp_rank: int) -> RankPlan:
        return self.plan(config, torch.zeros(context_len, dtype=torch.long), cp_rank)

    lockstep_ranks = False

    def label_options(self, config: EngineConfig) -> list[str]:
        return []

    def visible_keys(self, config: EngineConfig, positions: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """Key positions one segment at ``positions`` attends: by default itself alone (causally)."""
        return positions

    def kept_positions(self, config: EngineConfig, kept: torch.Tensor, context_len: int) -> torch.Tensor:
        """The context positions whose KV the rank keeps after Phase 1: by default every kept segment slice."""
        return kept

    def cost_assumptions(self, config: EngineConfig, with_ids: bool) -> list[str]:
        return []

    def exact_layers(self, config: EngineConfig, num_layers: int) -> tuple[int, ...]:
        return ()

    def model_problems(self, config: EngineConfig, num_layers: int) -> list[str]:
        return []


@runtime_checkable
class DecodePolicy(Protocol):
    """Which context KV a Phase-2 token attends to, per layer (sparse decoding, LuKA).

    The Phase-2 attention asks :meth:`applies` per layer; if so, :meth:`attend_context` gives request ``b``'s
    ``(out, lse)`` over this rank's context shard ``kv`` (merged with the query/generated KV and the other
    ranks' states as usual), and :meth:`after_merge` receives the merged ``lse (B, Hq, S)`` of the layer.
    ``needs_prefill_mass``: Phase 1 must record the attention mass each kept key received
    (:meth:`prefill_mass`); ``score_chunk``: teacher-forced scoring runs this many tokens per forward
    (0: all at once); :meth:`check` raises a ValueError naming the field when a context of that length
    cannot be served.

    The members a policy may leave to :class:`DecodePolicyBase` (its defaults in brackets):

    * ``pages_generated`` [False] -- on the query rank :meth:`attend_context` also receives ``gen=`` the
      request's store of query/generated KV of this layer (this forward's real tokens already appended) and
      returns the state over the shard and that store together (attended causally by position); the engine then
      does not attend the store itself (LuKA pages generated tokens this way);
    * :meth:`prepare` [nothing] (also on :class:`PrefillPolicy`) -- build or load the JIT ops the policy will use;
      the engine calls it once at start, never inside a request;
    * ``stats_keys`` [none] / :meth:`stats` [None] -- after decoding, figures of this rank for one request whose
      values add up over the ranks (surfaced, summed, as ``GenerationResult.decode_stats``): a dict of numbers
      with exactly the keys ``stats_keys`` declares (the same on every rank: the ranks gather them as numbers);
    * :meth:`shard_heads` [refuses] (also on :class:`PrefillPolicy`) -- under tensor parallelism this rank
      computes KV heads ``[first, first + count)`` of ``total`` (and their query heads): every tensor the policy
      is given has only those heads. The policy keeps its per-head parameters for them, or raises a ValueError
      naming the option to change when its choice needs every head. The engine calls it once at start when
      ``tp_size > 1``; the default refuses (a ValueError: use tp_size 1);
    * ``needs_prefill_mass`` [False] / :meth:`prefill_mass`, ``score_chunk`` [0], :meth:`check` [accepts any
      length], :meth:`after_merge` [nothing].
    """

    needs_prefill_mass: bool
    score_chunk: int

    def check(self, context_tokens: int) -> None: ...

    def applies(self, layer: int, window: Optional[int]) -> bool: ...

    def attend_context(self, layer: int, b: int, q: torch.Tensor, kv: LayerKV, q_pos: torch.Tensor, scale: float,
                       context_tokens: int, *, backend: str = "auto", valid: Optional[int] = None
                       ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def after_merge(self, layer: int, lse: torch.Tensor) -> None: ...

    def prefill_mass(self, q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, *, scale: float, q_pos: torch.Tensor,
                     k_pos: torch.Tensor, window: Optional[int] = None) -> torch.Tensor: ...

    pages_generated: bool

    def prepare(self, device: torch.device) -> None: ...

    stats_keys: tuple[str, ...]

    def stats(self, shard: KVShard, context_tokens: int) -> Optional[dict]: ...

    def shard_heads(self, first: int, count: int, total: int) -> None: ...


def _no_tp_shard(policy, count: int, total: int) -> None:
    raise ValueError(f"{type(policy).__name__} cannot run on a tensor-parallel shard of the heads ({count} of "
                     f"{total} KV heads per rank): use tp_size 1 with it")


class DecodePolicyBase:
    """Defaults of a :class:`DecodePolicy`; a policy is built as ``Policy(section_config, model_config)`` and
    defines :meth:`applies` and :meth:`attend_context` (and what it changes of the rest)."""

    needs_prefill_mass = False
    score_chunk = 0  # stateless: teacher-forced scoring runs the whole continuation at once
    pages_generated = False
    stats_keys: tuple[str, ...] = ()

    @classmethod
    def label(cls, cfg: PolicySection) -> str:
        """What sets a run with this policy apart in a report's column (added to the method's label after a "+"):
        by default the policy's name."""
        return cfg.policy

    def __init__(self, cfg: PolicySection, model_config):
        self.cfg = cfg

    def prepare(self, device: torch.device) -> None:
        pass

    def shard_heads(self, first: int, count: int, total: int) -> None:
        _no_tp_shard(self, count, total)

    def check(self, context_tokens: int) -> None:
        pass

    def applies(self, layer: int, window: Optional[int]) -> bool:
        raise NotImplementedError

    def attend_context(self, layer: int, b: int, q: torch.Tensor, kv: LayerKV, q_pos: torch.Tensor, scale: float,
                       context_tokens: int, *, backend: str = "auto", valid: Optional[int] = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def after_merge(self, layer: int, lse: torch.Tensor) -> None:
        pass

    def prefill_mass(self, q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, *, scale: float, q_pos: torch.Tensor,
                     k_pos: torch.Tensor, window: Optional[int] = None) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} needs no Phase-1 attention mass (needs_prefill_mass is "
                                  f"False)")

    def stats(self, shard: KVShard, context_tokens: int) -> Optional[dict]:
        return None


class PrefillStats(Protocol):
    """Counts of what sparse prefill did for one request on one rank; ranks' counts add up. :meth:`counts` are
    the integers the ranks gather (as many on every rank), :meth:`with_counts` the same request's stats with
    other counts (another rank's)."""

    def merge(self, other: "PrefillStats") -> "PrefillStats": ...

    def counts(self) -> list[int]: ...

    def with_counts(self, counts: Sequence[int]) -> "PrefillStats": ...

    def as_dict(self) -> dict: ...


class PrefillRun(Protocol):
    """One request's sparse Phase 1 on this rank (made by :meth:`PrefillPolicy.start`)."""

    stats: PrefillStats
    needs_hidden: bool

    def applies(self, layer: int, window: Optional[int]) -> bool: ...

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
               pos: torch.Tensor, hidden: Optional[torch.Tensor] = None, backend: str = "auto"
               ) -> tuple[torch.Tensor, torch.Tensor]: ...


@runtime_checkable
class PrefillPolicy(Protocol):
    """Sparse prefill for one engine: ``needs_hidden`` (the attention input must be captured) and one
    :class:`PrefillRun` per request, its budget from the context length."""

    needs_hidden: bool

    def start(self, context_tokens: int) -> PrefillRun: ...

    def prepare(self, device: torch.device) -> None: ...

    def shard_heads(self, first: int, count: int, total: int) -> None: ...


class PrefillPolicyBase:
    """Defaults of a :class:`PrefillPolicy` (built as ``Policy(prefill_config, model_config)``): no captured
    hidden states, no ops to prepare, no tensor-parallel shard; a policy defines :meth:`start`."""

    needs_hidden = False

    @classmethod
    def label(cls, cfg: PolicySection) -> str:
        """What sets a run with this policy apart in a report's column (after a "+"): by default its name."""
        return f"prefill_{cfg.policy}"

    def __init__(self, cfg: PolicySection, model_config):
        self.cfg = cfg

    def start(self, context_tokens: int) -> PrefillRun:
        raise NotImplementedError

    def prepare(self, device: torch.device) -> None:
        pass

    def shard_heads(self, first: int, count: int, total: int) -> None:
        _no_tp_shard(self, count, total)


# -- the registries ----------------------------------------------------------------------------------------
_METHODS: dict[str, ContextMethod] = {}


def context_method(name: str) -> ContextMethod:
    """The :class:`ContextMethod` registered as ``name`` in :data:`magnetar.config.METHODS`."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; valid options are {', '.join(METHODS)}")
    if name not in _METHODS:
        _METHODS[name] = load_class(METHODS[name].impl)()
    return _METHODS[name]


def plan_rank(config: EngineConfig, context_ids: torch.Tensor, cp_rank: int) -> RankPlan:
    """The Phase-1 plan of ``cp_rank`` for ``context_ids (L,)`` under ``config``: its method's plan, after the
    method's :meth:`~ContextMethod.validate` (a ValueError lists its reasons)."""
    return _validated(config, int(context_ids.numel())).plan(config, context_ids, cp_rank)


def plan_for_length(config: EngineConfig, context_len: int, cp_rank: int) -> RankPlan:
    """:func:`plan_rank` without token ids: the method's :meth:`~ContextMethod.plan_for_length` (the cost model)."""
    return _validated(config, context_len).plan_for_length(config, context_len, cp_rank)


def check_model(config: EngineConfig, num_layers: int) -> None:
    """A ValueError when ``config``'s method cannot run a model of ``num_layers`` layers (its reasons)."""
    reasons = context_method(config.method).model_problems(config, num_layers)
    if reasons:
        raise ValueError(f"method {config.method!r} cannot run this model: " + "; ".join(reasons))


def _validated(config: EngineConfig, context_len: int) -> ContextMethod:
    method = context_method(config.method)
    reasons = method.validate(config, context_len)
    if reasons:
        raise ValueError(f"method {config.method!r} cannot run this request: " + "; ".join(reasons))
    return method


def decode_policy(cfg: Optional[PolicySection], model_config) -> Optional[DecodePolicy]:
    """The :class:`DecodePolicy` that a decode section names (``config.decode_config``: a ``SparseConfig`` or a
    ``LukaConfig``; None or policy ``none``: dense decoding, None)."""
    return _policy(cfg, model_config, DECODE_SECTIONS, "decode")


def prefill_policy(cfg: Optional[PolicySection], model_config) -> Optional[PrefillPolicy]:
    """The :class:`PrefillPolicy` that a ``PrefillConfig`` names (None: policy ``none``)."""
    return _policy(cfg, model_config, ("prefill",), "prefill")


def policy_label(cfg: PolicySection) -> Optional[str]:
    """The report label of the policy a config section names (its class's ``label``, from the registry), or None
    for policy ``none``."""
    if cfg.policy == "none":
        return None
    return load_class(POLICIES[cfg.policy].impl).label(cfg)


def _policy(cfg, model_config, sections: tuple, what: str):
    if cfg is None:
        return None
    if not (isinstance(cfg, PolicySection) and cfg.section in sections):
        raise TypeError(f"a {what} policy is configured by the config section {' or '.join(sections)}, got "
                        f"{type(cfg).__name__}")
    if cfg.policy == "none":
        return None
    spec = POLICIES.get(cfg.policy)
    if spec is None or spec.section != cfg.section:
        raise ValueError(f"no {cfg.section} policy {cfg.policy!r} is registered (magnetar.config.POLICIES)")
    return load_class(spec.impl)(cfg, model_config)
