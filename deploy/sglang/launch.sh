#!/usr/bin/env bash
# Launch an SGLang server as the rollout engine of Steward's trainer (trainer.rollout.SGLangRollout)
# on a GPU host.
#
#   deploy/sglang/launch.sh MODEL_PATH [PORT]
#
# MODEL_PATH is a local HF model directory (the job's initial policy, e.g. a Qwen2.5-0.5B-Instruct
# checkout, or a checkpoint's model/ dir). The trainer then talks to http://HOST:PORT:
#   POST /generate {"input_ids", "sampling_params", "return_logprob": true}
#   POST /pause_generation -> /update_weights_from_disk {"model_path", "weight_version"} -> /continue_generation
# so the trainer's staging directory must be readable from this host at the same path (same host,
# or a shared filesystem).
#
# Environment (defaults in brackets):
#   SGLANG_PYTHON         python with sglang installed                     [python3]
#   SGLANG_HOST           bind address; keep it private: /update_weights_from_disk
#                         swaps the model for anyone who can reach it     [127.0.0.1]
#   SGLANG_API_KEY        if set, required as "Authorization: Bearer ..." (SGLangRollout api_key=)
#   SGLANG_TP             tensor-parallel GPUs                             [1]
#   SGLANG_MEM_FRACTION   GPU memory share for weights + KV cache          [0.80]
#                         (lower it when the trainer shares the GPU)
#   SGLANG_DTYPE          weight dtype                                     [bfloat16]
#   SGLANG_WEIGHT_VERSION version reported in meta_info.weight_version    [0]
#   SGLANG_DETERMINISTIC  1: --enable-deterministic-inference, which makes the per-request
#                         sampling_seed the trainer sends reproducible    [0]
#   SGLANG_EXTRA_ARGS     anything else for sglang.launch_server
set -euo pipefail

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
  sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi

MODEL_PATH=$1
PORT=${2:-${SGLANG_PORT:-30000}}
PY=${SGLANG_PYTHON:-python3}

if [[ ! -f "$MODEL_PATH/config.json" ]]; then
  echo "launch.sh: $MODEL_PATH has no config.json (expected a local HF model directory)" >&2
  exit 1
fi
if ! "$PY" -c 'import sglang' 2>/dev/null; then
  echo "launch.sh: '$PY' cannot import sglang; install it on the GPU host (pip install 'sglang[all]')" >&2
  exit 1
fi

args=(
  --model-path "$MODEL_PATH"
  --host "${SGLANG_HOST:-127.0.0.1}"
  --port "$PORT"
  --tp-size "${SGLANG_TP:-1}"
  --mem-fraction-static "${SGLANG_MEM_FRACTION:-0.80}"
  --dtype "${SGLANG_DTYPE:-bfloat16}"
  --weight-version "${SGLANG_WEIGHT_VERSION:-0}"
)
if [[ -n "${SGLANG_API_KEY:-}" ]]; then
  args+=(--api-key "$SGLANG_API_KEY")
fi
if [[ "${SGLANG_DETERMINISTIC:-0}" == "1" ]]; then
  args+=(--enable-deterministic-inference)
fi
# shellcheck disable=SC2206  # word splitting of the extra args is the point
extra=(${SGLANG_EXTRA_ARGS:-})

echo "launch.sh: $PY -m sglang.launch_server ${args[*]} ${extra[*]}" >&2
exec "$PY" -m sglang.launch_server "${args[@]}" "${extra[@]}"
