#!/usr/bin/env bash
# The prepared run for one GPU machine: the CUDA tests and the GPU benchmarks, in sections.
#
#   bash benchmarks/gpu.sh                       # tests, then bench: about 9 minutes at most
#   bash benchmarks/gpu.sh bench                 # the comparison alone: under 8 minutes
#   bash benchmarks/gpu.sh offload timeline      # any sections, run in the order given ("all": every one)
#
# Sections:
#   tests     the CUDA tests (tests/gpu: every stage and precision against plain PyTorch on NCCL, offload
#             parity, zero.Init, a Hugging Face model, monitors); full log in $LOG_DIR/gpu_tests.log.
#             At most 3 minutes.
#   bench     benchmarks/run.py --device cuda: zeroshard stages 0-3 (and 2+offload, 3+offload), DeepSpeed 0-3,
#             DDP, ZeroRedundancyOptimizer and FSDP2 on a 1.2B-parameter GPT, bf16, one rank per GPU with
#             NCCL, 8 x 1024 tokens per rank per step: step time, tokens/s, MFU (6·N·tokens/s ÷ 989 TFLOP/s,
#             the dense bf16 peak of an H100/H200 SXM), model-state bytes against the ZeRO formula, peak
#             device memory -> RESULTS-cuda.md, cuda.json, chart-cuda.png. Each job has a hard 100 s limit,
#             no job starts after GPU_DEADLINE, the section is killed 70 s after it.
#   offload   benchmarks/studies/gpu_offload.py: a 2.5B GPT (bf16, ZeRO-3) in memory, with the optimizer
#             on the CPU, and with the parameters too; a 1.2B GPT with both on NVMe: tokens/s, peak device
#             and host memory, and (GPU_PROFILE=1) the top CPU operators of a step -> gpu_offload.md.
#             At most 6 minutes.
#   timeline  where ZeRO-3's device memory goes in a step of the 1.2B GPT
#             (benchmarks/studies/memory_timeline.py) -> memory_timeline-cuda.md. At most 2 minutes.
#   activations  a step's activation memory with and without checkpointing, and with cpu_checkpointing
#             (benchmarks/studies/activation_memory.py, 8 blocks of width 1024, 8 x 1024 tokens, fp32)
#             -> activation_memory-cuda.md. At most 2 minutes.
#   offload_states  device memory before and after engine.offload_states(include=[name]) and reload_states(),
#             per state name and for all of them, at ZeRO stages 1-3 (benchmarks/studies/offload_states_memory.py,
#             134M parameters, bf16): the drop should equal the bytes moved -> offload_states-cuda.md. At most 2 minutes.
#
# Results go to $OUT if set (the device tool's folder), else benchmarks/results/; logs to $OUT/logs, else
# benchmarks/out/gpu/. Settings, from the environment (default):
#   GPU_WORLD (1)          ranks per job, at most the GPUs present
#   GPU_SIZES (1b)         bench: model sizes (benchmarks/harness/spec.py)
#   GPU_SYSTEMS (all)      bench: systems, e.g. zeroshard,fsdp2
#   GPU_STAGES (0,1,2,3)   bench: ZeRO stages
#   GPU_OFFLOAD (1)        bench: also the 2+offload and 3+offload variants (0: not)
#   GPU_DEADLINE           bench: no job starts after it, seconds (390 alone, 280 after tests)
#   GPU_TESTS (tests/gpu)  tests: what pytest runs, e.g. tests/gpu/test_offload_cuda.py
#   GPU_PROFILE (0)        offload: 1 prints the last step's top CPU operators of each configuration
#
# The device machine has no network: wheels in .whl/ (git-ignored) are installed into /tmp/site for what
# it lacks (pydantic, safetensors, tqdm; DeepSpeed and its dependencies for the peers). To fill .whl/
# (Python 3.12 there), on a machine with network:
#   pip download --no-deps --no-binary :all: deepspeed==0.19.8 -d /tmp/ds
#   DS_BUILD_OPS=0 pip wheel --no-deps --no-build-isolation /tmp/ds/deepspeed-0.19.8.tar.gz -w .whl
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
#     -d .whl pydantic pydantic_core annotated_types typing_inspection hjson msgpack py-cpuinfo ninja \
#     einops psutil tqdm packaging numpy safetensors
#
# Exit status: 2 when the GPU, torch or zeroshard is unusable (said loudly, before anything runs); 1 when a
# section failed (a test, a zeroshard job, a study that did not finish); a peer that fails is recorded in
# the results with its reason and is not an error.
set -uo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$SELF")/.."

