#!/usr/bin/env bash
# kvbridge's own checks on one CUDA GPU with no network and no vLLM (issue 30, part 5):
#
#     scripts/gpu_device_check.sh
#
# Runs scripts/gpu_device_check.py (Triton kernels against their torch twins, P/D on kvbridge's
# engine with KV caches on the GPU, the connector threads' device binding, UCX reads of device
# KV blocks) in the Python at hand (${PYTHON:-python3}, which must have torch with CUDA). The
# wheels in .whl/ at the repository's root (ucxx and the packages kvbridge imports that the
# machine lacks; docs/operations.md, "GPU checks") are installed with no index into
# ${KVBRIDGE_GPU_SITE:-/tmp/site}; this checkout goes on the path through a symlink tree, nothing
# is installed into the Python. The full log goes to $OUT/gpu_check.log when OUT is set.
# Exit status: 0 when every check passed. On a machine without a usable CUDA GPU it says so and
# exits 0: nothing is run, nothing is claimed (as scripts/gpu_check.sh). `--cpu-dry-run` runs
# the same steps with the checks on the CPU instead (tests/test_gpu_device_check.py).
set -uo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${PYTHON:-python3}
site=${KVBRIDGE_GPU_SITE:-/tmp/site}
wheel_dir=${KVBRIDGE_GPU_WHEEL_DIR:-$repo/.whl}

device=cuda
if [[ ${1:-} == --cpu-dry-run ]]; then
    device=cpu
    echo "gpu_device_check: CPU dry run (--cpu-dry-run): the checks' code paths on the CPU, nothing GPU"
elif ! "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_device_check: no usable CUDA GPU here (torch missing or torch.cuda.is_available() false); nothing GPU was run"
    exit 0
fi

shopt -s nullglob
wheels=("$wheel_dir"/*.whl)
if (( ${#wheels[@]} )); then
    if "$py" -m pip --version >/dev/null 2>&1; then
        "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "${wheels[@]}" \
            || { echo "gpu_device_check: installing $wheel_dir/*.whl into $site failed"; exit 1; }
    else  # a venv without pip: these wheels have no scripts or .data, unpacking installs them
        mkdir -p "$site"
        for wheel in "${wheels[@]}"; do
            "$py" -m zipfile -e "$wheel" "$site" \
                || { echo "gpu_device_check: unpacking $wheel into $site failed"; exit 1; }
        done
    fi
else
    echo "gpu_device_check: no wheels in $wheel_dir (packages this Python lacks will not import)"
fi

pkg=$(mktemp -d)
mkdir -p "$pkg/kvbridge"
for part in connector kernels kvmanager transport; do
    ln -s "$repo/$part" "$pkg/kvbridge/$part"
done
trap 'rm -rf "$pkg"' EXIT

log=/dev/null
if [[ -n ${OUT:-} ]]; then
    mkdir -p "$OUT"
    log=$OUT/gpu_check.log
fi
cd "$repo"
# the log: every line printed, then the script's own log with each failed check's traceback
PYTHONPATH="$pkg:$site${PYTHONPATH:+:$PYTHONPATH}" UCX_WARN_UNUSED_ENV_VARS=n \
    timeout "${KVBRIDGE_GPU_CHECK_TIMEOUT_S:-220}" "$py" scripts/gpu_device_check.py \
    --device "$device" --log "$pkg/full.log" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
(( status == 124 )) && echo "gpu_device_check: timed out" | tee -a "$log"
if [[ $log != /dev/null && -f $pkg/full.log ]]; then
    { echo "---- full log (with tracebacks)"; cat "$pkg/full.log"; } >>"$log"
fi
exit "$status"
