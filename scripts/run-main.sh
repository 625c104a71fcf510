#!/usr/bin/env bash
# The main job: set up, then GRPO-train the embedded SmolLM2-135M-Instruct on generated arithmetic
# (about 11 minutes on 2 cores); prints held-out accuracy before/after, saves model and report.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/toolkit grpo --config examples/grpo_arithmetic.toml "$@"
