#!/usr/bin/env bash
# Run rlx on every host of a Cloud TPU pod slice (one process per TPU VM host).
#
# Usage: TPU_NAME=my-v5p-64 ZONE=us-east5-a CONFIG=configs/x.py launch/tpu_pod.sh [--dry-run]
#
# Every worker runs the same `python -m rlx.launch`; jax.distributed.initialize() finds the
# coordinator and the process ids from the TPU metadata (config.distributed.enabled=True with an
# empty coordinator address), so nothing else is needed.
#
# Variables (required: TPU_NAME, ZONE, CONFIG):
#   TPU_NAME    name of the TPU VM slice
#   ZONE        its zone, e.g. us-east5-a
#   PROJECT     GCP project (default: gcloud's configured project)
#   CONFIG      config file, relative to REPO_DIR on the workers
#   REPO_DIR    checkout of rlx on every worker (default: rlx, i.e. ~/rlx)
#   PYTHON      interpreter on the workers (default: python3)
#   RLX_ARGS    extra flags for rlx.launch, e.g. "--config.mesh.fsdp=64"
#   SYNC        1: first copy this checkout to REPO_DIR on every worker (gcloud scp)
#   SETUP_CMD   run on every worker before training, e.g. "pip install -e 'rlx[tpu]'"
#   --dry-run   print the gcloud commands instead of running them
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/common.sh"
parse_common_args "$@"
require_vars TPU_NAME ZONE CONFIG

REPO_DIR=${REPO_DIR:-rlx}
PYTHON=${PYTHON:-python3}
RLX_ARGS=${RLX_ARGS:-}
GCLOUD=(gcloud compute tpus tpu-vm)
WHERE=(--zone="$ZONE" --worker=all)
[[ -n "${PROJECT:-}" ]] && WHERE+=(--project="$PROJECT")

if [[ "${SYNC:-0}" == 1 ]]; then
  run "${GCLOUD[@]}" scp --recurse "$(cd "$HERE/.." && pwd)" "$TPU_NAME:$REPO_DIR" "${WHERE[@]}"
fi
if [[ -n "${SETUP_CMD:-}" ]]; then
  run "${GCLOUD[@]}" ssh "$TPU_NAME" "${WHERE[@]}" --command="$SETUP_CMD"
fi
TRAIN="cd $(printf '%q' "$REPO_DIR") && $PYTHON -m rlx.launch --config=$(printf '%q' "$CONFIG")"
TRAIN+=" --config.distributed.enabled=True $RLX_ARGS"
run "${GCLOUD[@]}" ssh "$TPU_NAME" "${WHERE[@]}" --command="${TRAIN% }"
