#!/usr/bin/env bash
# Issue #20's GPU sweep: four recipes in parallel on one GPU, plus two identical short runs that check that a
# --device cuda run reproduces byte for byte. Run from the repository root, with the corpus cache built on CPU
# (docs/MODEL.md, "Reproduce the default"):
#   CACHE=/tmp/k3-corpus OUT=/tmp/sweep bash docs/model_sweep/h20_sweep.sh
# Each run's checkpoint, train_log.json and log land in $OUT/<run>.tgz (refreshed every minute, so a cut call
# still returns the last periodic checkpoint); $OUT/logs.tgz holds the reproducibility pair and the summary.
set -u
SRC=${SRC:-src}; CACHE=${CACHE:?the corpus cache folder}; OUT=${OUT:?the output folder}
DEVICE=${DEVICE:-cuda}; BUDGET=${BUDGET:-450}; HARD=${HARD:-490}; BATCH=${BATCH:-32}; SEQ=${SEQ:-512}
export PYTHONPATH=$SRC PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
PY=${PY:-python3}
RUNS=$(mktemp -d); mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  $PY -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])"; } | tee "$RUNS/host.txt"
COMMON=(--device "$DEVICE" --corpus-cache "$CACHE" --seq-len "$SEQ" --eval-len 256 --copy-bytes 6000000
        --copy-per-module 16 --extra-code-bytes 8000000 --extra-prose 1 --hidden-size 256 --kda-heads 8
        --mla-heads 8 --kv-lora-rank 64 --q-lora-rank 128 --dense-intermediate 512 --seed 0 --threads 1)
SWEEP=(--warmup 200 --time-budget "$BUDGET" --seconds "$HARD" --steps 1000000 --eval-every 250 --save-every 1000)
train() {  # name, then the run's own flags
    local name=$1; shift
    mkdir -p "$RUNS/$name"
    $PY -m k3serve.training.train --out "$RUNS/$name" "${COMMON[@]}" "$@" > "$RUNS/$name.log" 2>&1
    echo "$name exit $?" >> "$RUNS/status.txt"
}
pack() {
    for name in v1 v2 v3 v4; do
        [ -d "$RUNS/$name" ] && tar czf "$OUT/tmp_$name.tgz" -C "$RUNS" "$name" "$name.log" && mv "$OUT/tmp_$name.tgz" "$OUT/$name.tgz"
    done
    tar czf "$OUT/tmp_logs.tgz" -C "$RUNS" --exclude='*.safetensors' . && mv "$OUT/tmp_logs.tgz" "$OUT/logs.tgz"
}
train r1 --batch-size 8 --lr 6e-3 --copy-share 0.25 --steps 30 --warmup 10 --eval-every 30 &
train r2 --batch-size 8 --lr 6e-3 --copy-share 0.25 --steps 30 --warmup 10 --eval-every 30 &
train v1 --batch-size "$BATCH" --lr 6e-3 --copy-share 0.25 "${SWEEP[@]}" &
train v2 --batch-size "$BATCH" --lr 6e-3 --copy-share 0.5 "${SWEEP[@]}" &
train v3 --batch-size "$BATCH" --lr 3e-3 --copy-share 0.25 "${SWEEP[@]}" &
train v4 --batch-size $((2 * BATCH)) --lr 6e-3 --copy-share 0.25 "${SWEEP[@]}" &
( while sleep 60; do pack; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null \
    >> "$RUNS/gpu.txt"; for name in v1 v2 v3 v4; do tail -n 1 "$RUNS/$name.log"; done; done ) &
packer=$!
wait $(jobs -p | grep -v "^$packer\$")
kill "$packer" 2>/dev/null
{ cat "$RUNS/status.txt"
  for name in r1 r2; do grep -h "SHA256SUMS digest" "$RUNS/$name.log"; done
  cmp -s "$RUNS/r1/SHA256SUMS" "$RUNS/r2/SHA256SUMS" && echo "reproducible: r1 == r2" || echo "NOT reproducible: r1 != r2"
  grep -h -i "determinis" "$RUNS"/*.log | sort | uniq -c | head -20
  for name in v1 v2 v3 v4; do echo "== $name"; grep -E "^(time budget|step|exported)" "$RUNS/$name.log" | tail -n 8; done
} 2>&1 | tee "$RUNS/summary.txt"
pack
