#!/usr/bin/env bash
# The prepared device run (issue 56): every GPU path in one command, results with the commit that ran.
#
#   TOOLKIT_COMMIT=$(git rev-parse HEAD) OUT=/tmp/gpu bash scripts/gpu_run.sh [MODEL_DIR]
#
# On a lent machine the tree is a copy without .git: the command that starts the run sets TOOLKIT_COMMIT from this
# side (the last run's results named the wrong commit because nothing carried it). Writes under $OUT:
# versions.txt, gpu_check.{json,txt}, memory_vs_trl.{json,txt} (SFT/DPO/GRPO peak memory and step time against TRL
# on the card) and grpo_cuda.{json,txt} (GRPO s/step against TRL). Expected ~9 min on an H100 (from the H200 run
# of 2026-12-04: gpu_check ~5 min; not yet run in this form). MODEL_DIR defaults to the embedded SmolLM2 (random
# init from its config when only the config travels: --random-init below).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-run}
mkdir -p "$OUT"
MODEL=${1:-$(python -m toolkit.core.cli model-path 2>/dev/null | tail -1)}
echo "commit ${TOOLKIT_COMMIT:-unknown}" | tee "$OUT/versions.txt"
python -c "import torch, transformers; print(torch.__version__, torch.version.cuda, transformers.__version__, torch.cuda.get_device_name(0))" | tee -a "$OUT/versions.txt"
status=0
timeout 330 python scripts/gpu_check.py --model "$MODEL" --random-init --timeout 100 --out "$OUT/gpu_check.json" 2>&1 | tee "$OUT/gpu_check.txt" || status=1
timeout 150 python bench/memory_vs_trl.py --device cuda --models smollm2 --trainers grpo,sft,dpo --json "$OUT/memory_vs_trl.json" 2>&1 | tee "$OUT/memory_vs_trl.txt" || status=1
timeout 90 python bench/grpo_cuda.py --model "$MODEL" --random-init --steps 4 --json "$OUT/grpo_cuda.json" 2>&1 | tee "$OUT/grpo_cuda.txt" || status=1
exit $status
