#!/usr/bin/env bash
# Everything GPU-specific in one go (issue: the roofline, item 7), sized to finish in < 8 minutes
# on one H200. Results go under $OUT when it is set (the device tool), else runs/gpu-check/.
#
#   bash scripts/gpu_check.sh            # then: commit $OUT/*.json under figures/reference/
#
# Results: $OUT/gpu-check.tgz (everything) plus the main sweep JSON and the printed tables.
# 1. doctor (torch build, NVML name/memory/spec bandwidth)
# 2. the llama-3.1-8b twin in bf16, decode sweep 1 → 512 with CUDA graphs (measured ceilings inside)
# 3. batch 1 without CUDA graphs (launch overhead, chapter 10.5)
# 4. batch-1 decode: minillm vs transformers' generate, achieved bandwidth vs measured copy bandwidth
set -uo pipefail
cd "$(dirname "$0")/.."
FINAL="${OUT:-runs/gpu-check}"
OUT="$FINAL/all"            # the device tool returns at most 8 files: bundle at the end
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # runs from the source tree: no install needed
PY="${PYTHON:-python3}"
# overridable for a dry run on a CPU: MODEL=tiny DTYPE=fp32 MAXB=8 bash scripts/gpu_check.sh
MODEL="${MODEL:-llama-3.1-8b}"; DTYPE="${DTYPE:-bf16}"; MAXB="${MAXB:-512}"
step() { echo; echo "=== $* ($(date +%T))"; }

step doctor
timeout 30 $PY -m minillm doctor 2>&1 | tee "$OUT/doctor.txt"

step "roofline sweep: $MODEL $DTYPE, batches 1..$MAXB, CUDA graphs on"
timeout 240 $PY -m minillm roofline --model "$MODEL" --dtype "$DTYPE" --max-batch "$MAXB" --context 512 \
    --out "$OUT" --figures "$OUT" 2>&1 | tee "$OUT/roofline.txt"

step "batch 1 (and 8), CUDA graphs off"
mkdir -p "$OUT/nographs"
timeout 90 $PY -m minillm roofline --model "$MODEL" --dtype "$DTYPE" --batches 1,8 --context 512 \
    --no-cuda-graphs --out "$OUT/nographs" --figures "$OUT/nographs" 2>&1 | tee "$OUT/roofline-nographs.txt"

step "batch-1 decode benchmark: minillm vs transformers"
timeout 120 $PY -m minillm bench --model "$MODEL" --dtype "$DTYPE" --new-tokens 128 \
    --json "$OUT/bench-$MODEL-$DTYPE.json" 2>&1 | tee "$OUT/bench.txt"

step done
ls -la "$OUT" "$OUT/nographs"
# budget: 30 + 240 + 90 + 120 s of timeouts = 8 min at worst; a killed sweep keeps roofline-partial.jsonl
tar -czf "$FINAL/gpu-check.tgz" -C "$FINAL" all
cp "$OUT"/roofline-*.json "$OUT"/bench.txt "$OUT"/roofline.txt "$FINAL/" 2>/dev/null
rm -rf "$OUT"
ls -la "$FINAL"
