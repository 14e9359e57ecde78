#!/usr/bin/env bash
# Side-by-side: NVIDIA Dynamo 1.6.1 (frontend + mocker) vs dynamo-zmq (frontend + mocker worker),
# same machine, same tiny model, same scripts/bench_e2e.py load, run alternately (never together).
#
#   scripts/bench_vs_dynamo.sh [--only dynamo|ours] [--http-workers N] [bench_e2e.py flags...]
#
# --http-workers N: our frontend runs N HTTP processes (its own --http-workers; CPU, fds and RSS
# are then its whole process tree's). Dynamo's frontend is one process with its own threads.
#
# Env: ROUNDS (2: dynamo, ours, dynamo, ours), SPEEDUP (1e6), DYN_PORT / OURS_PORT / OURS_WORKER_PORT
# (18100 / 18200 / 18201), OURS_PY (.venv/bin/python), BASE_PY (python3, builds the Dynamo venv),
# OURS_AUTH_KEYS (a key directory: ours runs with CURVE on, --auth-keys DIR, one keypair "node"
# that authorizes itself; made by `python -m dynamo_zmq.keys` if missing).
# Default load: --concurrency 1,16,64,256 --requests-per-level 1000 --max-seconds 20, 100 output
# tokens, 100-500-token prompts; later flags override.
#
# Cached under .bench/: the Dynamo venv (dynamo-1.6.1-venv) and the model dir (tiny-model-bench).
# Results: .bench/results/<time>/{dynamo,ours}-rN.json, logs, compare.md, compare-rN.png.
#
# Dynamo without etcd/NATS: --discovery-backend file (its store dir is DYN_FILE_KV),
# --request-plane tcp, --event-plane zmq; DYN_TCP_RPC_HOST / DYN_TCP_RESPONSE_STREAM_HOST /
# DYN_EVENT_PLANE_HOST pin the advertised addresses to loopback.
# Dynamo's mocker emits token ids in [1000, 2000), so the model dir needs a vocabulary of at least
# 2000 (a smaller one decodes every token to "" and the frontend sends no content chunks at all).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BENCH=$ROOT/.bench
DYN_VENV=$BENCH/dynamo-1.6.1-venv
MODEL=$BENCH/tiny-model-bench
MODEL_NAME=tiny-bench
OURS_PY=${OURS_PY:-$ROOT/.venv/bin/python}
BASE_PY=${BASE_PY:-python3}
ROUNDS=${ROUNDS:-2}
SPEEDUP=${SPEEDUP:-1e6}
DYN_PORT=${DYN_PORT:-18100}
OURS_PORT=${OURS_PORT:-18200}
OURS_WORKER_PORT=${OURS_WORKER_PORT:-18201}
OUT=$BENCH/results/$(date +%Y%m%d-%H%M%S)

ONLY=""
HTTP_WORKERS=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --only) ONLY=$2; shift 2 ;;
    --http-workers) HTTP_WORKERS=$2; shift 2 ;;
    *) break ;;
  esac
done
EXTRA=("$@")
# c=1024 needs more than the usual 1024 descriptors (the client's and the frontends' sockets).
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

PIDS=()
stop_all() {
  local pid i
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do
    for i in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
      echo "  pid $pid ignored SIGTERM for 10 s; SIGKILL" >&2
      kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
  done
  PIDS=()
}
trap stop_all EXIT
trap 'exit 130' INT TERM

start() {  # start LOG CMD... : run in the background, remember the pid in LAST_PID
  local log=$1; shift
  "$@" >"$log" 2>&1 &
  LAST_PID=$!
  PIDS+=("$LAST_PID")
}

wait_model() {  # wait_model PORT PID LOG : until /v1/models lists the model (60 s)
  local i
  for i in $(seq 600); do
    if ! kill -0 "$2" 2>/dev/null; then echo "process $2 died; see $3" >&2; tail -20 "$3" >&2; return 1; fi
    if curl -sf "http://127.0.0.1:$1/v1/models" 2>/dev/null | grep -q "\"$MODEL_NAME\""; then return 0; fi
    sleep 0.1
  done
  echo "model not served on port $1 after 60 s; see $3" >&2
  return 1
}

build_dynamo_venv() {
  if [[ -f "$DYN_VENV/.complete" ]]; then return; fi
  echo "== building $DYN_VENV (once; log in $BENCH/dynamo-venv-build.log)" >&2
  rm -rf "$DYN_VENV"
  exec 3>&2 2>"$BENCH/dynamo-venv-build.log"
  "$BASE_PY" -m venv "$DYN_VENV"
  local pip=("$DYN_VENV/bin/pip" install -q --disable-pip-version-check --no-warn-conflicts)
  "${pip[@]}" --upgrade pip
  "${pip[@]}" ai-dynamo-runtime==1.6.1
  # Plain `pip install ai-dynamo` fails on an unreachable dependency: install it without deps,
  # then what `python -m dynamo.frontend` / `dynamo.mocker` import (kubernetes, redis and
  # aisimulate are not needed for file discovery and the mocker), plus the load generator's
  # optional speedups and matplotlib for the plots.
  "${pip[@]}" --no-deps ai-dynamo==1.6.1
  "${pip[@]}" aiohttp msgspec prometheus-client pyzmq transformers uvloop psutil tqdm zstandard \
    certifi tokenizers matplotlib
  "$DYN_VENV/bin/python" -m dynamo.frontend --help >/dev/null
  "$DYN_VENV/bin/python" -m dynamo.mocker --help >/dev/null
  exec 2>&3 3>&-
  touch "$DYN_VENV/.complete"
}

