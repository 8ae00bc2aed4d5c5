#!/usr/bin/env bash
# The prepared GPU check of the offload session (about 8 minutes of command time): CUDA parity of
# offload and of ZeRO-3 (after its memory changes), the offload demo (tokens/s, peak device and
# host memory), then ZeRO-3 against FSDP2 at 1.2B (peak device memory, step time).
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; free -g | head -2; df -h /tmp | tail -1
echo "== CUDA tests: offload, and parity at every stage"
timeout 150 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_offload_cuda.py "tests/gpu/test_cuda.py::test_cuda_parity" 2>&1 \
    | grep -E "^cuda |passed|failed|Error|assert" | tail -40 | tee "$OUT_DIR/gpu_offload_tests.log"
echo "== offload demo: 2.5B GPT, bf16, ZeRO-3, one H200"
timeout 190 python benchmarks/gpu_offload.py --layers 32 --d-model 2560 --configs none,cpu,cpu+params --steps 3 \
    --timeout 62 2>&1 | tee "$OUT_DIR/gpu_offload_demo.md"
echo "== NVMe offload: 1.2B GPT"
timeout 100 python benchmarks/gpu_offload.py --layers 24 --d-model 2048 --configs nvme+params --steps 2 \
    --sub-group 1e8 --timeout 95 2>&1 | tail -3 | tee -a "$OUT_DIR/gpu_offload_demo.md"
echo "== ZeRO-3 vs FSDP2, 1.2B bf16"
timeout --kill-after=5 90 python benchmarks/run.py --device cuda --world-size 1 --sizes 1b \
    --systems zeroshard,fsdp2 --stages 3 --no-paired --timeout 60 --deadline 90 \
    --out "$OUT_DIR" --logs "$OUT_DIR/logs" 2>&1 | tail -6
[ -f "$OUT_DIR/RESULTS-cuda.md" ] && sed -n '/^| stage/,/^$/p' "$OUT_DIR/RESULTS-cuda.md" | head -12
