#!/usr/bin/env bash
# kvbridge's checks on a CUDA GPU (issue 30, part 5), in one call:
#
#     scripts/gpu_check.sh
#
# On a machine without a usable CUDA GPU it prints one line saying so and exits 0: nothing is
# run, nothing is claimed. With one, it builds (once) a venv with the CUDA `vllm` wheel under
# ${KVBRIDGE_CACHE:-~/.cache/kvbridge-vllm}/venv-cuda, then runs scripts/gpu_pd_check.py: two
# engines at about 0.3 of the GPU's memory each (P/D handoffs, a partial prefix already on D,
# and the tensor-parallel pairings where there are GPUs for them), printing token equality per
# prompt and D's load time against a recompute. Exit status: 0 when every check passed.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VLLM_VERSION=${KVBRIDGE_GPU_VLLM_VERSION:-0.32.0}
venv=${KVBRIDGE_CACHE:-$HOME/.cache/kvbridge-vllm}/venv-cuda
host_py=${PYTHON:-python3}

gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l || true)
if [[ ${gpus:-0} -lt 1 ]]; then
    echo "gpu_check: no CUDA GPU here (nvidia-smi absent or lists none); nothing was run"
    exit 0
fi

if [[ ! -x $venv/bin/python ]] \
        || ! "$venv/bin/python" -c "import vllm, kvbridge" 2>/dev/null; then
    echo "gpu_check: building $venv (vllm==$VLLM_VERSION, CUDA wheel; several minutes)" >&2
    "$host_py" -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip
    "$venv/bin/pip" install -q "vllm==$VLLM_VERSION"
    constraints=$(mktemp)
    "$venv/bin/python" -c 'import torch, vllm; print(f"torch=={torch.__version__}\nvllm=={vllm.__version__}")' >"$constraints"
    "$venv/bin/pip" install -q -c "$constraints" -e "$repo[test]"
    rm -f "$constraints"
fi

if ! "$venv/bin/python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: nvidia-smi lists $gpus GPU(s) but torch.cuda.is_available() is false in $venv; nothing was run"
    exit 0
fi

cd "$repo"
exec "$venv/bin/python" scripts/gpu_pd_check.py --gpus "$gpus"
