#!/usr/bin/env bash
# Every evaluation run behind docs/results.md, SmolLM2-135M-Instruct, 4 blocks (4 CP ranks).
#
#   benchmarks/eval_smollm2.sh ruler4k      # one part; parts: ruler4k babilong4k niah8k ablation ppl speed
#                                           # (and ablation_babilong, halo4k, halo8k, hybrid4k, hybrid8k, halo_speed: not in all)
#   benchmarks/eval_smollm2.sh all
#
# Each part resumes from runs/<part>/results*.jsonl, so a part interrupted (or split over sessions) goes on
# where it stopped; a fresh checkout without runs/<part> starts from the records committed in
# docs/results/<part>/ (copy runs/<part>/results*.jsonl there to hand a part on). NPROC processes (default 2:
# this VM's 2 cores) each stand in for the 4 CP ranks (--simulate-ranks 4) and split the items; on GPUs set
# NPROC to the GPU count. Times on the 2-core VM:
# ruler4k ~3.5 h, babilong4k ~0.7 h, niah8k ~4.1 h (8 tasks x 4 methods x 10 = 320 items, 70-107 s each
# per process: the 4 simulated ranks' Phase 1 one after another, dense/ring ~75 s, Star ~90 s, Pulsar ~53 s,
# plus ~15 s of 128-token batched decode per item), ablation ~0.6 h, ppl ~0.5 h, speed ~0.5 h.
set -euo pipefail
cd "$(dirname "$0")/.."
export MAGNETAR_DISABLE_DS_SHM=1
NPROC=${NPROC:-2}
BIN=${BIN:-.venv/bin}
PORT=${PORT:-29621}
BATCH=${BATCH:-4}
eval_run() { "$BIN/deepspeed" --num_gpus "$NPROC" --master_port "$PORT" --module magnetar.eval --simulate-ranks 4 \
  --batch "$BATCH" "$@"; }

resume_from_docs() {  # a part split over sessions: start from the records committed in docs/results/<part>
  if [ ! -d "runs/$1" ] && compgen -G "docs/results/$1/results*.jsonl" > /dev/null; then
    mkdir -p "runs/$1" && cp docs/results/"$1"/results*.jsonl "runs/$1/"
    echo "runs/$1: resuming from the records in docs/results/$1" >&2
  fi
}

