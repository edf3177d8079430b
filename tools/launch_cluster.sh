#!/usr/bin/env bash
# Start one ring stage per host over ssh: one config, one run id, one port set, one session key.
# For edge devices that are not cluster nodes; on a cluster, run the stages as tasks of one
# Slurm job (README, "Sweeps and runs on Slurm").
#
#   tools/launch_cluster.sh --hosts 10.0.0.1,10.0.0.2,10.0.0.3 --remote-dir ~/splitlab \
#       --python ~/splitlab/.venv/bin/python -- architecture.cuts=[10,20] task.max_new_tokens=64
#
# The config is composed here once (`splitlab task=infer <overrides> --cfg job`: the hosts, the
# head as ctrl_host, the base port and everything after `--`), copied to every host's run
# folder, and every host runs the one node command for its stage (`python -m splitlab.node
# --config ... --role stage --rank i`). Host i binds its own address and dials host i+1. Before
# anything starts, every host is checked for a stale listener on its port (a leftover stage
# holding a port produces a diagnostic that points at the wrong node); --kill-stale ends such a
# listener first and verifies the port is free. The session key travels on stdin over ssh into
# the stage's environment, never argv.
set -euo pipefail

HOSTS="" BASE_PORT=29500 REMOTE_DIR="~/splitlab" PY=".venv/bin/python" RUN_ID="" KILL_STALE=0
SSH_USER="" SPLITLAB="${SPLITLAB:-splitlab}" OVERRIDES=()
usage() { sed -n '2,17p' "$0"; exit 2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --hosts) HOSTS="$2"; shift 2 ;;
    --base-port) BASE_PORT="$2"; shift 2 ;;
    --remote-dir) REMOTE_DIR="$2"; shift 2 ;;
    --python) PY="$2"; shift 2 ;;
    --run-id) RUN_ID="$2"; shift 2 ;;
    --user) SSH_USER="$2@"; shift 2 ;;
    --kill-stale) KILL_STALE=1; shift ;;
    --) shift; OVERRIDES=("$@"); break ;;
    -h|--help) usage ;;
    *) echo "unknown option $1" >&2; usage ;;
  esac
done
[[ -n "$HOSTS" ]] || usage
IFS=, read -r -a HOST_LIST <<< "$HOSTS"
RUN_ID="${RUN_ID:-ring-$(date +%Y%m%d-%H%M%S)}"
KEY="$(python3 -c 'import secrets; print(secrets.token_hex(32))')"
HEAD="${HOST_LIST[0]}"
RUN_DIR="outputs/$RUN_ID"

# 0. one config for every stage (a config error stops here, naming the key).
CONFIG="$(mktemp)"
trap 'rm -f "$CONFIG"' EXIT
"$SPLITLAB" task=infer "architecture.peer_hosts=[$HOSTS]" "architecture.stages=${#HOST_LIST[@]}" \
  "architecture.ctrl_host=$HEAD" "architecture.base_port=$BASE_PORT" "${OVERRIDES[@]}" \
  --cfg job > "$CONFIG"

# 1. stale listeners: one port per stage, checked on the host that will bind it.
for i in "${!HOST_LIST[@]}"; do
  host="${HOST_LIST[$i]}" port=$((BASE_PORT + i))
  pids="$(ssh "${SSH_USER}${host}" "ss -Hltnp 'sport = :${port}' | grep -o 'pid=[0-9]*' | cut -d= -f2 | sort -u" || true)"
  if [[ -n "$pids" ]]; then
    if (( KILL_STALE )); then
      echo "stage $i: killing stale listener(s) $pids on ${host}:${port}"
      ssh "${SSH_USER}${host}" "kill $pids; sleep 1; ! ss -Hltn 'sport = :${port}' | grep -q ."
    else
      echo "stage $i: ${host}:${port} is held by pid(s) $pids (a stale stage?); rerun with --kill-stale" >&2
      exit 2
    fi
  fi
done

# 2. the config into every host's run folder.
for host in "${HOST_LIST[@]}"; do
  ssh "${SSH_USER}${host}" "cd $REMOTE_DIR && mkdir -p $RUN_DIR && cat > $RUN_DIR/config.yaml" < "$CONFIG"
done

# 3. start the stages, tail first; the head prints the text.
pids=()
for (( i=${#HOST_LIST[@]}-1; i>=0; i-- )); do
  host="${HOST_LIST[$i]}"
  args=(--config "$RUN_DIR/config.yaml" --role stage --rank "$i" --session "$RUN_ID"
        --run-dir "$RUN_DIR")
  quoted="$(printf ' %q' "${args[@]}")"
  ( ssh "${SSH_USER}${host}" "cd $REMOTE_DIR && SPLITLAB_SESSION_KEY=\$(cat) exec $PY -m splitlab.node$quoted" \
      <<< "$KEY" 2>&1 | sed "s/^/[stage $i ${host}] /" ) &
  pids+=($!)
done

status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
echo "run $RUN_ID finished with status $status; traces in $REMOTE_DIR/outputs/$RUN_ID/traces on each host"
exit "$status"
