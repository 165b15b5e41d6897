#!/usr/bin/env bash
# The newcomer's path: install into ./.venv, prepare the default corpus (this Python's own
# standard library source), train the tiny GPT on a local Ray cluster with local checkpoints and
# a local MLflow store, then generate text from the final checkpoint.
# Extra arguments go to `raytrain-sys run`, e.g. `bash scripts/demo.sh --set train.max_steps=50`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# shellcheck disable=SC1091
. .venv/bin/activate
if [ ! -f data/stdlib/manifest.json ]; then
    raytrain-sys prepare-data --out data/stdlib
fi
raytrain-sys run jobs/tinygpt.yaml "$@"
echo
echo "--- text sampled from the final checkpoint (prompt: 'def ') ---"
raytrain-sys sample runs/latest --prompt "def " --max-new-tokens 300
