"""Engine configuration: a tree of frozen, keyword-only dataclasses, validated once, never mutated.

    EngineConfig
      method          dense | ring | star | pulsar | streaming
      parallel        cp_size, tp_size, timeout_s, zigzag, simulate, rank_by_rank, shm_gather
      blocks          block_size, anchor_size, halo_size/_blocks, exact_layers  (star, pulsar; anchor: star)
      pulsar          sink_size, chunk_size, summary_budget, scorer, positions, discard_summary_kv
      streaming       sink_tokens, window_size
      decode          temperature, top_k, top_p, seed
      sparse          sparse_policy, sparse_budget, sparse_pruning, dense_layers, sparse_sinks, sparse_window,
                      code_bits, page_size, hash_path, hash_seed     (sparse decoding, any method)
      luka            luka_mode, luka_lined_layers, luka_heavy_fraction, luka_recent, luka_page_size,
                      luka_compressor, luka_tau, luka_refine, luka_refine_k, luka_refine_fraction,
                      luka_refine_eps, luka_refine_mass, luka_refine_scope, luka_compress_every, luka_regime,
                      luka_zero_values, luka_size_bias, luka_seed
                      (LuKA decode-time KV structures: dense, star, pulsar)
      prefill         prefill_policy, prefill_topk, prefill_schedule, prefill_b_sel, prefill_dense_layers,
                      prefill_indexer_path, prefill_indexer_random_init, prefill_d_idx, prefill_seed
                      (sparse prefill of global attention layers: dense, star, pulsar)
      runtime         dtype, attention_backend, deepspeed_inference, check_finite, context_cache_mb,
                      host_cache_mb, context_store, context_store_mb, prefix_reuse, decode_step,
                      decode_graph_batches, decode_graph_tokens, decode_graph_warmup_s

Build it nested (``EngineConfig(method="pulsar", pulsar=PulsarConfig(scorer="bm25"))``), flat
(``EngineConfig.create(method="pulsar", cp_size=4, scorer="bm25")``), from a JSON/YAML file
(:meth:`EngineConfig.from_file`, nested or flat keys) or from CLI flags (:func:`add_cli_args` /
:meth:`EngineConfig.from_cli`). Every error names the field (and the flag) to change.

The package, one module per job (read the one you need): :mod:`~magnetar.config.registry` (methods, policies,
choice tables), :mod:`~magnetar.config.sections` (the sections' fields and checks -- "which options does Pulsar
have"), :mod:`~magnetar.config.tree` (``EngineConfig``), :mod:`~magnetar.config.files` (JSON/YAML),
:mod:`~magnetar.config.cli` (flags) and :mod:`~magnetar.config.checks` (the generic checks). It is the bottom
layer: it imports nothing of magnetar.
"""
from magnetar.config.checks import FieldError, describe, short_repr
from magnetar.config.cli import add_cli_args
from magnetar.config.files import MAX_CONFIG_BYTES, MAX_INT_DIGITS, MAX_YAML_NODES
from magnetar.config.registry import (DECODE_SECTIONS, DISTRIBUTED_METHODS, DTYPES, FIELD_CHOICES, LUKA_COMPRESSORS,
                                      LUKA_METHODS, LUKA_REFINE, LUKA_REFINE_MASS, LUKA_REFINE_SCOPE, LUKA_REGIMES,
                                      METHODS, POLICIES, POLICY_FIELDS, POSITION_MODES, PREFILL_D_IDX,
                                      PREFILL_METHODS, SCORERS, MethodSpec, PolicySpec, field_choices,
                                      policy_choices)
from magnetar.config.sections import (PAPER_SCHEDULE, SPARSE_DEFAULT_SINKS_WINDOW, BlockConfig, DecodeConfig,
                                      EncodingSection, LukaConfig, ParallelConfig, PolicySection, PrefillConfig,
                                      PulsarConfig, RuntimeConfig, Schedule, SparseConfig, StreamingConfig,
                                      budget_for_length, parse_exact_layers, parse_schedule)
from magnetar.config.tree import FLAT_FIELDS, REQUEST_OPTIONS, SECTIONS, EngineConfig

__all__ = ["EngineConfig", "SECTIONS", "FLAT_FIELDS", "REQUEST_OPTIONS", "add_cli_args", "MethodSpec", "METHODS",
           "DISTRIBUTED_METHODS", "LUKA_METHODS", "PREFILL_METHODS", "PolicySpec", "POLICIES", "POLICY_FIELDS",
           "DECODE_SECTIONS", "policy_choices", "field_choices", "PolicySection", "EncodingSection", "FIELD_CHOICES",
           "SCORERS", "POSITION_MODES", "DTYPES", "LUKA_COMPRESSORS", "LUKA_REFINE", "LUKA_REFINE_MASS",
           "LUKA_REFINE_SCOPE", "LUKA_REGIMES", "PREFILL_D_IDX", "ParallelConfig", "BlockConfig",
           "PulsarConfig", "StreamingConfig", "DecodeConfig", "RuntimeConfig", "SparseConfig", "LukaConfig",
           "PrefillConfig", "Schedule", "PAPER_SCHEDULE", "SPARSE_DEFAULT_SINKS_WINDOW", "parse_schedule",
           "parse_exact_layers", "budget_for_length", "MAX_CONFIG_BYTES", "MAX_INT_DIGITS", "MAX_YAML_NODES",
           "short_repr", "describe", "FieldError"]
