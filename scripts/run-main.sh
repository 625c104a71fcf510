#!/usr/bin/env bash
# The main job: set up, then train the embedded SmolLM2-135M-Instruct on generated arithmetic in two
# stages (examples/arithmetic_pipeline.toml): a short SFT warm-up, then GRPO. Prints held-out accuracy
# before/after each stage; writes outputs/arithmetic/summary.json and report.png, the model in
# outputs/arithmetic/1-grpo/final. Extra arguments are not accepted (a pipeline's settings live in its
# stages' run files); `toolkit grpo --config examples/grpo_arithmetic.toml` runs the GRPO stage alone.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/toolkit pipeline --config examples/arithmetic_pipeline.toml "$@"