part() {
  resume_from_docs "$1"
  case "$1" in
    ruler4k) eval_run --suite ruler --methods dense,pulsar,star,ring --lengths 4k --samples 10 --out runs/ruler4k ;;
    babilong4k) eval_run --suite babilong --tasks qa1,qa3,qa5 --methods dense,pulsar,star,ring --lengths 4k \
                  --samples 10 --out runs/babilong4k ;;
    niah8k) eval_run --suite ruler --tasks niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2,niah_multikey_3,niah_multivalue,niah_multiquery \
              --methods dense,pulsar,star,ring --lengths 8k --samples 10 --out runs/niah8k ;;
    halo4k)  # issue 30: Star with a halo of one block (each block also sees the whole block before it) and a 400-token
      # anchor, the frontier's best 4K configuration by fidelity (there as --halo-size 990, docs/results.md), on the
      # same items as ruler4k. Relative (--halo-blocks 1): a fixed 990 was refused by a 3948-token context's
      # 987-token blocks after 49 items (those records stay, under their own label)
      resume_from_docs ruler4k
      eval_run --suite ruler --methods star --anchor-size 400 --halo-blocks 1 --lengths 4k --samples 10 --out runs/ruler4k ;;
    halo8k)  # issue 30: Star with a halo of (almost) one block and a 700-token anchor, the 8K configuration whose
      # fidelity meets the goal (docs/results.md), on the same items as niah8k
      resume_from_docs niah8k
      eval_run --suite ruler --tasks niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2,niah_multikey_3,niah_multivalue,niah_multiquery \
        --methods star --anchor-size 700 --halo-size 1970 --lengths 8k --samples 10 --out runs/niah8k ;;
    hybrid4k)  # issue 30: hybrid layers -- the first 15 of SmolLM2's 30 layers attend exactly to every earlier block
      # (their KV exchanged as ring's), the others are Star's with a 64-token anchor and half a block of halo: the
      # frontier's best 4K configuration by fidelity (docs/results.md), on the same items as ruler4k
      eval_run --suite ruler --methods star --anchor-size 64 --halo-blocks 0.5 --exact-layers 0-14 --lengths 4k \
        --samples 10 --out runs/ruler4k ;;
    hybrid8k)  # issue 30: the same configuration on the niah8k items
      eval_run --suite ruler --tasks niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2,niah_multikey_3,niah_multivalue,niah_multiquery \
        --methods star --anchor-size 64 --halo-blocks 0.5 --exact-layers 0-14 --lengths 8k --samples 10 --out runs/niah8k ;;
    halo_speed)  # issue 30: measured Phase-1 critical path of the halo configurations beside Star's and dense's
      # (4 simulated ranks, each timed alone; one command per option set, all in one run side by side)
      for opts in "" "--anchor-size 512 --halo-size 500" "--anchor-size 400 --halo-size 990"; do
        "$BIN/python" -m magnetar.eval.bench --methods "$([ -z "$opts" ] && echo dense,star || echo star)" \
          --lengths 4096 --simulate-ranks 4 --warmup 1 --repeats 2 $opts --json-out "runs/speed_halo_4k${opts// /}.json"
      done
      for opts in "" "--anchor-size 700 --halo-size 1970"; do
        "$BIN/python" -m magnetar.eval.bench --methods "$([ -z "$opts" ] && echo dense,star || echo star)" \
          --lengths 8128 --simulate-ranks 4 --warmup 0 --repeats 2 $opts --json-out "runs/speed_halo_8k${opts// /}.json"
      done ;;
    ablation)  # Pulsar Table 3's shape, 5 scorers x 3 summary budgets, on perplexity at 4K (paired vs dense):
      # SmolLM2-135M answers no BABILong question even at 512 tokens (docs/results.md), so accuracy there
      # cannot separate scorers; ablation_babilong below is the Table-3 task set for a larger model.
      eval_run --suite ppl --methods dense --lengths 4k --samples 8 --out runs/ablation_ppl
      for budget in 0.0625 0.125 0.25; do
        for scorer in max_idf tfidf bm25 entropy even; do
          eval_run --suite ppl --methods pulsar --scorer "$scorer" --summary-budget "$budget" --lengths 4k \
            --samples 8 --out runs/ablation_ppl
        done
      done ;;
    ablation_babilong)
      for budget in 0.0625 0.125 0.25; do
        for scorer in max_idf tfidf bm25 entropy even; do
          eval_run --suite babilong --tasks qa1,qa3,qa5 --methods pulsar --scorer "$scorer" \
            --summary-budget "$budget" --lengths 4k --samples 10 --out runs/ablation
        done
      done ;;
    ppl) eval_run --suite ppl --methods dense,pulsar,star,ring --lengths 2k,4k,8k --samples 10 --out runs/ppl ;;
    speed)
      "$BIN/python" -m magnetar.eval.bench --methods dense,star,pulsar --lengths 4096,8128 --simulate-ranks 4 \
        --warmup 1 --repeats 3 --json-out runs/speed_4k8k.json  # 8128 + query 32 + 8 new tokens fit 8192 positions
      "$BIN/python" -m magnetar.eval.bench --methods star,pulsar --lengths 16384 --simulate-ranks 4 \
        --warmup 0 --repeats 2 --beyond-trained-length --json-out runs/speed_16k.json ;;  # 32K: ~1 h more on the 2-core VM
    all) for p in ruler4k babilong4k niah8k ablation ppl speed; do part "$p"; done ;;
    *) echo "unknown part $1 (ruler4k babilong4k niah8k halo4k halo8k hybrid4k hybrid8k halo_speed ablation ablation_babilong ppl speed all)" >&2; exit 2 ;;
  esac
}

mkdir -p runs
part "${1:-all}"
