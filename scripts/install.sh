#!/usr/bin/env bash
# Build the project's environments from the package registry:
#   .venv      Python 3.12 (jax 0.11.2, the GPU machines' version) with snapmla-jax
#              installed in editable mode with its test and train extras.
#   .venv-ref  Python 3.11 with the CPU build of PyTorch and Hugging Face
#              transformers: the reference side of the model parity tests
#              (run as a subprocess; the project itself never imports torch).
# Override the interpreters with PYTHON312=... / PYTHON311=...
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON312=${PYTHON312:-/root/.pyenv/versions/3.12.1/bin/python}
PYTHON311=${PYTHON311:-/root/.pyenv/versions/3.11.7/bin/python}
command -v "$PYTHON312" >/dev/null || PYTHON312=python3.12
command -v "$PYTHON311" >/dev/null || PYTHON311=python3.11

[ -x .venv/bin/python ] || "$PYTHON312" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[test,train]"

[ -x .venv-ref/bin/python ] || "$PYTHON311" -m venv .venv-ref
.venv-ref/bin/python -m pip install -q --upgrade pip
# torch 2.13.0 is the CPU build these machines keep on disk for Python 3.11.
.venv-ref/bin/python -m pip install -q torch==2.13.0 transformers==5.23.0 safetensors numpy
echo "environments ready: .venv (project), .venv-ref (reference)"
