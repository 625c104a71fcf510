#!/usr/bin/env bash
# The main job: set up, then train the embedded SmolLM2-135M-Instruct on generated arithmetic with an SFT
# warm-up followed by GRPO (6.5-8.5 minutes on 2 cores, setup included); prints held-out accuracy per stage, saves the model
# and a report (outputs/arithmetic: summary.json with the commit, report.png).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/toolkit pipeline --config examples/arithmetic_pipeline.toml  # settings live in the run files it names
