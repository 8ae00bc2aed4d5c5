#!/usr/bin/env bash
# The test suite: set-up (with test extras and DeepSpeed as the reference peer), lint, type check, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh "test,deepspeed"
ruff check src tests examples benchmarks
mypy
python3 -m pytest -q -p no:cacheprovider tests "$@"
