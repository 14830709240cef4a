#!/usr/bin/env bash
# Every sparse-decoding run behind docs/results.md (issue 5), SmolLM2-135M-Instruct.
#
#   benchmarks/sparse_smollm2.sh hashes     # train the Spotlight (MLP) hash and the linear (LSH) one; IoU tables
#   benchmarks/sparse_smollm2.sh ppl        # perplexity: dense vs oracle_topk / lsh / quest / spotlight x pruning
#   benchmarks/sparse_smollm2.sh table1     # Table 1's PPL columns: random-init MLP and trained LSH hashes, 98 % pruned
#   benchmarks/sparse_smollm2.sh sinks      # the same with sinks+window swapped: spotlight with MagicPIG's 4+64, lsh without
#   benchmarks/sparse_smollm2.sh ppl_cp     # the same over Pulsar's distributed KV (4 simulated ranks)
#   benchmarks/sparse_smollm2.sh niah       # NIAH grid, dense decoding vs Spotlight at 90 % pruning
#   benchmarks/sparse_smollm2.sh kernel     # Hamming top-k op vs the memory-bandwidth floor
#
# Everything resumes (hash training per layer, evaluations per window / item). Hashes go to runs/hashes/.
set -euo pipefail
cd "$(dirname "$0")/.."
export MAGNETAR_DISABLE_DS_SHM=1
BIN=${BIN:-.venv/bin}
THREADS=${THREADS:-1}
MLP=runs/hashes/smollm2-spotlight.pt
LSH=runs/hashes/smollm2-lsh-trained.pt
POL=oracle_topk,lsh,quest,spotlight
part() {
  case "$1" in
    hashes)
      "$BIN/magnetar-calibrate" spotlight --out "$MLP" --threads "$THREADS"
      "$BIN/magnetar-calibrate" spotlight --hash lsh --out "$LSH" --threads "$THREADS" ;;
    ppl) "$BIN/python" -m magnetar.eval.experiments.sparse_ppl --policies "$POL" --pruning 0.9,0.95,0.98 \
           --hash-path "$MLP" --lengths 4k --windows 8 --threads "$THREADS" --out runs/sparse_ppl ;;
    table1)
      "$BIN/python" -c "import sys; from magnetar.sparse.hashing import HashBank; \
HashBank.load(sys.argv[1]).initial().save(sys.argv[2])" "$MLP" "${MLP%.pt}-untrained.pt"
      "$BIN/python" -m magnetar.eval.experiments.sparse_ppl --policies spotlight --pruning 0.98 \
           --hash-path "${MLP%.pt}-untrained.pt" --lengths 4k --windows 8 --threads "$THREADS" --out runs/sparse_ppl
      "$BIN/python" -m magnetar.eval.experiments.sparse_ppl --policies lsh --pruning 0.98 --lsh-hash-path "$LSH" \
           --lengths 4k --windows 8 --threads "$THREADS" --out runs/sparse_ppl ;;
    sinks)
      "$BIN/python" -m magnetar.eval.experiments.sparse_ppl --policies spotlight --sinks 4 --window 64 \
           --pruning 0.9,0.95,0.98 --hash-path "$MLP" --lengths 4k --windows 8 --threads "$THREADS" --out runs/sparse_ppl
      "$BIN/python" -m magnetar.eval.experiments.sparse_ppl --policies lsh --sinks 0 --window 0 \
           --pruning 0.9,0.95,0.98 --lengths 4k --windows 8 --threads "$THREADS" --out runs/sparse_ppl ;;
    ppl_cp) "$BIN/python" -m magnetar.eval.experiments.sparse_ppl --methods pulsar --policies oracle_topk,spotlight \
           --pruning 0.9,0.98 --hash-path "$MLP" --lengths 4k --windows 8 --threads "$THREADS" --out runs/sparse_ppl ;;
    niah) for extra in "" "--sparse-policy spotlight --sparse-pruning 0.9 --hash-path $MLP"; do
            # shellcheck disable=SC2086
            "$BIN/python" -m magnetar.eval --suite niah --methods dense --lengths 2k,4k --samples 1 --batch 5 \
              --deepspeed-inference false --out runs/sparse_niah $extra
          done ;;
    kernel) "$BIN/python" benchmarks/bench_hamming.py --keys 65536,524288 --threads "$THREADS" ;;
    all) for p in hashes ppl table1 sinks ppl_cp niah kernel; do part "$p"; done ;;
    *) echo "unknown part $1 (hashes ppl table1 sinks ppl_cp niah kernel all)" >&2; exit 2 ;;
  esac
}
part "${1:-all}"
