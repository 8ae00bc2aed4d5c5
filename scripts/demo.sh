#!/usr/bin/env bash
# The demo: set-up, then a small GPT trained with ZeRO stage 2 on 2 processes (CPU/gloo or GPUs).
# Extra arguments go to the training script, e.g. `bash scripts/demo.sh --steps 50`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec zeroshard launch --nproc_per_node 2 examples/train_gpt.py --config examples/configs/stage2.json "$@"
