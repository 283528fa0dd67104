#!/usr/bin/env bash
# One workload through three OpenAI-compatible servers serving the same weights, one at a time:
# vLLM's CPU build, llama.cpp's llama-server and `minillm serve`. Not run by CI.
#
# Per engine: start it, wait for /v1/models, (FIXTURES=DIR: record one raw SSE stream and /metrics
# before and after a short run), warm up, measure the service rate with a closed loop, then the open
# loop (Poisson arrivals at FRACTION × that rate), with /metrics scraped before and after; stop it.
# Results: $OUT/<engine>/{closed,open}.json (bench-serve --save-result; each holds the server's own
# /metrics view), the bench-serve tables, the raw scrapes, the server log, versions.json; then
# $OUT/table.md (scripts/engines/three_engines_table.py).
#
# Needs: scripts/engines/setup_vllm_cpu.sh, scripts/engines/build_llama_server.sh and
# scripts/engines/save_cpu_small_checkpoint.py --gguf (the HF checkpoint and the GGUF).
#   bash scripts/engines/three_engines.sh                      # all three, in turn
#   ONLY="llamacpp minillm" N=60 bash scripts/engines/three_engines.sh
set -uo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
ENGINES=${ENGINES:-/work/engines}
PY=${PY:-$REPO/.venv/bin/python}
OUT=${OUT:-$REPO/runs/three-engines/$(date -u +%Y%m%dT%H%M%SZ)}
ONLY=${ONLY:-"vllm llamacpp minillm"}
N=${N:-60}                 # open-loop requests (enough for a p99 of TTFT and TPOT)
IN=${IN:-128}              # lognormal median prompt tokens
OUTLEN=${OUTLEN:-32}       # lognormal median output tokens (max_tokens; EOS ignored)
SIGMA=${SIGMA:-0.5}
CLOSED_C=${CLOSED_C:-8}    # closed loop: requests in flight
CLOSED_N=${CLOSED_N:-32}   # closed loop: requests
FRACTION=${FRACTION:-0.7}
SEED=${SEED:-0}
WARM=${WARM:-4}
START_TIMEOUT=${START_TIMEOUT:-900}
FIXTURES=${FIXTURES:-}     # e.g. tests/fixtures/engines: writes <dir>/<engine>/ for vllm and llamacpp
MODEL_HF=${MODEL_HF:-$ENGINES/models/cpu-small-hf}
MODEL_GGUF=${MODEL_GGUF:-$ENGINES/models/cpu-small-f32.gguf}
LLAMA_SERVER=${LLAMA_SERVER:-$ENGINES/llama.cpp/build/bin/llama-server}
THREADS=${THREADS:-1}      # compute threads per engine: vLLM CPU binds 1 of 2 cores, minillm uses cores − 1
mkdir -p "$OUT"
echo "results: $OUT"

port_of() { case $1 in vllm) echo 8101;; llamacpp) echo 8102;; minillm) echo 8103;; esac; }

start_engine() {   # $1 engine, $2 log; prints the process group id
  local e=$1 log=$2 p; p=$(port_of "$e")
  case $e in
    vllm) VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2} setsid "$ENGINES/vllm-venv/bin/python" \
            -m vllm.entrypoints.openai.api_server --model "$MODEL_HF" --served-model-name cpu-small \
            --dtype float32 --max-model-len 1024 --host 127.0.0.1 --port "$p" >"$log" 2>&1 & ;;
    llamacpp) setsid "$LLAMA_SERVER" -m "$MODEL_GGUF" --alias cpu-small --host 127.0.0.1 --port "$p" \
            --metrics -t "$THREADS" -tb "$THREADS" -np 8 -c 8192 >"$log" 2>&1 & ;;
    minillm) setsid "$PY" -m minillm serve --model cpu-small --host 127.0.0.1 --port "$p" \
            --torch-threads "$THREADS" >"$log" 2>&1 & ;;
  esac
  echo $!
}

stop_engine() {    # $1 pid (= its process group: started with setsid)
  kill -TERM -- "-$1" 2>/dev/null
  for _ in $(seq 60); do kill -0 "$1" 2>/dev/null || return 0; sleep 1; done
  kill -KILL -- "-$1" 2>/dev/null; sleep 2
}

wait_ready() {     # $1 url, $2 pid
  local t0=$SECONDS
  until curl -sf "$1/v1/models" >/dev/null 2>&1; do
    kill -0 "$2" 2>/dev/null || { echo "server exited"; return 1; }
    (( SECONDS - t0 > START_TIMEOUT )) && { echo "not ready in $START_TIMEOUT s"; return 1; }
    sleep 2
  done
  echo $(( SECONDS - t0 ))
}

