#!/usr/bin/env bash
# NVIDIA's aiperf, a load generator nobody here wrote, against radixmesh's OpenAI API.
#
#   make serve                                   # in another terminal: HTTP on 127.0.0.1:8000
#   benchmarks/aiperf_serving.sh [URL] [OUT_DIR] [completions|chat]
#
# Installs aiperf (pinned) into its own venv on first use (.venv-aiperf: it pins its own
# dependency versions, so it stays out of the project's venv), writes the default model's tokenizer
# where aiperf can read it offline, and runs a bounded profile: 256-token prompts of which the first
# 128 come from a pool of 4 shared prefixes (so the prefix cache has something to find), 64 output
# tokens each (ignore_eos), concurrency 1 then 4, 32 requests per level. It prints one line per level
# and exits 1 if any request failed (aiperf itself exits 0 unless every request fails). Not part of
# CI: it needs a running cluster and the network for its first install.
set -euo pipefail
cd "$(dirname "$0")/.."
URL=${1:-http://127.0.0.1:8000}
OUT=${2:-benchmarks/out/aiperf-$(date +%Y%m%d-%H%M%S)}
KIND=${3:-completions}
AIPERF_VERSION=${AIPERF_VERSION:-0.13.0}
VENV=${AIPERF_VENV:-.venv-aiperf}
TOKENIZER=${TOKENIZER:-.venv/smollm2-tokenizer}

if [[ ! -x $VENV/bin/aiperf ]]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "aiperf==$AIPERF_VERSION"
fi
[[ -f $TOKENIZER/tokenizer.json ]] || .venv/bin/python benchmarks/export_tokenizer.py "$TOKENIZER" >/dev/null
MODEL=$(.venv/bin/python -c "import json, sys, urllib.request; print(json.load(urllib.request.urlopen(sys.argv[1] + '/v1/models', timeout=10))['data'][0]['id'])" "$URL")

# aiperf 0.13 hands a local tokenizer path to the hub client when HF_HUB_OFFLINE is set (and fails);
# unset, it sees a local directory and reads it without any network.
unset HF_HUB_OFFLINE TRANSFORMERS_OFFLINE
export HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 DO_NOT_TRACK=1
mkdir -p "$OUT"
# --no-gpu-telemetry: aiperf's default telemetry ports (9400, 9401) are radixmesh's metrics ports.
"$VENV/bin/aiperf" profile \
  --model "$MODEL" --url "$URL" --endpoint-type "$KIND" --streaming \
  --tokenizer "$TOKENIZER" --use-server-token-count \
  --isl 256 --isl-stddev 0 --osl 64 --extra-inputs ignore_eos:true \
  --prompt-prefix-pool-size 4 --prompt-prefix-length 128 \
  --concurrency 1,4 --request-count 32 --benchmark-duration 300 --benchmark-grace-period 30 \
  --request-timeout-seconds 120 --random-seed 0 \
  --ui-type none --no-gpu-telemetry --no-server-metrics \
  --output-artifact-dir "$OUT" >"$OUT/console.txt" 2>&1 || {
  tail -30 "$OUT/console.txt"
  exit 1
}
exec .venv/bin/python benchmarks/aiperf_summary.py "$OUT"
