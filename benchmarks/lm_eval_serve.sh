#!/usr/bin/env bash
# lm-eval's `local-completions` against `magnetar serve`, and lm-eval's own Hugging Face model on the same items: a
# local multiple-choice task (benchmarks/lm_eval_task: a passage with a number, four numbers to choose from; no
# download). lm-eval sends token-id prompts with echo + logprobs + max_tokens 1 (its log-likelihood request); the
# served log-likelihoods must equal Hugging Face's item by item (docs/results.md, "lm-eval through the server").
#
#   LM_EVAL=/path/to/venv/bin/lm_eval benchmarks/lm_eval_serve.sh      # lm-eval installed in a virtualenv of its own
#   METHOD=star EXTRA="--cp-size 4 --simulate" benchmarks/lm_eval_serve.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
LM_EVAL=${LM_EVAL:-lm_eval}
MODEL=${MODEL:-smollm2-135m-instruct}
METHOD=${METHOD:-dense}
EXTRA=${EXTRA:-}
PORT=${PORT:-8331}
OUT=${OUT:-runs/lm_eval_serve/$METHOD}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 MAGNETAR_DISABLE_DS_SHM=1
folder=$("$BIN/python" -c "from magnetar.models.prepare import model_path; print(model_path('$MODEL'))")
"$BIN/python" benchmarks/lm_eval_task/make_data.py
mkdir -p "$OUT"
# shellcheck disable=SC2086
"$BIN/python" -m magnetar.serve --model "$MODEL" --method "$METHOD" $EXTRA --port "$PORT" --served-model-name "$MODEL" \
  > "$OUT/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
  kill -0 $server 2>/dev/null || { cat "$OUT/server.log"; exit 1; }
  sleep 1
done
t0=$(date +%s)
"$LM_EVAL" --model local-completions --tasks needle_mc --include_path benchmarks/lm_eval_task --log_samples \
  --model_args "model=$MODEL,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer=$folder,tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1" \
  --output_path "$OUT/served" > "$OUT/served.log" 2>&1 || { tail -30 "$OUT/served.log"; exit 1; }
t1=$(date +%s)
kill $server; wait $server 2>/dev/null || true
"$LM_EVAL" --model hf --model_args "pretrained=$folder,dtype=float32" --device cpu --tasks needle_mc \
  --include_path benchmarks/lm_eval_task --log_samples --output_path "$OUT/hf" > "$OUT/hf.log" 2>&1 \
  || { tail -30 "$OUT/hf.log"; exit 1; }
t2=$(date +%s)
"$BIN/python" - "$OUT" $((t1 - t0)) $((t2 - t1)) <<'PY'
import glob, json, sys
out, served_s, hf_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def samples(kind):
    [path] = glob.glob(f"{out}/{kind}/**/samples_needle_mc_*.jsonl", recursive=True)
    return {s["doc_id"]: s for s in map(json.loads, open(path))}
served, hf = samples("served"), samples("hf")
ll = lambda s, c: float(s["resps"][c][0][0])  # noqa: E731  (lm-eval stores them as strings)
diffs = [abs(ll(served[i], c) - ll(hf[i], c)) for i in served for c in range(len(served[i]["resps"]))]
acc = {k: sum(s["acc"] for s in v.values()) / len(v) for k, v in (("served", served), ("hf", hf))}
same_choice = sum(max(range(4), key=lambda c: ll(served[i], c)) == max(range(4), key=lambda c: ll(hf[i], c))
                  for i in served)
print(f"| items | acc served | acc HF | same choice | max abs diff of log-likelihood | served s | HF s |")
print(f"|---:|---:|---:|---:|---:|---:|---:|")
print(f"| {len(served)} | {acc['served']:.3f} | {acc['hf']:.3f} | {same_choice}/{len(served)} | {max(diffs):.2e} | "
      f"{served_s} | {hf_s} |")
print(json.dumps(dict(bench="lm_eval_serve", items=len(served), acc_served=acc["served"], acc_hf=acc["hf"],
                      same_choice=same_choice, max_abs_diff=max(diffs), served_s=served_s, hf_s=hf_s)))
PY
