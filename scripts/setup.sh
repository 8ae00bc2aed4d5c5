#!/usr/bin/env bash
# Installs zeroshard and what it needs on a fresh machine (CPU build of torch first: a bare
# `torch` requirement would pull a multi-GB CUDA build). Extras: pass e.g. "test,deepspeed".
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python3 -m pip install -q --disable-pip-version-check "torch==2.13.0"
if [ -n "$extras" ]; then
  python3 -m pip install -q --disable-pip-version-check -e ".[${extras}]"
else
  python3 -m pip install -q --disable-pip-version-check -e .
fi
