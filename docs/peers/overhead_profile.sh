#!/bin/bash
# The before/after profile of issue 33 item 2 (docs/BENCHMARKS.md, "The per-token overhead cut"), as run on
# 2026-12-06, twice. Trees: /tmp/overhead/base = `git archive c7fb661 src` (the branch's base), /tmp/overhead/tip =
# `git archive <commit> src benchmarks` (the branch). Session 1, 10:59-11:06 UTC, commit 4a45542: overhead_profile.log
# and overhead_k3_profile.jsonl here (the K3 runs' JSON records). Session 2, 11:16-11:25 UTC, commit f1a6ce3:
# overhead_profile_2.log and overhead_k3_profile_2.jsonl.
# before (base c7fb661's src) and after (this branch's src), the same bench scripts (the branch's), alternated
cd /tmp/overhead/tip
export OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1
PY=/work/main/.venv/bin/python
OUT=/tmp/overhead/runs
mkdir -p $OUT
for round in 1 2 3; do
  for tree in base tip; do
    if [ $tree = base ]; then SRC=/tmp/overhead/base/src; else SRC=/tmp/overhead/tip/src; fi
    echo "== round $round $tree $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
    PYTHONPATH=$SRC $PY benchmarks/bench_k3_profile.py --model embedded --steps 32 --top 25 > $OUT/k3e-$tree-$round.txt 2>&1
    grep -E "^profiled|^prefill" $OUT/k3e-$tree-$round.txt | sed "s/^/k3-embedded $tree: /"
    PYTHONPATH=$SRC $PY benchmarks/bench_k3_profile.py --steps 16 --top 25 > $OUT/k3w-$tree-$round.txt 2>&1
    grep -E "^profiled|^prefill" $OUT/k3w-$tree-$round.txt | sed "s/^/k3-widened $tree: /"
    PYTHONPATH=$SRC $PY benchmarks/bench_family_profile.py --families qwen3_moe --precisions int8,bf16 --steps 32 2>&1 | grep -v "^$" | sed "s/^/$tree: /"
  done
done
echo "== done $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
