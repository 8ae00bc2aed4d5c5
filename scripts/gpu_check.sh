#!/usr/bin/env bash
# The CUDA/NCCL check on one GPU machine: the GPU test module (every stage and precision against
# plain PyTorch on the GPU, a Hugging Face model under zero.Init), then a short benchmark of
# zeroshard stages 0-3 against DeepSpeed, DDP and FSDP2 (bf16, 1.2B-parameter GPT). Writes logs to
# $OUT (or benchmarks/results). Packages missing there (pydantic, DeepSpeed and its dependencies)
# are taken from .whl/ when present (the device machine has no network). To fill .whl/ (Python 3.12
# there), on a machine with network:
#   pip download --no-deps --no-binary :all: deepspeed==0.19.8 -d /tmp/ds
#   DS_BUILD_OPS=0 pip wheel --no-deps --no-build-isolation /tmp/ds/deepspeed-0.19.8.tar.gz -w .whl
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
#     -d .whl pydantic pydantic_core annotated_types typing_inspection hjson msgpack py-cpuinfo ninja \
#     einops psutil tqdm packaging numpy
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-benchmarks/results}"
mkdir -p "$OUT_DIR"
if compgen -G ".whl/*.whl" >/dev/null; then
  # Only what this machine lacks (its own numpy, psutil, ... stay in charge).
  missing=()
  for whl in .whl/*.whl; do
    name=$(basename "$whl" | cut -d- -f1)
    mod=$(case "$name" in py_cpuinfo) echo cpuinfo;; *) echo "$name";; esac)
    python3 -c "import $mod" 2>/dev/null || missing+=("$whl")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    echo "installing from .whl: ${missing[*]}"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${missing[@]}" || exit 1
  fi
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
  export DS_BUILD_OPS=0 DS_SKIP_CUDA_CHECK=1 DS_ACCELERATOR=cuda
fi
export PYTHONPATH="$PWD/src:$PWD:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
timeout 180 python3 -m pytest -q -p no:cacheprovider -s tests/gpu 2>&1 | tee "$OUT_DIR/gpu_tests.log"
tests=${PIPESTATUS[0]}
timeout 380 python3 benchmarks/run.py --device cuda --world-size 1 --sizes "${GPU_SIZES:-1b}" \
  --systems zeroshard,deepspeed,ddp,fsdp2 --stages 0,1,2,3 --timeout 80 --deadline "${GPU_DEADLINE:-280}" \
  --out "$OUT_DIR" --logs /tmp/gpu-logs 2>&1 | tail -40
[ -f "$OUT_DIR/RESULTS-cuda.md" ] && cat "$OUT_DIR/RESULTS-cuda.md"
exit "$tests"
