#!/usr/bin/env bash
# Everything GPU-specific in one go (the GPU issue), on one H200. The step timeouts sum to 775 s (a full run took 300 s on the H200);
# each step writes its results as it goes, and the bundle is rebuilt after every step, so a run
# cut short still returns what finished. Results go under $OUT when it is set (the device tool),
# else runs/gpu-check/. The device tool returns at most 8 files: the working files live outside
# $OUT, and $OUT only ever holds the bundle (gpu-check.tgz), the log (gpu-check.txt) and the
# roofline JSON.
#
#   bash scripts/gpu_check.sh            # then unpack into figures/reference/h200/
#
# 0. provenance: GPU name, driver, CUDA, clocks (nvidia-smi), torch/triton/transformers versions
# 1. doctor (torch build, NVML name/memory/spec bandwidth)
# 2. the llama-3.1-8b twin in bf16: decode sweep 1 → 256 with CUDA graphs, "ideal" and "served"
#    (measured read and copy bandwidth, bf16 matmul peak inside); then at context 64 up to batch 1024
# 3. batch-1 engine decode, CUDA graphs on and off (--enforce-eager), against transformers
# 4. 10.4: prefill sweep to 8192, decode beside it, the stall and the chunk trade-off
# 5. 10.5: engine decode eager vs graphs at batch 1, 8, 64 (tiny and the 8B twin), sampling at 8k and
#    128k, profile_steps on tiny at batch 1 eager vs graphs, step phases
# 6. profile_steps of $MODEL at batch 1, eager and graphs: the kernels of one decode step
# 7. batch-1 engine decode through torch.compile (Inductor/Triton, then graph capture), last: the
#    step most likely to take long (24 new tokens keep it to one K/V bucket, one compilation)
#
# Dry run on a CPU (checks the script's logic, not the GPU paths):
#   MODEL=tiny DTYPE=fp32 MAXB=8 LENGTHS=16,64,256 STALL=512 ALLOW_CPU=--allow-cpu bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
FINAL="${OUT:-runs/gpu-check}"
WORK="$(mktemp -d)"
OUT="$WORK/all"
mkdir -p "$OUT" "$FINAL"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # runs from the source tree: no install needed
PY="${PYTHON:-python3}"
MODEL="${MODEL:-llama-3.1-8b}"; DTYPE="${DTYPE:-bf16}"; MAXB="${MAXB:-256}"
LENGTHS="${LENGTHS:-16,64,256,1024,2048,4096,8192}"; STALL="${STALL:-4096}"; ALLOW_CPU="${ALLOW_CPU:-}"
SHORT_CTX="${SHORT_CTX:-64}"; SHORT_MAXB="${SHORT_MAXB:-1024}"
bundle() {   # everything so far, into the (at most 3) files that come back
    tar -czf "$FINAL/gpu-check.tgz" -C "$WORK" all
    cat "$OUT"/*.txt > "$FINAL/gpu-check.txt" 2>/dev/null
    cp "$OUT"/roofline-*.json "$FINAL/" 2>/dev/null
    return 0
}
step() { bundle; echo; echo "=== $* ($(date +%T))"; }
# ONLY="roofline bench ...": run just those steps (provenance, doctor, roofline, roofline-short, bench, bench-eager, prefill,
# outside, profile, compile); OUTSIDE_MODELS, OUTSIDE_ONLY and BENCH_HF=--no-transformers narrow them
want() { [[ -z "${ONLY:-}" || " $ONLY " == *" $1 "* ]]; }
OUTSIDE_MODELS="${OUTSIDE_MODELS:-tiny,$MODEL}"; OUTSIDE_ONLY="${OUTSIDE_ONLY:-graphs,sampling,profile,phases}"
BENCH_HF="${BENCH_HF:-}"

step provenance
if want provenance; then
{
    echo "command: bash scripts/gpu_check.sh (MODEL=$MODEL DTYPE=$DTYPE MAXB=$MAXB LENGTHS=$LENGTHS STALL=$STALL)"
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)  host: $(hostname)  kernel: $(uname -r)"
    echo "git: ${GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.limit,pstate --format=csv 2>&1
    nvidia-smi 2>&1 | head -20
    timeout 10 $PY -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version()); print('triton', triton.__version__, 'transformers', transformers.__version__); p = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None; print('device', p)" 2>&1
    which gcc g++ nvcc 2>&1
} 2>&1 | tee "$OUT/provenance.txt"
fi

step doctor
if want doctor; then
timeout 20 $PY -m minillm doctor 2>&1 | tee "$OUT/doctor.txt"
fi

step "roofline sweep: $MODEL $DTYPE, batches 1..$MAXB, CUDA graphs on, ideal + served"
if want roofline; then
timeout 150 $PY -m minillm roofline --model "$MODEL" --dtype "$DTYPE" --max-batch "$MAXB" --context 512 \
    --steps 8 --out "$OUT" --figures "$OUT" 2>&1 | tee "$OUT/roofline.txt"
fi

step "roofline sweep at a short context: $MODEL $DTYPE, context ${SHORT_CTX}, batches 1..${SHORT_MAXB}"
if want roofline-short; then
# At context 512 the first run found no knee up to batch 256: the K/V read grows with B as fast as
# the weights' share shrinks (KV-aware B* 1,157). With a short context the K/V read stays small,
# so the step should turn compute-bound near the no-KV B* (~190 on the H200): the knee itself.
mkdir -p "$OUT/short"
timeout 150 $PY -m minillm roofline --model "$MODEL" --dtype "$DTYPE" --max-batch "$SHORT_MAXB" \
    --context "$SHORT_CTX" --steps 8 --out "$OUT/short" --figures "$OUT/short" 2>&1 | tee "$OUT/roofline-short.txt"
fi

step "batch-1 engine decode: CUDA graphs, then --enforce-eager (and transformers once)"
if want bench; then
timeout 45 $PY -m minillm bench --model "$MODEL" --dtype "$DTYPE" --new-tokens 64 --repeats 2 \
    $BENCH_HF --json "$OUT/bench-graphs.json" 2>&1 | tee "$OUT/bench.txt"
fi
if want bench-eager; then
timeout 30 $PY -m minillm bench --model "$MODEL" --dtype "$DTYPE" --new-tokens 64 --repeats 2 \
    --no-transformers --enforce-eager --json "$OUT/bench-eager.json" 2>&1 | tee -a "$OUT/bench.txt"
fi

step "10.4 prefill vs decode, stall $STALL, chunk trade-off"
if want prefill; then
mkdir -p "$OUT/prefill-decode"
timeout 90 $PY -m minillm prefill-decode --model "$MODEL" --dtype "$DTYPE" --lengths "$LENGTHS" \
    --batches 1,8,64 --context 512 --repeats 2 --stall-long "$STALL" --n-short 8 --budgets 256,1024,4096 \
    --out "$OUT/prefill-decode" 2>&1 | tee "$OUT/prefill-decode.txt"
fi

step "10.5 eager vs graphs, sampling 8k/128k, profile tiny, step phases"
if want outside; then
mkdir -p "$OUT/outside"
timeout 100 $PY -m minillm outside-reference --out "$OUT/outside" --models "$OUTSIDE_MODELS" --only "$OUTSIDE_ONLY" \
    --batches 1,8,64 --context 512 --steps 20 $ALLOW_CPU 2>&1 | tee "$OUT/outside.txt"
fi

step "10.5 where the batch-1 step of $MODEL goes: profile_steps, eager and with graphs"
if want profile; then
mkdir -p "$OUT/profile-model"
timeout 60 $PY -m minillm outside-reference --out "$OUT/profile-model" --only profile \
    --profile-model "$MODEL" --profile-top 25 --context 512 $ALLOW_CPU 2>&1 | tee "$OUT/profile-model.txt"
fi

step "batch-1 engine decode through torch.compile (Inductor/Triton, then graph capture)"
if want compile; then
timeout 120 $PY -m minillm bench --model "$MODEL" --dtype "$DTYPE" --new-tokens 24 --repeats 2 \
    --no-transformers --compile --json "$OUT/bench-compiled.json" 2>&1 | tee -a "$OUT/bench.txt"
fi

step done
ls -la "$OUT"
bundle
rm -rf "$WORK"
ls -la "$FINAL"
