#!/usr/bin/env bash
# Everything GPU-specific in one go (the GPU issue), sized by estimate to finish in about 8 minutes
# on one H200: the timeouts below sum to 480 s, and every step keeps what it measured if killed.
# It has never run on a GPU yet. Results go under $OUT when it is set (the device tool), else
# runs/gpu-check/. The device tool returns at most 8 files: everything is bundled in one tgz and
# the main JSON files are copied beside it.
#
#   bash scripts/gpu_check.sh            # then commit the JSON under figures/reference/
#
# 1. doctor (torch build, NVML name/memory/spec bandwidth)
# 2. the llama-3.1-8b twin in bf16: decode sweep 1 → 256 with CUDA graphs, "ideal" and "served"
#    (measured read and copy bandwidth, bf16 matmul peak inside)              → figures/reference/
# 3. batch-1 engine decode, CUDA graphs on and off (--enforce-eager), against transformers; then
#    through torch.compile (--compile: never run on CUDA yet)
# 4. 10.4: prefill sweep to 8192, decode beside it, the stall and the chunk trade-off
#                                                                     → figures/reference/prefill-decode/
# 5. 10.5: engine decode eager vs graphs at batch 1, 8, 64 (tiny and the 8B twin), sampling at 8k and
#    128k, profile_steps on tiny at batch 1 eager vs graphs, step phases   → figures/reference/
#
# Dry run on a CPU (checks the script's logic, not the GPU paths):
#   MODEL=tiny DTYPE=fp32 MAXB=8 LENGTHS=16,64,256 STALL=512 ALLOW_CPU=--allow-cpu bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
FINAL="${OUT:-runs/gpu-check}"
OUT="$FINAL/all"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # runs from the source tree: no install needed
PY="${PYTHON:-python3}"
MODEL="${MODEL:-llama-3.1-8b}"; DTYPE="${DTYPE:-bf16}"; MAXB="${MAXB:-256}"
LENGTHS="${LENGTHS:-16,64,256,1024,2048,4096,8192}"; STALL="${STALL:-4096}"; ALLOW_CPU="${ALLOW_CPU:-}"
step() { echo; echo "=== $* ($(date +%T))"; }

step doctor
timeout 20 $PY -m minillm doctor 2>&1 | tee "$OUT/doctor.txt"

step "roofline sweep: $MODEL $DTYPE, batches 1..$MAXB, CUDA graphs on, ideal + served"
timeout 150 $PY -m minillm roofline --model "$MODEL" --dtype "$DTYPE" --max-batch "$MAXB" --context 512 \
    --steps 8 --out "$OUT" --figures "$OUT" 2>&1 | tee "$OUT/roofline.txt"

step "batch-1 engine decode: CUDA graphs, then --enforce-eager (and transformers once)"
timeout 30 $PY -m minillm bench --model "$MODEL" --dtype "$DTYPE" --new-tokens 64 --repeats 2 \
    --json "$OUT/bench-graphs.json" 2>&1 | tee "$OUT/bench.txt"
timeout 20 $PY -m minillm bench --model "$MODEL" --dtype "$DTYPE" --new-tokens 64 --repeats 2 \
    --no-transformers --enforce-eager --json "$OUT/bench-eager.json" 2>&1 | tee -a "$OUT/bench.txt"

step "batch-1 engine decode through torch.compile (Inductor/Triton, then graph capture; issue 14)"
timeout 60 $PY -m minillm bench --model "$MODEL" --dtype "$DTYPE" --new-tokens 64 --repeats 2 \
    --no-transformers --compile --json "$OUT/bench-compiled.json" 2>&1 | tee -a "$OUT/bench.txt"

step "10.4 prefill vs decode, stall $STALL, chunk trade-off"
mkdir -p "$OUT/prefill-decode"
timeout 100 $PY -m minillm.measure.prefill_decode --model "$MODEL" --dtype "$DTYPE" --lengths "$LENGTHS" \
    --batches 1,8,64 --context 512 --repeats 2 --stall-long "$STALL" --n-short 8 --budgets 256,1024,4096 \
    --out "$OUT/prefill-decode" 2>&1 | tee "$OUT/prefill-decode.txt"

step "10.5 eager vs graphs, sampling 8k/128k, profile tiny, step phases"
mkdir -p "$OUT/outside"
timeout 100 $PY -m minillm.measure.outside_reference --out "$OUT/outside" --models "tiny,$MODEL" \
    --batches 1,8,64 --context 512 --steps 20 $ALLOW_CPU 2>&1 | tee "$OUT/outside.txt"

step done
ls -la "$OUT"
tar -czf "$FINAL/gpu-check.tgz" -C "$FINAL" all
cp "$OUT"/roofline-*.json "$FINAL/" 2>/dev/null
cat "$OUT"/*.txt > "$FINAL/gpu-check.txt" 2>/dev/null
rm -rf "$OUT"
ls -la "$FINAL"
