#!/usr/bin/env bash
# What tracing costs at concurrency 64: dynamo-zmq at a base revision (before tracing) against
# this checkout with OTLP export off and with export on (to a local sink, scripts/otlp_sink.py),
# alternated round by round on the same load (scripts/bench_vs_dynamo.sh --only ours).
#
#   scripts/bench_tracing_cost.sh BASE_REV [bench_e2e.py flags...]
#
# Env: ROUNDS (3), OURS_PY (.venv/bin/python), SINK_PORT (4318). Default load: --concurrency 64
# --requests-per-level 4000 --max-seconds 30; later flags override.
# Results: .bench/results/tracing-<time>/{base,off,on}-rN.json and a table on stdout.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BASE_REV=${1:?usage: $0 BASE_REV [bench_e2e.py flags...]}
shift
ROUNDS=${ROUNDS:-3}
OURS_PY=${OURS_PY:-$ROOT/.venv/bin/python}
SINK_PORT=${SINK_PORT:-4318}
OUT=$ROOT/.bench/results/tracing-$(date +%Y%m%d-%H%M%S)
BASE_TREE=$(mktemp -d /tmp/dynamo-zmq-base.XXXXXX)
LOAD=(--concurrency 64 --requests-per-level 4000 --max-seconds 30 "$@")
mkdir -p "$OUT"

SINK_PID=""
cleanup() {
  [[ -n "$SINK_PID" ]] && kill -TERM "$SINK_PID" 2>/dev/null && wait "$SINK_PID" 2>/dev/null
  git -C "$ROOT" worktree remove --force "$BASE_TREE" 2>/dev/null || rm -rf "$BASE_TREE"
}
trap cleanup EXIT

git -C "$ROOT" worktree add -q --detach "$BASE_TREE" "$BASE_REV"
ln -s "$ROOT/.bench" "$BASE_TREE/.bench"  # the same model dir and Dynamo venv

"$OURS_PY" "$ROOT/scripts/otlp_sink.py" --port "$SINK_PORT" >"$OUT/sink.log" 2>&1 &
SINK_PID=$!

one() {  # one LABEL ROUND TREE [env...]: one bench_vs_dynamo.sh ours round, its JSON kept
  local label=$1 round=$2 tree=$3
  shift 3
  echo "== $label, round $round" >&2
  # From inside the tree: `python -m` puts the working directory first on sys.path.
  (cd "$tree" && env "$@" PYTHONPATH="$tree" OURS_PY="$OURS_PY" ROUNDS=1 \
    bash scripts/bench_vs_dynamo.sh --only ours "${LOAD[@]}" 2>"$OUT/$label-r$round.log")
  cp "$(ls -td "$ROOT"/.bench/results/2*/ | head -1)/ours-r1.json" "$OUT/$label-r$round.json"
}

for r in $(seq "$ROUNDS"); do
  one base "$r" "$BASE_TREE"
  one off "$r" "$ROOT"
  one on "$r" "$ROOT" OTEL_EXPORT_ENABLED=1 \
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT="http://127.0.0.1:$SINK_PORT/v1/traces"
done

kill -TERM "$SINK_PID" && wait "$SINK_PID" || true
SINK_PID=""
cat "$OUT/sink.log" >&2

"$OURS_PY" - "$OUT" "$ROUNDS" <<'EOF'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def level(label, r):
    return json.load(open(f"{out}/{label}-r{r}.json"))["levels"][-1]
def cpu(lv):
    c = lv["cpu_ms_per_req"]
    return c["frontend"] + c["worker"]
print("| round | base tok/s | off tok/s | on tok/s | off/base | on/off | CPU ms/req base / off / on"
      " | on/off CPU | errors base/off/on |")
print("|---|---|---|---|---|---|---|---|---|")
ratios = {"off/base": [], "on/off": [], "cpu off/base": [], "cpu on/off": []}
for r in range(1, rounds + 1):
    b, f, n = level("base", r), level("off", r), level("on", r)
    ratios["off/base"].append(f["out_tok_s"] / b["out_tok_s"])
    ratios["on/off"].append(n["out_tok_s"] / f["out_tok_s"])
    ratios["cpu off/base"].append(cpu(f) / cpu(b))
    ratios["cpu on/off"].append(cpu(n) / cpu(f))
    print(f"| {r} | {b['out_tok_s']:.0f} | {f['out_tok_s']:.0f} | {n['out_tok_s']:.0f}"
          f" | {ratios['off/base'][-1]:.2f}x | {ratios['on/off'][-1]:.2f}x"
          f" | {cpu(b):.2f} / {cpu(f):.2f} / {cpu(n):.2f} | {ratios['cpu on/off'][-1]:.2f}x"
          f" | {b['errors']}/{f['errors']}/{n['errors']} |")
print()
for k, v in ratios.items():
    print(f"median {k}: {statistics.median(v):.2f}x")
EOF
echo "results in $OUT" >&2
