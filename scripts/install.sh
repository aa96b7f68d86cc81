#!/usr/bin/env bash
# Build the project's environments from the package registry.
#
#   bash scripts/install.sh           .venv: this package, editable, with its test and train
#                                     extras (all the README's generate command needs)
#   bash scripts/install.sh --tests   the same, plus .venv-ref: CPU PyTorch and Hugging Face
#                                     transformers, the reference side of the model parity tests
#                                     (tests/test_model_hf.py runs it as a subprocess; the
#                                     project never imports torch; without it those tests skip)
#   --dry-run                         print the interpreters and steps chosen, change nothing
#
# Python: $PYTHON if set, else the first of python3.12, python3.11, python3 on PATH that is
# at least 3.11 (pyproject.toml's requires-python). 3.12 is tried first: the Python the
# project's GPU measurements ran on; any Python >= 3.11 with jax wheels works.
# The reference environment uses $REF_PYTHON if set, else python3.11 when on PATH (the
# version the reference side was validated with), else the project's Python.
set -euo pipefail
cd "$(dirname "$0")/.."

tests=0
dry_run=0
for arg in "$@"; do
    case "$arg" in
        --tests) tests=1 ;;
        --dry-run) dry_run=1 ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "install.sh: error: $arg: expected --tests, --dry-run or --help" >&2; exit 2 ;;
    esac
done

at_least_311() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }

pick_python() {
    if [ -n "${PYTHON:-}" ]; then
        at_least_311 "$PYTHON" || { echo "install.sh: error: PYTHON=$PYTHON is not a Python >= 3.11" >&2; exit 2; }
        echo "$PYTHON"; return
    fi
    for candidate in python3.12 python3.11 python3; do
        if command -v "$candidate" >/dev/null && at_least_311 "$candidate"; then
            echo "$candidate"; return
        fi
    done
    echo "install.sh: error: no Python >= 3.11 on PATH (tried python3.12, python3.11, python3); set PYTHON=..." >&2
    exit 2
}

python=$(pick_python)
ref_python=${REF_PYTHON:-}
if [ -z "$ref_python" ]; then
    if command -v python3.11 >/dev/null; then ref_python=python3.11; else ref_python=$python; fi
fi
if [ "$dry_run" = 1 ]; then
    echo ".venv: $python ($("$python" --version 2>&1)), pip install -e .[test,train]"
    [ "$tests" = 1 ] && echo ".venv-ref: $ref_python ($("$ref_python" --version 2>&1)), pip install torch transformers"
    exit 0
fi

[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[test,train]"
echo "ready: .venv ($(.venv/bin/python --version))"

[ "$tests" = 1 ] || exit 0

[ -x .venv-ref/bin/python ] || "$ref_python" -m venv .venv-ref
.venv-ref/bin/python -m pip install -q --upgrade pip
# Pinned so that every machine computes the reference logits with the same code:
# transformers 5.23.0 is the release whose DeepseekV2/V3 modelling (and `rope_parameters`
# config spelling, used by tests/reference/make_hf_reference.py) the parity tests were
# written against, and torch 2.13.0 the release they were validated with. Only torch's CPU
# side is used. PyPI's Linux x86_64 torch wheel bundles CUDA libraries (several GB); to
# install the CPU-only build instead, point pip at a CPU wheel (PIP_FIND_LINKS) or at
# PyTorch's CPU wheel index (PIP_EXTRA_INDEX_URL) before running this script.
.venv-ref/bin/python -m pip install -q torch==2.13.0 transformers==5.23.0 safetensors numpy
echo "ready: .venv-ref ($(.venv-ref/bin/python --version)), the reference side of the parity tests"
