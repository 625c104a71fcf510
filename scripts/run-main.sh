#!/usr/bin/env bash
# The main job: set up, then fine-tune the embedded SmolLM2-135M-Instruct (about 5 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/toolkit sft --config examples/sft_smollm2.toml "$@"
