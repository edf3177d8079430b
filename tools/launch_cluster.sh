#!/usr/bin/env bash
# Start one ring stage per host over ssh: one run id, one port set, one session key.
#
#   tools/launch_cluster.sh --hosts 10.0.0.1,10.0.0.2,10.0.0.3 --cuts 10,20 --tokens 64 \
#       --model smollm2_135m --remote-dir ~/splitlab --python ~/splitlab/.venv/bin/python
#
# Host i runs stage i, binds its own address and dials host i+1. Before anything starts, every
# host is checked for a stale listener on its port (a leftover stage holding a port produces a
# diagnostic that points at the wrong node); --kill-stale ends such a listener first and
# verifies the port is free. The session key travels in the environment over ssh, never argv.
set -euo pipefail

HOSTS="" CUTS="" TOKENS=64 MODEL=smollm2_135m BASE_PORT=29500 REMOTE_DIR="~/splitlab"
PY=".venv/bin/python" PROMPT="What is the capital of France?" RUN_ID="" KILL_STALE=0 SSH_USER=""
EXTRA=()
usage() { sed -n '2,11p' "$0"; exit 2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --hosts) HOSTS="$2"; shift 2 ;;
    --cuts) CUTS="$2"; shift 2 ;;
    --tokens) TOKENS="$2"; shift 2 ;;
    --model) MODEL="$2"; shift 2 ;;
    --base-port) BASE_PORT="$2"; shift 2 ;;
    --remote-dir) REMOTE_DIR="$2"; shift 2 ;;
    --python) PY="$2"; shift 2 ;;
    --prompt) PROMPT="$2"; shift 2 ;;
    --run-id) RUN_ID="$2"; shift 2 ;;
    --user) SSH_USER="$2@"; shift 2 ;;
    --kill-stale) KILL_STALE=1; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) usage ;;
    *) echo "unknown option $1" >&2; usage ;;
  esac
done
[[ -n "$HOSTS" && -n "$CUTS" ]] || usage
IFS=, read -r -a HOST_LIST <<< "$HOSTS"
IFS=, read -r -a CUT_LIST <<< "$CUTS"
if (( ${#HOST_LIST[@]} != ${#CUT_LIST[@]} + 1 )); then
  echo "--hosts lists ${#HOST_LIST[@]} hosts for ${#CUT_LIST[@]} cuts (need cuts + 1)" >&2; exit 2
fi
RUN_ID="${RUN_ID:-ring-$(date +%Y%m%d-%H%M%S)}"
KEY="$(python3 -c 'import secrets; print(secrets.token_hex(32))')"
HEAD="${HOST_LIST[0]}"

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

# 2. start the stages, tail first; the head prints the text.
pids=()
for (( i=${#HOST_LIST[@]}-1; i>=0; i-- )); do
  host="${HOST_LIST[$i]}"
  args=(--stage "$i" --model "$MODEL" --cuts "$CUTS" --hosts "$HOSTS" --ctrl-host "$HEAD"
        --base-port "$BASE_PORT" --run-id "$RUN_ID" --run-dir "outputs/$RUN_ID" "${EXTRA[@]}")
  if (( i == 0 )); then args+=(--max-new-tokens "$TOKENS" --prompt "$PROMPT"); fi
  quoted="$(printf ' %q' "${args[@]}")"
  ( ssh "${SSH_USER}${host}" "cd $REMOTE_DIR && SPLITLAB_SESSION_KEY=\$(cat) exec $PY -m splitlab.infer.stage$quoted" \
      <<< "$KEY" 2>&1 | sed "s/^/[stage $i ${host}] /" ) &
  pids+=($!)
done

status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
echo "run $RUN_ID finished with status $status; traces in $REMOTE_DIR/outputs/$RUN_ID/traces on each host"
exit "$status"
