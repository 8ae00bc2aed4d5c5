#!/usr/bin/env bash
# Third prepared GPU check of the offload session (about 3 minutes): the CPU-offload step after the
# host-side gradient norm moved to BLAS dots, and where ZeRO-3's device bytes go at 1.2B.
source "$(dirname "$0")/gpu_env.sh"
echo "== CUDA offload tests"
timeout 60 python -m pytest -q -p no:cacheprovider tests/gpu/test_offload_cuda.py 2>&1 | tail -2
echo "== CPU offload: 2.5B GPT, bf16, ZeRO-3, one H200"
timeout 100 python benchmarks/gpu_offload.py --layers 32 --d-model 2560 --configs cpu --steps 3 \
    --timeout 95 --profile 2>&1 | grep -v Warning | cut -c1-160 | tail -16 | tee "$OUT_DIR/gpu_offload_demo3.md"
echo "== where stage 3's device bytes go (1b, bf16)"
timeout 70 python benchmarks/memory_timeline.py --device cuda --dtype bf16 --system zeroshard --stage 3 --size 1b \
    --world-size 1 --micro-batch 8 --seq-len 1024 --out "$OUT_DIR/memory_timeline_cuda_s3.md" 2>&1 | tail -30