bench() {          # $1 url, rest: extra bench-serve flags
  local url=$1; shift
  "$PY" -m minillm bench-serve --base-url "$url" --endpoint /v1/completions --model cpu-small \
    --dataset-name lognormal --random-input-len "$IN" --random-output-len "$OUTLEN" \
    --lognormal-sigma "$SIGMA" --tokenizer default --ignore-eos --seed "$SEED" \
    --metric-percentiles 50,90,99 --disable-tqdm "$@"
}

capture_fixtures() {  # $1 engine, $2 url: on a fresh server
  local d="$REPO/$FIXTURES/$1"; mkdir -p "$d"
  curl -s "$2/metrics" -o "$d/metrics_before.txt"
  # one streamed completion, the bytes as received (curl -N: no buffering), headers apart
  curl -sN -D "$d/stream_headers.txt" -o "$d/completions_stream.sse" "$2/v1/completions" \
    -H 'Content-Type: application/json' \
    -d '{"model":"cpu-small","prompt":"The lifecycle of an inference request","max_tokens":16,"temperature":0,"stream":true,"stream_options":{"include_usage":true},"ignore_eos":true}'
  # a short run: 8 requests, 4 in flight (the SSE request above is in the after scrape too)
  bench "$2" --num-prompts 8 --max-concurrency 4 --seed 1 > "$d/short_run.txt" 2>&1
  curl -s "$2/metrics" -o "$d/metrics_after.txt"
}

for e in $ONLY; do
  d="$OUT/$e"; mkdir -p "$d"; url="http://127.0.0.1:$(port_of "$e")"
  echo "== $e: starting ($(date -u +%FT%TZ))"
  pid=$(start_engine "$e" "$d/server.log")
  if ! ready=$(wait_ready "$url" "$pid"); then
    echo "== $e: FAILED to start: $ready (log: $d/server.log)"; tail -30 "$d/server.log"
    stop_engine "$pid"; continue
  fi
  echo "== $e: ready after $ready s"
  curl -s "$url/v1/models" > "$d/models.json"
  case $e in
    vllm) v=$("$ENGINES/vllm-venv/bin/python" -c 'import vllm,torch;print(f"vllm-cpu {vllm.__version__}, torch {torch.__version__}")');;
    llamacpp) v="llama.cpp $("$LLAMA_SERVER" --version 2>&1 | grep -i version | head -1), vendored in llama-cpp-python ${LLAMA_CPP_PYTHON:-0.3.36}";;
    minillm) v=$("$PY" -c 'import importlib.metadata as m, torch; print("minillm", m.version("minillm") + ", torch", torch.__version__)');;
  esac
  printf '{"engine": "%s", "version": "%s", "startup_s": %s, "threads": %s, "date": "%s", "cpu": "%s"}\n' \
    "$e" "$v" "$ready" "$THREADS" "$(date -u +%FT%TZ)" "$(lscpu | sed -n 's/^Model name: *//p')" > "$d/versions.json"
  if [ -n "$FIXTURES" ] && [ "$e" != minillm ]; then capture_fixtures "$e" "$url"; fi
  bench "$url" --num-prompts "$WARM" --max-concurrency 2 --seed 2 > "$d/warmup.txt" 2>&1
  bench "$url" --request-rate inf --max-concurrency "$CLOSED_C" --num-prompts "$CLOSED_N" --seed 3 \
    --save-result --result-dir "$d" --result-filename closed.json > "$d/closed.txt" 2>&1
  mu=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['summary']['requests_s'])" "$d/closed.json")
  rate=$("$PY" -c "print(round($FRACTION * $mu, 4))")
  echo "== $e: service rate $mu req/s (closed loop, $CLOSED_C in flight); open loop at $rate req/s"
  curl -s "$url/metrics" -o "$d/metrics_before.txt"
  cat /proc/loadavg > "$d/loadavg_before.txt"     # others' work on the same cores shows here
  bench "$url" --request-rate "$rate" --burstiness 1 --num-prompts "$N" \
    --save-result --result-dir "$d" --result-filename open.json > "$d/open.txt" 2>&1
  curl -s "$url/metrics" -o "$d/metrics_after.txt"
  cat /proc/loadavg > "$d/loadavg_after.txt"
  tail -45 "$d/open.txt"
  stop_engine "$pid"
  echo "== $e: stopped"
done
"$PY" "$REPO/scripts/engines/three_engines_table.py" "$OUT" | tee "$OUT/table.md"
