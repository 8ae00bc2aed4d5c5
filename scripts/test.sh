#!/usr/bin/env bash
# The test suite: set-up (with test extras, DeepSpeed as the reference peer and mkdocs), lint, type check,
# the documentation build (strict: a broken link or anchor between docs pages is an error), tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh "test,deepspeed,docs"
ruff check src tests examples benchmarks
mypy
lint-imports --no-cache
docs_site="$(mktemp -d)"
trap 'rm -rf "$docs_site"' EXIT
mkdocs build --strict --site-dir "$docs_site"
python3 -m pytest -q -p no:cacheprovider tests "$@"
