#!/usr/bin/env bash
# Second prepared GPU check of the offload session (about 5 minutes): the CUDA offload tests after
# page-locked masters and asynchronous publishing, then where a CPU-offload and an NVMe step's time
# goes (per-phase seconds and the top CPU operators of one step).
source "$(dirname "$0")/gpu_env.sh"
nproc; python -c 'import torch; print("threads", torch.get_num_threads())'
echo "== CUDA offload tests"
timeout 60 python -m pytest -q -s -p no:cacheprovider tests/gpu/test_offload_cuda.py 2>&1 \
    | grep -E "passed|failed|Error|assert" | tail -8 | tee "$OUT_DIR/gpu_offload_tests2.log"
echo "== CPU offload: 2.5B GPT, bf16, ZeRO-3, one H200"
timeout 170 python benchmarks/gpu_offload.py --layers 32 --d-model 2560 --configs cpu,cpu+params --steps 3 \
    --timeout 80 --profile 2>&1 | cut -c1-160 | tee "$OUT_DIR/gpu_offload_demo2.md"
echo "== NVMe offload: 1.2B GPT"
timeout 110 python benchmarks/gpu_offload.py --layers 24 --d-model 2048 --configs nvme+params --steps 3 \
    --sub-group 1e8 --timeout 105 --profile 2>&1 | cut -c1-160 | tail -24 | tee -a "$OUT_DIR/gpu_offload_demo2.md"
