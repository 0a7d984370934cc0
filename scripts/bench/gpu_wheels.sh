#!/usr/bin/env bash
# Wheels the GPU machine lacks, downloaded here and installed there without network (docs/GPU.md, "A GPU machine without network").
#
#   bash scripts/bench/gpu_wheels.sh             # here, with network: download into wheels/ (git-ignored), list sizes
#   bash scripts/bench/gpu_wheels.sh --install   # on the GPU machine: install wheels/ and this project, offline
#
# For a GPU machine without network that has CPython, torch, triton, transformers, accelerate, tokenizers,
# safetensors and huggingface_hub: transformers 5.23 (whose own pins those versions meet), and datasets (with
# dill, multiprocess) and flash-linear-attention (fla-core), which such a machine may lack. Versions are those of
# the development .venv (fla: the newest, 0.6.0, which needs torch>=2.7, triton>=3.3 and einops).
# --install puts the wheels and the project (editable) into the machine's python3; where that fails (a read-only
# environment; no setuptools there for the editable build) it puts the wheels, or a copy of the package, under
# wheels/site instead. Either way it writes wheels/env.sh (PYTHONPATH where needed), sourced by the caller:
#   bash scripts/bench/gpu_wheels.sh --install && . wheels/env.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

WHEELS=(
    transformers==5.23.0
    flash-linear-attention==0.6.0
    fla-core==0.6.0
    datasets==5.2.0
    dill==0.4.1
    multiprocess==0.70.19
    regex==2026.11.15  # transformers 5.23 checks regex>=2025.10.22 when imported; the machine's version is unknown
)
DIR=wheels
ENV_FILE=$DIR/env.sh  # both inside wheels/: a new download starts the install afresh
SITE=$PWD/$DIR/site
LIMIT_MIB=48  # the working tree that travels to the GPU machine is limited to 64 MiB in all

if [[ "${1:-}" != "--install" ]]; then
    PY=${PYTHON:-python3}
    [[ -x .venv/bin/python && -z "${PYTHON:-}" ]] && PY=.venv/bin/python
    rm -rf "$DIR" && mkdir -p "$DIR"
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d "$DIR" "${WHEELS[@]}"
    ls -l "$DIR"
    size=$(du -sm "$DIR" | cut -f1)
    echo "$DIR/: $(ls "$DIR" | wc -l) wheels, $(du -sh "$DIR" | cut -f1)"
    if (( size > LIMIT_MIB )); then
        echo "$DIR/ is over $LIMIT_MIB MiB: it would not travel with the working tree" >&2
        exit 1
    fi
    exit 0
fi

# --install (GPU machine: no network; python3 is the one with torch)
PY=${PYTHON:-python3}
shopt -s nullglob
whl=("$DIR"/*.whl)
(( ${#whl[@]} )) || { echo "no wheels in $DIR/: pass carry [\"wheels\"] to the run" >&2; exit 1; }
pip_install=("$PY" -m pip install --quiet --no-index --no-deps --no-cache-dir --disable-pip-version-check)
if [[ -f "$ENV_FILE" ]]; then
    echo "already installed ($ENV_FILE)"
else
    site=""
    if ! "${pip_install[@]}" "${whl[@]}"; then
        echo "the environment of $PY is not writable: wheels under $SITE instead"
        "${pip_install[@]}" --no-compile --upgrade --target "$SITE" "${whl[@]}"
        site=1
    fi
    if ! "${pip_install[@]}" --no-build-isolation -e .; then  # needs setuptools and wheel there (no network)
        echo "no editable install: a copy of the package under $SITE instead"
        mkdir -p "$SITE" && rm -rf "$SITE/hf_resolvent"
        cp -r src/hf_resolvent "$SITE/" && cp -r kernels "$SITE/hf_resolvent/backends/triton"
        site=1
    fi
    echo "# written by scripts/bench/gpu_wheels.sh --install" > "$ENV_FILE"
    if [[ -n "$site" ]]; then
        echo "export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH}" >> "$ENV_FILE"
    fi
fi
# shellcheck disable=SC1090
. "$ENV_FILE"
"$PY" - <<'PY'
import importlib.metadata as md

import torch
import transformers
import triton

import hf_resolvent  # registers the model: needs transformers 5.23
from hf_resolvent.backends import triton as kernels


def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "-"


names = ["torch", "triton", "transformers", "accelerate", "datasets", "tokenizers", "safetensors",
         "huggingface-hub", "regex", "fla-core", "flash-linear-attention", "hf-resolvent"]
print("  ".join(f"{n} {version(n)}" for n in names))
print("hf_resolvent from", hf_resolvent.__file__)
assert transformers.__version__.startswith("5.23"), transformers.__version__
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
print(f"GPU: {gpu}; Triton kernels ready: {kernels.triton_ready()}; triton {triton.__version__}")
PY
