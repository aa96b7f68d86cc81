#!/usr/bin/env bash
# Build the project's environments from the package registry.
#
#   bash scripts/install.sh           .venv: this package, editable, with its test and train
#                                     extras (all the README's generate command needs), on the
#                                     lowest jax pyproject.toml accepts (0.11.2: the release the
#                                     GPU measurements in docs/ were taken with)
#   bash scripts/install.sh --tests   the same, plus .venv-ref: CPU PyTorch and Hugging Face
#                                     transformers, the reference side of the model parity tests
#                                     (tests/test_model_hf.py runs it as a subprocess; the
#                                     project never imports torch; without it those tests skip)
#   --jax newest                      instead of .venv, .venv-jax-newest: the same install on the
#                                     newest jax and jaxlib pyproject.toml accepts (CI runs the
#                                     suite in both)
#   --jax VERSION                     likewise, .venv-jax-VERSION on jax and jaxlib VERSION
#   --cuda13                          add the cuda13 extra: jax's CUDA 13 plugin of the same version
#                                     and CUDA's libraries as wheels, for NVIDIA GPUs (needs only
#                                     the driver on the machine)
#   --dry-run                         print the interpreters and steps chosen, change nothing
#
# Python: $PYTHON if set, else the first of python3.12, python3.13, python3.14, python3 on
# PATH that runs and is at least pyproject.toml's requires-python (3.12: jax 0.11 and 0.12
# need it), else the oldest such interpreter installed with pyenv, if pyenv is on
# PATH (its shims answer only for the versions selected there). 3.12 is tried first: the
# Python the project's GPU measurements ran on.
# The reference environment uses $REF_PYTHON if set, else python3.11 when it runs (the
# version the reference side was validated with), else the project's Python.
set -euo pipefail
cd "$(dirname "$0")/.."

tests=0
dry_run=0
jax=
extras=test,train
while [ $# -gt 0 ]; do
    case "$1" in
        --tests) tests=1 ;;
        --dry-run) dry_run=1 ;;
        --cuda13) extras=test,train,cuda13 ;;
        --jax)
            [ $# -gt 1 ] && [[ "$2" =~ ^(newest|[0-9]+(\.[0-9]+)+)$ ]] || {
                echo "install.sh: error: --jax: expected newest or a version such as 0.12.0" >&2; exit 2; }
            jax=$2; shift ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "install.sh: error: $1: expected --tests, --jax, --cuda13, --dry-run or --help" >&2; exit 2 ;;
    esac
    shift
done

# "3.12" from `requires-python = ">=3.12"`: one source for the minimum.
minimum=$(sed -n 's/^requires-python = ">=\([0-9]*\.[0-9]*\)".*/\1/p' pyproject.toml)
[ -n "$minimum" ] || { echo "install.sh: error: no requires-python = \">=X.Y\" in pyproject.toml" >&2; exit 2; }
at_least_minimum() {
    "$1" -c "import sys; sys.exit(sys.version_info < tuple(map(int, '$minimum'.split('.'))))" 2>/dev/null
}

pyenv_pythons() {  # pyenv's interpreters, oldest version first
    command -v pyenv >/dev/null || return 0
    local root version
    root=$(pyenv root 2>/dev/null) || return 0
    for version in $(pyenv versions --bare 2>/dev/null | sort -V); do
        [ -x "$root/versions/$version/bin/python" ] && echo "$root/versions/$version/bin/python"
    done
    return 0
}

pick_python() {
    if [ -n "${PYTHON:-}" ]; then
        at_least_minimum "$PYTHON" || {
            echo "install.sh: error: PYTHON=$PYTHON is not a Python >= $minimum" >&2; exit 2; }
        echo "$PYTHON"; return
    fi
    for candidate in python3.12 python3.13 python3.14 python3 $(pyenv_pythons); do
        if command -v "$candidate" >/dev/null && at_least_minimum "$candidate"; then
            echo "$candidate"; return
        fi
    done
    echo "install.sh: error: no Python >= $minimum on PATH (tried python3.12, python3.13, python3.14, python3" \
         "and pyenv's); set PYTHON=..." >&2
    exit 2
}

# "0.11.2" from `"jax>=0.11.2,<0.13",`: the lowest jax pyproject.toml accepts, .venv's.
lowest_jax=$(sed -n 's/^ *"jax>=\([0-9.]*[0-9]\),.*/\1/p' pyproject.toml)
[ -n "$lowest_jax" ] || { echo "install.sh: error: no \"jax>=X.Y.Z,...\" in pyproject.toml" >&2; exit 2; }
case "$jax" in
    "") venv=.venv; pins=("jax==$lowest_jax" "jaxlib==$lowest_jax") ;;
    # Named with --upgrade: pip takes the newest releases within pyproject.toml's range, also
    # into an environment built before they came out.
    newest) venv=.venv-jax-newest; pins=(--upgrade jax jaxlib) ;;
    *) venv=.venv-jax-$jax; pins=("jax==$jax" "jaxlib==$jax") ;;
esac

python=$(pick_python)
ref_python=${REF_PYTHON:-}
if [ -z "$ref_python" ]; then
    if python3.11 -c pass 2>/dev/null; then ref_python=python3.11; else ref_python=$python; fi
fi
if [ "$dry_run" = 1 ]; then
    echo "$venv: $python ($("$python" --version 2>&1)), pip install -e .[$extras] ${pins[*]}"
    [ "$tests" = 1 ] && echo ".venv-ref: $ref_python ($("$ref_python" --version 2>&1)), pip install torch transformers"
    exit 0
fi

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q -e ".[$extras]" "${pins[@]}"
echo "ready: $venv ($("$venv/bin/python" --version), jax $("$venv/bin/python" -c 'import jax; print(jax.__version__)'))"

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
