#!/usr/bin/env bash
# The benchmark on one GPU machine, in one command, in under 8 minutes:
#
#   bash benchmarks/gpu.sh            # results in $OUT if set, else benchmarks/results/
#
# Same comparison as on CPU (zeroshard stages 0-3 and offload variants, DeepSpeed 0-3, DDP, ZeRO-R,
# FSDP2) on a 1.2B-parameter GPT, bf16, one rank per GPU with NCCL (world size = GPUs, default 1),
# 8 x 1024 tokens per rank per step. Reports step time, tokens/s, MFU (6·N·tokens/s ÷ 989 TFLOP/s,
# the dense bf16 peak of an H100/H200 SXM) and peak device memory. Each job has a hard 100 s limit,
# no job starts after 390 s, and the whole script is killed at 460 s; it exits non-zero (loudly)
# when the GPU or zeroshard is unusable or a zeroshard job failed (a peer that fails is recorded with
# its reason). Worker logs land in $OUT_DIR/logs. Override with GPU_SIZES, GPU_WORLD, GPU_DEADLINE.
set -euo pipefail
cd "$(dirname "$0")/.."

# zeroshard from this checkout even where it is not pip-installed (the repository root for `benchmarks`).
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT_DIR="${OUT:-benchmarks/results}"
SIZES="${GPU_SIZES:-1b}"
DEADLINE="${GPU_DEADLINE:-390}"
mkdir -p "$OUT_DIR"

fail() { echo "gpu.sh: FAILED: $*" >&2; exit 2; }

command -v nvidia-smi >/dev/null 2>&1 || fail "nvidia-smi not found: this is not a GPU machine"
timeout 60 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
    || fail "nvidia-smi does not answer"
GPUS=$(timeout 120 python -c '
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} cannot see a GPU (CUDA build: {torch.version.cuda})")
print(torch.cuda.device_count())
') || fail "torch cannot use the GPU"
WORLD="${GPU_WORLD:-1}"
[ "$WORLD" -le "$GPUS" ] || fail "GPU_WORLD=$WORLD but only $GPUS GPU(s)"
python -c 'import pydantic' 2>/dev/null || fail "pydantic (a zeroshard dependency) is not installed"
python -c 'import zeroshard' 2>/dev/null || fail "zeroshard is not importable from $PWD/src"
python -c 'import deepspeed' >/dev/null 2>&1 \
    || echo "gpu.sh: DeepSpeed is not installed here; its rows will say 'missing'" >&2

echo "gpu.sh: $GPUS GPU(s), world size $WORLD, sizes $SIZES, results in $OUT_DIR"
status=0
timeout --kill-after=10 460 python benchmarks/run.py --device cuda --world-size "$WORLD" --sizes "$SIZES" \
    --dtype bf16 --offload --no-paired --timeout 100 --deadline "$DEADLINE" --out "$OUT_DIR" \
    --logs "$OUT_DIR/logs" || status=$?
if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
    fail "killed at the 460 s limit; per-job results so far: $OUT_DIR/cuda.partial.json"
fi
[ -f "$OUT_DIR/RESULTS-cuda.md" ] && cat "$OUT_DIR/RESULTS-cuda.md"
[ "$status" -eq 0 ] || fail "run.py exited with $status (a job failed: see the FAILED lines above)"
