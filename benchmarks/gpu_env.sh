# Sourced by the GPU session scripts: repository root, output folder, import path, and the wheels in
# .whl/ (git-ignored; pydantic, safetensors, tqdm for the device's Python) when the device lacks them.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT_DIR="${OUT:-benchmarks/results}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c 'import pydantic, safetensors, tqdm' 2>/dev/null || \
    python -m pip install -q --no-index --no-deps --break-system-packages .whl/*.whl 2>&1 | tail -2
