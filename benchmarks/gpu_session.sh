#!/usr/bin/env bash
# One prepared GPU check for a session lent the device (about 7 minutes of command time at most):
# the CUDA tests (parity at stages 0-3 in fp32/bf16/fp16 on NCCL, ZeRO-3 zero.Init, monitors),
# then the 1.2B-parameter bf16 benchmark of zeroshard stages 0-3 against DDP and FSDP2
# (step time, tokens/s, MFU, model-state bytes against the ZeRO formula, peak device memory).
#
#   bash benchmarks/gpu_session.sh      # results under $OUT (the device tool's folder) or benchmarks/results
#
# Wheels in .whl/ (git-ignored; pydantic, safetensors, tqdm for the device's Python) are installed
# when the device lacks them.
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
echo "== benchmark"
timeout --kill-after=10 250 python benchmarks/run.py --device cuda --world-size 1 --sizes 1b \
    --systems zeroshard,ddp,fsdp2 --stages 0,1,2,3 --no-paired --timeout 90 --deadline 160 \
    --out "$OUT_DIR" --logs "$OUT_DIR/logs" 2>&1 | tail -15 | tee "$OUT_DIR/bench.log"
[ -f "$OUT_DIR/RESULTS-cuda.md" ] && sed -n '/^| stage/,/^$/p' "$OUT_DIR/RESULTS-cuda.md"
echo "== CUDA tests"
timeout 110 python -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tail -25 | tee "$OUT_DIR/gpu_tests.log"
echo "== where stage 3's device bytes go (1b, bf16)"
timeout 60 python benchmarks/memory_timeline.py --device cuda --dtype bf16 --system zeroshard --stage 3 --size 1b \
    --world-size 1 --micro-batch 8 --seq-len 1024 --out "$OUT_DIR/memory_timeline_cuda_s3.md" 2>&1 | tail -30
