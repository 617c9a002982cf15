#!/usr/bin/env bash
# GPU check in one command (~8 minutes at most on one NVIDIA GPU): prints markdown tables.
#
#   tools/gpu_check.sh            # on a CUDA machine, from anywhere
#   tools/gpu_check.sh --smoke    # CPU wiring check of this script (tiny shapes, interpreter, ~1-2 min)
#
# Steps, each under its own timeout (a failed or timed-out step is reported and the next one runs):
#   1. python tools/gpu_check.py --tests    kernel tests on the GPU, then the kernel /
#      fused lm-head table (bf16 [32768, 152064] logits; achieved TB/s and TFLOP/s vs the device)
#   2. tools/bench.py --markdown, the acceptance sizes (N=4096, V_local=32768, fp32, T=0.7), every
#      configuration, ours vs the naive upstream path (peak memory and time)
#   3. tools/bench.py --markdown, realistic bf16 sizes (N=32768, a 152064 vocab split over TP, H=4096),
#      configurations A (log-probs) and E (top-k KL + log-probs + entropy)
# TP=2 runs are added to the benchmarks when the machine has two or more GPUs (NCCL needs one per rank).
# Environment: PYTHON (default: the repo's .venv if present, else python3), LOG_DIR (default: $OUT if
# set, else /tmp/mcore_gpu_check): each step's full output is kept there as <step>.log.
# Exit status: 0 if every step passed, 1 if any failed or timed out, 2 if no CUDA device (without --smoke).

set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

SMOKE=0
case "${1:-}" in
    "") ;;
    --smoke) SMOKE=1 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "usage: $0 [--smoke]" >&2; exit 64 ;;
esac

if [[ -n "${PYTHON:-}" ]]; then
    PY="$PYTHON"
elif [[ -x "$REPO/.venv/bin/python" ]]; then
    PY="$REPO/.venv/bin/python"
else
    PY="python3"
fi
LOG_DIR="${LOG_DIR:-${OUT:-/tmp/mcore_gpu_check}}"
mkdir -p "$LOG_DIR"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
export PYTHONUNBUFFERED=1

TOTAL_BUDGET_S=480          # the whole script; each step also has its own cap below
START_S=$SECONDS
FAILED=()

# run_step NAME CAP_SECONDS CMD...: run CMD under min(CAP, time left), tee its output to LOG_DIR/NAME.log.
run_step() {
    local name="$1" cap="$2"
    shift 2
    local left=$((TOTAL_BUDGET_S - (SECONDS - START_S)))
    local limit=$((cap < left ? cap : left))
    echo
    echo "### $name (limit ${limit}s)"
    echo
    if ((limit < 20)); then
        echo "skipped: the ${TOTAL_BUDGET_S}s budget is spent"
        FAILED+=("$name (skipped)")
        return 0
    fi
    local rc=0
    timeout --kill-after=15 "$limit" "$@" 2>&1 | tee "$LOG_DIR/$name.log" || rc=$?
    if ((rc == 124 || rc == 137)); then
        echo "TIMED OUT after ${limit}s (partial output above; log: $LOG_DIR/$name.log)"
        FAILED+=("$name (timeout)")
    elif ((rc != 0)); then
        echo "FAILED with exit status $rc (log: $LOG_DIR/$name.log)"
        FAILED+=("$name (exit $rc)")
    fi
    return 0
}

# --- 0. machine and versions ---
echo "## mcore-engine GPU check: $(date -u '+%Y-%m-%d %H:%M UTC'), $(hostname)"
echo
if git rev-parse --git-dir >/dev/null 2>&1; then
    echo "git: $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . 2>/dev/null || echo ' (uncommitted changes)')"
fi
if command -v nvidia-smi >/dev/null 2>&1; then
    timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
INFO="$(timeout 120 "$PY" -c '
import sys
import torch
print(torch.cuda.device_count() if torch.cuda.is_available() else 0)
try:
    import triton
    tv = triton.__version__
except ImportError:
    tv = "not installed"
name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {tv}, GPU: {name}")
')"
NGPU="$(head -n1 <<<"$INFO")"
tail -n +2 <<<"$INFO"

if ((SMOKE)); then
    echo "smoke mode: tiny CPU shapes, Triton interpreter"
    run_step kernels_gpu_check 180 env TRITON_INTERPRET=1 "$PY" tools/gpu_check.py --smoke
    run_step bench_quick 180 "$PY" tools/bench.py --markdown --quick --device cpu --tp 1 --configs A,E \
        --timeout 120
else
    if ((NGPU < 1)); then
        echo "no CUDA device visible to torch: nothing to check (use --smoke for a CPU wiring check)" >&2
        exit 2
    fi
    TP="1"
    if ((NGPU >= 2)); then TP="1,2"; fi
    # --- 1. kernel tests on the GPU + kernel / fused lm-head table ---
    run_step kernels_gpu_check 210 "$PY" tools/gpu_check.py --tests
    # --- 2. acceptance sizes, every configuration ---
    run_step bench_fp32_acceptance 150 "$PY" tools/bench.py --markdown --device cuda --tp "$TP" \
        --tokens 4096 --vocab 32768 --dtype fp32 --repeats 5 --timeout 60
    # --- 3. realistic size (issue 5): 32768 tokens, vocab 152064, hidden 4096, bf16; A and E, with fused ---
    run_step bench_bf16_realistic 240 "$PY" tools/bench.py --markdown --realistic --device cuda --tp "$TP" \
        --repeats 3 --timeout 150
fi

echo
echo "### summary ($((SECONDS - START_S))s, logs in $LOG_DIR)"
if ((${#FAILED[@]})); then
    printf -- '- FAILED: %s\n' "${FAILED[@]}"
    exit 1
fi
echo "- all steps passed"
