#!/usr/bin/env bash
# Start a pool of SGLang servers on a set of GPUs of this machine, behind one sglang-router.
#
# Usage: MODEL=/ckpt/hf GPUS=0,1,2,3,4,5,6,7 TP=2 launch/sglang_pool.sh [--dry-run]
#
# MODE=servers (default): one `python -m sglang.launch_server` per group of TP GPUs (pinned with
# CUDA_VISIBLE_DEVICES, ports BASE_PORT, BASE_PORT+1, ...), then
# `python -m sglang_router.launch_router --worker-urls ...` in front of them. rlx's SGLang engine
# talks to the router URL; weight updates go to every server (see rlx.rollout.sglang.engine).
# MODE=dp: a single `python -m sglang_router.launch_server --dp-size N --tp-size TP`, which
# starts N data-parallel replicas and the router in one process.
# Also usable as an sbatch script (SLURM runs it on the first node of the allocation).
#
# Variables (required: MODEL):
#   MODEL        HF checkpoint folder served by every server
#   GPUS         comma-separated GPU ids to use (default: 0,1,2,3,4,5,6,7)
#   TP           GPUs per server, tensor parallel (default: 1); servers = #GPUS / TP
#   MODE         servers | dp (default: servers)
#   HOST         bind address of servers and router (default: 0.0.0.0)
#   ADVERTISE    host name the router uses to reach the servers (default: this host's name)
#   BASE_PORT    port of the first server (default: 30000)
#   ROUTER       1: start the router, 0: servers only (default: 1)
#   ROUTER_PORT  router port (default: 8000)
#   POLICY       router policy: cache_aware | round_robin | random | power_of_two (default: cache_aware)
#   PYTHON       python of the SGLang environment (default: python3)
#   SERVER_ARGS  extra launch_server flags, e.g. "--enable-lora --max-lora-rank 16 --mem-fraction-static 0.8"
#                Unless it names --quantization, the flag matching an rlx export is added: the
#                export's config.json quantization_config.quant_method (w8a8_int8, fp8,
#                compressed-tensors), or gguf for a .gguf file, so the servers hold the very values
#                the learner trains against.
#   STARTUP_S    seconds to wait for each server's /health before starting the router (default: 900)
#   --dry-run    print the commands instead of running them
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[[ -f "$HERE/common.sh" ]] || HERE="${SLURM_SUBMIT_DIR:-.}/launch"
source "$HERE/common.sh"
parse_common_args "$@"
require_vars MODEL

GPUS=${GPUS:-0,1,2,3,4,5,6,7}
TP=${TP:-1}
MODE=${MODE:-servers}
HOST=${HOST:-0.0.0.0}
ADVERTISE=${ADVERTISE:-$(hostname)}
BASE_PORT=${BASE_PORT:-30000}
ROUTER=${ROUTER:-1}
ROUTER_PORT=${ROUTER_PORT:-8000}
POLICY=${POLICY:-cache_aware}
PYTHON=${PYTHON:-python3}
STARTUP_S=${STARTUP_S:-900}
read -r -a EXTRA <<< "${SERVER_ARGS:-}"

export_quantization() {  # model path -> the --quantization value that serves it as exported
  if [[ "$1" == *.gguf ]]; then echo gguf; return; fi
  [[ -f "$1/config.json" ]] || return 0
  python3 -c 'import json, sys
q = json.load(open(sys.argv[1])).get("quantization_config") or {}
print(q.get("quant_method", ""))' "$1/config.json"
}
if [[ " ${EXTRA[*]-} " != *" --quantization"* ]]; then
  QUANT=$(export_quantization "$MODEL")
  [[ -n "$QUANT" ]] && EXTRA+=(--quantization "$QUANT")
fi
IFS=, read -r -a GPU_LIST <<< "$GPUS"
if (( ${#GPU_LIST[@]} % TP )); then
  echo "GPUS has ${#GPU_LIST[@]} ids, not a multiple of TP=$TP" >&2; exit 2
fi
N=$(( ${#GPU_LIST[@]} / TP ))

cleanup() { (( ${#BG_PIDS[@]} )) && kill "${BG_PIDS[@]}" 2>/dev/null || true; }
trap cleanup EXIT INT TERM

wait_healthy() {  # url
  [[ "$DRY_RUN" == 1 ]] && { echo "# wait for $1/health"; return; }
  local t=0
  until curl -sf "$1/health" > /dev/null; do
    (( t += 5 )); (( t > STARTUP_S )) && { echo "$1 not healthy after ${STARTUP_S}s" >&2; exit 1; }
    sleep 5
  done
}

if [[ "$MODE" == dp ]]; then
  run_bg env CUDA_VISIBLE_DEVICES="$GPUS" "$PYTHON" -m sglang_router.launch_server \
    --model-path "$MODEL" --dp-size "$N" --tp-size "$TP" --host "$HOST" --port "$ROUTER_PORT" \
    "${EXTRA[@]}"
else
  URLS=()
  for (( i = 0; i < N; i++ )); do
    group=$(IFS=,; echo "${GPU_LIST[*]:i*TP:TP}")
    port=$(( BASE_PORT + i ))
    run_bg env CUDA_VISIBLE_DEVICES="$group" "$PYTHON" -m sglang.launch_server \
      --model-path "$MODEL" --tp-size "$TP" --host "$HOST" --port "$port" "${EXTRA[@]}"
    URLS+=("http://$ADVERTISE:$port")
  done
  if [[ "$ROUTER" == 1 ]]; then
    for url in "${URLS[@]}"; do wait_healthy "$url"; done
    run_bg "$PYTHON" -m sglang_router.launch_router --worker-urls "${URLS[@]}" \
      --host "$HOST" --port "$ROUTER_PORT" --policy "$POLICY"
  fi
fi
[[ "$DRY_RUN" == 1 ]] || wait