usage() { sed -n '2,/^set -uo pipefail$/p' "$SELF" | sed '$d; s/^# \{0,1\}//'; }
fail() { echo "gpu.sh: FAILED: $*" >&2; exit 2; }

sections=("$@")
[ "${#sections[@]}" -gt 0 ] || sections=(tests bench)
[ "${sections[*]}" = all ] && sections=(tests bench offload timeline activations offload_states)
for s in "${sections[@]}"; do
    case "$s" in
        tests | bench | offload | timeline | activations | offload_states) ;;
        -h | --help) usage; exit 0 ;;
        *) echo "gpu.sh: unknown section '$s' (tests, bench, offload, timeline, activations, offload_states, all)" >&2
           exit 2 ;;
    esac
done

OUT_DIR="${OUT:-benchmarks/results}"
LOG_DIR="${OUT:+$OUT/logs}"
LOG_DIR="${LOG_DIR:-benchmarks/out/gpu}"
mkdir -p "$OUT_DIR" "$LOG_DIR"
PY="${PYTHON:-python3}"
WORLD="${GPU_WORLD:-1}"

# What the device lacks, from .whl/ (its own numpy, psutil, ... stay in charge).
if compgen -G ".whl/*.whl" >/dev/null; then
    missing=()
    for whl in .whl/*.whl; do
        name=$(basename "$whl" | cut -d- -f1)
        mod=$(case "$name" in py_cpuinfo) echo cpuinfo ;; *) echo "$name" ;; esac)
        "$PY" -c "import $mod" 2>/dev/null || missing+=("$whl")
    done
    if [ "${#missing[@]}" -gt 0 ]; then
        echo "gpu.sh: installing from .whl: ${missing[*]}"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "${missing[@]}" || fail "installing the wheels of .whl/"
    fi
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    export DS_BUILD_OPS=0 DS_SKIP_CUDA_CHECK=1 DS_ACCELERATOR=cuda
fi
# zeroshard from this checkout even where it is not pip-installed (the repository root for `benchmarks`).
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"

command -v nvidia-smi >/dev/null 2>&1 || fail "nvidia-smi not found: this is not a GPU machine"
timeout 60 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
    || fail "nvidia-smi does not answer"
GPUS=$(timeout 120 "$PY" -c '
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} cannot see a GPU (CUDA build: {torch.version.cuda})")
print(torch.cuda.device_count())
') || fail "torch cannot use the GPU"
[ "$WORLD" -le "$GPUS" ] || fail "GPU_WORLD=$WORLD but only $GPUS GPU(s)"
"$PY" -c 'import pydantic' 2>/dev/null || fail "pydantic (a zeroshard dependency) is not installed"
"$PY" -c 'import zeroshard' 2>/dev/null || fail "zeroshard is not importable from $PWD/src"
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
                              "nccl", torch.cuda.nccl.version(), "threads", torch.get_num_threads())'
echo "cpus $(nproc); $(free -g | awk '/^Mem:/ {print "memory " $2 " GiB"}'); /tmp: $(df -h /tmp | awk 'NR == 2 {print $4 " free"}')"
GIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
echo "gpu.sh: $GPUS GPU(s), world size $WORLD, sections ${sections[*]}, results in $OUT_DIR, logs in $LOG_DIR"

failed=()
ran=" "

header() {  # a results file's heading: title, command, date, commit, GPU
    printf '# %s\n\n- Command: `bash benchmarks/gpu.sh %s`\n- Date: %s, git %s\n- GPU: %s\n\n' "$1" "$2" \
        "$(date -u '+%Y-%m-%d %H:%M UTC')" "$GIT" \
        "$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1)"
}

run_tests() {
    echo "== tests: ${GPU_TESTS:-tests/gpu}"
    # shellcheck disable=SC2086  # GPU_TESTS may name several paths
    timeout --kill-after=10 180 "$PY" -m pytest -q -s -p no:cacheprovider ${GPU_TESTS:-tests/gpu} 2>&1 \
        | tee "$LOG_DIR/gpu_tests.log" | grep -E "^cuda |passed|failed|error|Error" | tail -40
    local status=${PIPESTATUS[0]}
    [ "$status" -eq 0 ] || failed+=("tests (pytest exited $status; log: $LOG_DIR/gpu_tests.log)")
}

run_bench() {
    local deadline="${GPU_DEADLINE:-390}" status=0 offload=(--offload)
    [[ "$ran" == *" tests "* ]] && deadline="${GPU_DEADLINE:-280}"
    [ "${GPU_OFFLOAD:-1}" = 1 ] || offload=()
    echo "== bench: sizes ${GPU_SIZES:-1b}, systems ${GPU_SYSTEMS:-all}, stages ${GPU_STAGES:-0,1,2,3}, deadline ${deadline} s"
    "$PY" -c 'import deepspeed' >/dev/null 2>&1 \
        || echo "gpu.sh: DeepSpeed is not installed here; its rows will say 'missing'" >&2
    local systems=()
    [ -n "${GPU_SYSTEMS:-}" ] && systems=(--systems "$GPU_SYSTEMS")
    timeout --kill-after=10 $((deadline + 70)) "$PY" benchmarks/run.py --device cuda --world-size "$WORLD" \
        --sizes "${GPU_SIZES:-1b}" ${systems[@]+"${systems[@]}"} --stages "${GPU_STAGES:-0,1,2,3}" \
        --dtype bf16 ${offload[@]+"${offload[@]}"} --no-paired --timeout 100 --deadline "$deadline" \
        --out "$OUT_DIR" --logs "$LOG_DIR/bench" || status=$?
    [ -f "$OUT_DIR/RESULTS-cuda.md" ] && cat "$OUT_DIR/RESULTS-cuda.md"
    if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
        failed+=("bench (killed at the $((deadline + 70)) s limit; per-job results so far: $OUT_DIR/cuda.partial.json)")
    elif [ "$status" -ne 0 ]; then
        failed+=("bench (run.py exited $status: a zeroshard job failed, see the FAILED lines above)")
    fi
}

run_offload() {
    local raw="$LOG_DIR/gpu_offload.log" profile=()
    [ "${GPU_PROFILE:-0}" = 1 ] && profile=(--profile)
    echo "== offload: 2.5B GPT, bf16, ZeRO-3, in memory / CPU / CPU with parameters; 1.2B with both on NVMe"
    timeout --kill-after=10 260 "$PY" benchmarks/studies/gpu_offload.py --layers 32 --d-model 2560 \
        --configs none,cpu,cpu+params --steps 3 --timeout 80 ${profile[@]+"${profile[@]}"} >"$raw" 2>&1
    timeout --kill-after=10 120 "$PY" benchmarks/studies/gpu_offload.py --layers 24 --d-model 2048 \
        --configs nvme+params --steps 3 --sub-group 1e8 --timeout 105 ${profile[@]+"${profile[@]}"} >>"$raw" 2>&1
    {
        header "Offload on one GPU: tokens/s, peak device and host memory" offload
        echo "2.52B parameters: 32 layers, d_model 2560; 1.21B (nvme+params): 24 layers, d_model 2048. bf16, ZeRO-3,"
        echo "1 rank, 4 x 1024 tokens per step, AdamW, clipping 1.0, sub_group_size 1e8; each configuration in its"
        echo "own process, 3 steps, step time the median of those after the first. Full output: gpu_offload.log."
        echo
        grep -E '^(\| |<!--)' "$raw" | awk '!(/^\| (config|---) / && seen[$0]++)'
    } >"$OUT_DIR/gpu_offload.md"
    grep -v '^<!--' "$OUT_DIR/gpu_offload.md"
    [ -n "${profile[*]:-}" ] && grep -E "Self CPU time total|^ +aten::|Optimizer" "$raw" | head -40
    if grep -qE '^\| [^|]+ \| (timed out|failed)' "$raw" || ! grep -q '^| nvme+params | [0-9]' "$raw"; then
        failed+=("offload (a configuration did not finish; log: $raw)")
    fi
}

run_timeline() {
    local raw="$LOG_DIR/memory_timeline-cuda.raw.md"
    echo "== timeline: where ZeRO-3's device memory goes (1.2B, bf16)"
    rm -f "$raw"
    timeout --kill-after=10 110 "$PY" benchmarks/studies/memory_timeline.py --device cuda --dtype bf16 \
        --system zeroshard --stage 3 --size 1b --world-size "$WORLD" --micro-batch 8 --seq-len 1024 \
        --out "$raw" >"$LOG_DIR/memory_timeline-cuda.log" 2>&1
    tail -30 "$LOG_DIR/memory_timeline-cuda.log"
    if [ -s "$raw" ]; then
        { header "Where ZeRO-3's device memory goes: GPT 1.2B, bf16" timeline; sed 's/^## /### /' "$raw"; } \
            >"$OUT_DIR/memory_timeline-cuda.md"
    else
        failed+=("timeline (no table written; log: $LOG_DIR/memory_timeline-cuda.log)")
    fi
}

run_activations() {
    local made=benchmarks/results/activation_memory-cuda.md  # where the study writes it
    echo "== activations: 8 blocks x 1024, 8 x 1024 tokens, fp32, with and without checkpointing"
    local before
    before=$(stat -c %Y "$made" 2>/dev/null || echo 0)
    timeout --kill-after=10 110 "$PY" benchmarks/studies/activation_memory.py --device cuda --layers 8 \
        --dim 1024 --seq 1024 --batch 8 --world 1 >"$LOG_DIR/activation_memory-cuda.log" 2>&1
    tail -8 "$LOG_DIR/activation_memory-cuda.log"
    if [ "$(stat -c %Y "$made" 2>/dev/null || echo 0)" -gt "$before" ]; then
        [ "$made" -ef "$OUT_DIR/activation_memory-cuda.md" ] || cp "$made" "$OUT_DIR/"
    else
        failed+=("activations (no table written; log: $LOG_DIR/activation_memory-cuda.log)")
    fi
}

run_offload_states() {
    local raw="$LOG_DIR/offload_states-cuda.log" status=0
    echo "== offload_states: device memory before and after offload_states()/reload_states(), per state, stages 1-3"
    timeout --kill-after=10 110 "$PY" benchmarks/studies/offload_states_memory.py >"$raw" 2>&1 || status=$?
    { header "Device memory of engine.offload_states() / reload_states(), per state" offload_states
      grep -E '^(\| |[0-9]+M parameters)' "$raw"; } >"$OUT_DIR/offload_states-cuda.md"
    grep -E '^(\| |[0-9]+M parameters)' "$raw"
    [ "$status" -eq 0 ] || failed+=("offload_states (exited $status; log: $raw)")
}

for s in "${sections[@]}"; do
    "run_$s"
    ran+="$s "
done

if [ "${#failed[@]}" -gt 0 ]; then
    printf 'gpu.sh: FAILED: %s\n' "${failed[@]}" >&2
    exit 1
fi
echo "gpu.sh: done (${sections[*]}); results in $OUT_DIR"