bench() {  # bench LABEL PORT FRONTEND_PID WORKER_PID
  "$DYN_VENV/bin/python" "$ROOT/scripts/bench_e2e.py" --url "http://127.0.0.1:$2" --model "$MODEL_NAME" \
    --tokenizer "$MODEL" --concurrency 1,16,64,256 --requests-per-level 1000 --max-seconds 20 \
    --max-tokens 100 --prompt-tokens 100-500 --label "$1" --pids "frontend=$3,worker=$4" \
    --json "$OUT/$1.json" ${EXTRA[@]+"${EXTRA[@]}"} || echo "($1: some requests failed)" >&2
}

run_dynamo() {  # run_dynamo ROUND
  local kv=$OUT/dynamo-kv-r$1 fpid wpid
  mkdir -p "$kv"
  echo "== Dynamo 1.6.1, round $1" >&2
  local common=(--discovery-backend file --request-plane tcp --event-plane zmq)
  export DYN_FILE_KV=$kv DYN_TCP_RPC_HOST=127.0.0.1 DYN_TCP_RESPONSE_STREAM_HOST=127.0.0.1 \
    DYN_EVENT_PLANE_HOST=127.0.0.1 DYN_SYSTEM_HOST=127.0.0.1 DYN_LOG=warn
  start "$OUT/dynamo-worker-r$1.log" "$DYN_VENV/bin/python" -m dynamo.mocker --model-path "$MODEL" \
    --model-name "$MODEL_NAME" --speedup-ratio "$SPEEDUP" "${common[@]}"
  wpid=$LAST_PID
  start "$OUT/dynamo-frontend-r$1.log" "$DYN_VENV/bin/python" -m dynamo.frontend \
    --http-host 127.0.0.1 --http-port "$DYN_PORT" "${common[@]}"
  fpid=$LAST_PID
  wait_model "$DYN_PORT" "$fpid" "$OUT/dynamo-frontend-r$1.log"
  bench "dynamo-r$1" "$DYN_PORT" "$fpid" "$wpid"
  stop_all
  unset DYN_FILE_KV DYN_TCP_RPC_HOST DYN_TCP_RESPONSE_STREAM_HOST DYN_EVENT_PLANE_HOST DYN_SYSTEM_HOST DYN_LOG
}

run_ours() {  # run_ours ROUND
  local fpid wpid auth=() key=""
  echo "== dynamo-zmq, round $1${OURS_AUTH_KEYS:+ (CURVE on)}, $HTTP_WORKERS HTTP process(es)" >&2
  if [[ -n "${OURS_AUTH_KEYS:-}" ]]; then
    if [[ ! -f "$OURS_AUTH_KEYS/node.key" ]]; then
      "$OURS_PY" -m dynamo_zmq.keys create "$OURS_AUTH_KEYS" >/dev/null
      "$OURS_PY" -m dynamo_zmq.keys authorize "$OURS_AUTH_KEYS" "$OURS_AUTH_KEYS/node.key" >/dev/null
    fi
    auth=(--auth-keys "$OURS_AUTH_KEYS")
    key=" key=$("$OURS_PY" -m dynamo_zmq.keys public "$OURS_AUTH_KEYS")"
  fi
  start "$OUT/ours-worker-r$1.log" env DYN_MDNS_INTERFACES=127.0.0.1 "$OURS_PY" -m dynamo_zmq.worker \
    --engine mocker --model-path "$MODEL" --model-name "$MODEL_NAME" --speedup-ratio "$SPEEDUP" \
    --host 127.0.0.1 --port "$OURS_WORKER_PORT" --discovery static "${auth[@]}"
  wpid=$LAST_PID
  start "$OUT/ours-frontend-r$1.log" env DYN_MDNS_INTERFACES=127.0.0.1 "$OURS_PY" -m dynamo_zmq.frontend \
    --http-host 127.0.0.1 --http-port "$OURS_PORT" --http-workers "$HTTP_WORKERS" --discovery static \
    --static-workers "tcp://127.0.0.1:$OURS_WORKER_PORT$key" "${auth[@]}"
  fpid=$LAST_PID
  wait_model "$OURS_PORT" "$fpid" "$OUT/ours-frontend-r$1.log"
  bench "ours-r$1" "$OURS_PORT" "$fpid" "$wpid"
  stop_all
}

mkdir -p "$OUT"
build_dynamo_venv
if [[ ! -f "$MODEL/tokenizer.json" ]]; then
  "$OURS_PY" -m dynamo_zmq tiny-model "$MODEL" --vocab-size 3000 >/dev/null
fi
echo "results in $OUT" >&2

for r in $(seq "$ROUNDS"); do
  [[ "$ONLY" == "ours" ]] || run_dynamo "$r"
  [[ "$ONLY" == "dynamo" ]] || run_ours "$r"
done

if [[ -z "$ONLY" ]]; then
  for r in $(seq "$ROUNDS"); do
    if [[ -f "$OUT/ours-r$r.json" && -f "$OUT/dynamo-r$r.json" ]]; then
      echo
      echo "## round $r"
      "$DYN_VENV/bin/python" "$ROOT/scripts/bench_e2e.py" --compare "$OUT/ours-r$r.json" "$OUT/dynamo-r$r.json" \
        --labels "ours,dynamo" --plot "$OUT/compare-r$r.png"
    fi
  done | tee "$OUT/compare.md"
fi
