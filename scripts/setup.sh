#!/usr/bin/env bash
# Installs zeroshard and what it needs on a fresh machine: torch==2.13.0 first, from pip's configured
# index (a bare `torch` requirement would pull the newest multi-GB CUDA build; for the CPU build where
# the index is PyPI alone, set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu).
# Extras: pass e.g. "test,deepspeed".
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
# pip's warning about running as root (CI and containers do) is noise before the demo's first line
export PIP_ROOT_USER_ACTION="${PIP_ROOT_USER_ACTION:-ignore}"
python3 -m pip install -q --disable-pip-version-check "torch==2.13.0"
if [ -n "$extras" ]; then
  python3 -m pip install -q --disable-pip-version-check -e ".[${extras}]"
else
  python3 -m pip install -q --disable-pip-version-check -e .
fi
