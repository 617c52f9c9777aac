#!/usr/bin/env bash
# Run radbo on a real Flower deployment on this machine: one SuperLink and N SuperNodes on
# free 127.0.0.1 ports, `flwr run` of this folder's app, results and logs copied to OUTPUT,
# and every process started stopped again (also on error or Ctrl-C).
#
#   bash examples/flower/deploy_local.sh [N] [CONFIG] [OUTPUT]
#
# N (default 3) SuperNodes, node i started with
# --node-config 'partition-id=i data-root="OUTPUT/nodes/client-i"' (it serves radbo client i
# from its own data, which `radbo flower partition CONFIG --out OUTPUT/nodes` writes first;
# CONFIG's fleet.num_clients must equal N); CONFIG (default: tiny.toml next to this script) is
# the radbo config; OUTPUT (default runs/flower-local) receives results.json, ledger.json,
# status.json, nodes/ and logs/. Environment: PYTHON (default python, the one with
# radbo[flower] installed), NODE_CONFIG (node i's --node-config, {i} = node index; default as
# above), TIMEOUT_S (default 1800), OMP_NUM_THREADS (default 1: one intra-op thread per
# process, as `radbo run` needs to be matched bit for bit).
#
# The processes are started by `python -m radbo.flower.deploy` (radbo/flower/deploy.py, the
# same harness tests/test_flower_deploy.py runs); the commands it runs are printed as it
# starts them. The connection the flwr CLI uses is written to a temporary FLWR_HOME
# (config.toml), removed at exit.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NODES="${1:-3}"
CONFIG="${2:-$HERE/tiny.toml}"
OUTPUT="${3:-runs/flower-local}"
PYTHON="${PYTHON:-python}"
mkdir -p "$OUTPUT"
OUTPUT="$(cd "$OUTPUT" && pwd)"
DEFAULT_NODE_CONFIG="partition-id={i} data-root=\"$OUTPUT/nodes/client-{i}\""
NODE_CONFIG="${NODE_CONFIG:-$DEFAULT_NODE_CONFIG}"
TIMEOUT_S="${TIMEOUT_S:-1800}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

if ! [[ "$NODES" =~ ^[1-9][0-9]*$ ]]; then
    echo "deploy_local.sh: N = '$NODES': give the number of SuperNodes as a positive integer" >&2
    exit 2
fi
if [[ ! -f "$CONFIG" ]]; then
    echo "deploy_local.sh: no radbo config at '$CONFIG': give a TOML file (e.g. $HERE/tiny.toml)" >&2
    exit 2
fi

FLWR_HOME="$(mktemp -d "${TMPDIR:-/tmp}/radbo-flwr-XXXXXX")"
export FLWR_HOME
PID_FILE="$FLWR_HOME/pids"
: >"$PID_FILE"
HARNESS=""

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    # the harness stops its process groups and every process it saw on SIGTERM ...
    if [[ -n "$HARNESS" ]] && kill -0 "$HARNESS" 2>/dev/null; then
        kill -TERM "$HARNESS" 2>/dev/null || true
        for _ in $(seq 1 60); do
            kill -0 "$HARNESS" 2>/dev/null || break
            sleep 0.5
        done
        kill -KILL "$HARNESS" 2>/dev/null || true
    fi
    # ... and whatever it recorded that is still alive (had it been killed) is killed here,
    # by PID, if the PID still runs a Flower program (not a recycled PID)
    while read -r pid; do
        [[ -n "$pid" ]] || continue
        if [[ -r "/proc/$pid/cmdline" ]] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -Eq 'flwr|flower|radbo'; then
            kill -KILL "$pid" 2>/dev/null || true
        fi
    done <"$PID_FILE"
    if [[ -d "$FLWR_HOME/logs" ]]; then
        mkdir -p "$OUTPUT"
        cp -r "$FLWR_HOME/logs" "$OUTPUT/" || true
    fi
    rm -rf "$FLWR_HOME"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# each node's own data (the exact partition `radbo run` makes)
"$PYTHON" -m radbo flower partition "$CONFIG" --out "$OUTPUT/nodes" >/dev/null
# in the background so that the traps run as soon as a signal arrives
"$PYTHON" -m radbo.flower.deploy "$HERE" \
    --nodes "$NODES" \
    --config "$CONFIG" \
    --output "$OUTPUT" \
    --node-config "$NODE_CONFIG" \
    --flwr-home "$FLWR_HOME" \
    --pid-file "$PID_FILE" \
    --timeout "$TIMEOUT_S" &
HARNESS=$!
status=0
wait "$HARNESS" || status=$?
HARNESS=""
if [[ "$status" -eq 0 ]]; then
    echo "deploy_local.sh: run completed; results in $OUTPUT (results.json, status.json, logs/)"
else
    echo "deploy_local.sh: the run did not complete (exit $status); see $OUTPUT/logs and $OUTPUT/status.json" >&2
fi
exit "$status"
