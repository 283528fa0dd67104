#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (OpenAI-compatible HTTP server with Prometheus /metrics) and
# `llama-batched-bench` (aggregate decode tok/s of B sequences) from the
# llama.cpp source vendored inside the llama-cpp-python sdist on PyPI. CPU only, Release, no curl.
# Not run by CI. Takes several minutes on 2 cores.
#   ENGINES=/work/engines LLAMA_CPP_PYTHON=0.3.36 bash scripts/engines/build_llama_server.sh
# Result: $ENGINES/llama.cpp/build/bin/llama-server and llama-batched-bench
set -euo pipefail
ENGINES=${ENGINES:-/work/engines}
VER=${LLAMA_CPP_PYTHON:-0.3.36}
JOBS=${JOBS:-2}
mkdir -p "$ENGINES/llama.cpp-src"
SDIST="$ENGINES/llama.cpp-src/llama_cpp_python-$VER.tar.gz"
if [ ! -f "$SDIST" ]; then
  # any Python with pip will do; only the sdist is wanted, not a build of it
  [ -x "$ENGINES/dl-venv/bin/pip" ] || python3 -m venv "$ENGINES/dl-venv"
  "$ENGINES/dl-venv/bin/pip" download --no-binary llama-cpp-python --no-deps \
      "llama-cpp-python==$VER" -d "$ENGINES/llama.cpp-src"
fi
if [ ! -d "$ENGINES/llama.cpp/CMakeLists.txt" ] && [ ! -f "$ENGINES/llama.cpp/CMakeLists.txt" ]; then
  tar -xzf "$SDIST" -C "$ENGINES/llama.cpp-src"
  rm -rf "$ENGINES/llama.cpp"
  cp -r "$ENGINES/llama.cpp-src/llama_cpp_python-$VER/vendor/llama.cpp" "$ENGINES/llama.cpp"
fi
cd "$ENGINES/llama.cpp"
cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
# llama-batched-bench: the llama.cpp side of `python -m minillm bench --peers --batches`
cmake --build build --config Release -j "$JOBS" --target llama-server llama-batched-bench
./build/bin/llama-server --version || true
