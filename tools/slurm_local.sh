#!/usr/bin/env bash
# A one-node Slurm cluster on this machine (munge, MariaDB, slurmdbd, slurmctld, slurmd), as root.
#
#   tools/slurm_local.sh up        # install what is missing (apt-get), write the config, start
#   tools/slurm_local.sh status    # what runs; exit 0 when the cluster takes jobs
#   tools/slurm_local.sh down      # cancel every job, stop what `up` started, remove its folder
#   export SLURM_CONF=/var/tmp/splitlab-slurm/etc/slurm.conf   # then sbatch/sacct/splitlab -m ...
#
# Everything lives in one folder, $SPLITLAB_SLURM_DIR (default /var/tmp/splitlab-slurm): config,
# munge key and socket, spool, state, logs, pid files and, when it had to start one, MariaDB's
# data. A MariaDB that already answers on 127.0.0.1:$SPLITLAB_SLURM_DB_PORT (default 3306,
# root without a password) is used, never stopped; `down` drops only the accounting database
# it created there. The node advertises $SPLITLAB_SLURM_CPUS CPUs (default: the larger of 16 and
# the real count) so a sweep's jobs are scheduled as on a cluster node; they share the real cores.
# ProctrackType=proctrack/linuxproc and TaskPlugin=task/none leave cgroups to the testbed.
# `up` is idempotent: it starts only what is not running. tests/integration/test_slurm.py and
# .ci/run drive it.
set -euo pipefail

DIR="${SPLITLAB_SLURM_DIR:-/var/tmp/splitlab-slurm}"
DB_PORT="${SPLITLAB_SLURM_DB_PORT:-3306}"
CPUS="${SPLITLAB_SLURM_CPUS:-$(( $(nproc) > 16 ? $(nproc) : 16 ))}"
DB_NAME="splitlab_slurm_acct" DB_USER="splitlab_slurm" DB_PASS="splitlab_slurm"
CLUSTER="splitlab" NODE="$(hostname -s)"
export SLURM_CONF="$DIR/etc/slurm.conf"

log() { echo "slurm_local: $*" >&2; }
trap 'log "failed at line $LINENO: $BASH_COMMAND (logs in $DIR/log)"' ERR
die() { log "$*"; exit 1; }
alive() { [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
db_up() { mysqladmin --connect-timeout=2 --protocol=tcp -h 127.0.0.1 -P "$DB_PORT" -u root ping >/dev/null 2>&1; }
db() { mysql --protocol=tcp -h 127.0.0.1 -P "$DB_PORT" -u root -e "$1"; }
wait_for() {  # wait_for SECONDS WHAT CMD...: poll CMD until it succeeds
  local limit="$1" what="$2"; shift 2
  local deadline=$((SECONDS + limit))
  while (( SECONDS < deadline )); do "$@" >/dev/null 2>&1 && return 0; sleep 0.5; done
  die "$what did not come up within ${limit}s (logs in $DIR/log)"
}

install_missing() {
  local want=()
  command -v munged >/dev/null || want+=(munge)
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
    || want+=(slurm-wlm)
  command -v slurmdbd >/dev/null || want+=(slurmdbd)
  command -v mysql >/dev/null || want+=(mariadb-client)
  if ! db_up && ! command -v mariadbd >/dev/null; then want+=(mariadb-server); fi
  if (( ${#want[@]} )); then
    log "installing ${want[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${want[@]}" >/dev/null
  fi
}

write_config() {
  mkdir -p "$DIR"/{etc,munge,log,run,spool,state}
  chmod 755 "$DIR" "$DIR/munge"
  local mem_mb; mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
  cat > "$DIR/etc/slurm.conf" <<EOF
# written by tools/slurm_local.sh: one node, this machine
ClusterName=$CLUSTER
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePass=$DIR/munge/munge.socket
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
MinJobAge=60
InactiveLimit=0
SchedulerParameters=sched_interval=2
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  cat > "$DIR/etc/slurmdbd.conf" <<EOF
# written by tools/slurm_local.sh
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket
DbdAddr=127.0.0.1
DbdHost=$NODE
SlurmUser=root
PidFile=$DIR/run/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=$DB_USER
StoragePass=$DB_PASS
StorageLoc=$DB_NAME
EOF
  chmod 600 "$DIR/etc/slurmdbd.conf"
}

start_munge() {
  alive "$DIR/run/munged.pid" && return 0
  [[ -s "$DIR/munge/munge.key" ]] || { dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1 count=1024 status=none; }
  chmod 400 "$DIR/munge/munge.key"
  munged --force --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket" \
    --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log" \
    --seed-file="$DIR/munge/munged.seed"
  wait_for 10 munged test -S "$DIR/munge/munge.socket"
}

start_mariadb() {
  if ! db_up && ! alive "$DIR/run/mariadbd.pid"; then
    log "no MariaDB on 127.0.0.1:$DB_PORT: starting one with its data in $DIR/mysql"
    if [[ ! -d "$DIR/mysql/mysql" ]]; then
      mariadb-install-db --no-defaults --user=root --datadir="$DIR/mysql" --auth-root-authentication-method=normal \
        >"$DIR/log/mariadb-install.log" 2>&1
    fi
    mariadbd --no-defaults --user=root --datadir="$DIR/mysql" --bind-address=127.0.0.1 --port="$DB_PORT" \
      --socket="$DIR/run/mysqld.sock" --pid-file="$DIR/run/mariadbd.pid" \
      --log-error="$DIR/log/mariadb.log" </dev/null >/dev/null 2>&1 &
    disown
  fi
  wait_for 60 MariaDB db_up
  db "CREATE DATABASE IF NOT EXISTS $DB_NAME;
      CREATE USER IF NOT EXISTS '$DB_USER'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
      CREATE USER IF NOT EXISTS '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASS';
      GRANT ALL ON $DB_NAME.* TO '$DB_USER'@'127.0.0.1';
      GRANT ALL ON $DB_NAME.* TO '$DB_USER'@'localhost';"
}

takes_jobs() { timeout 5 sinfo -h -n "$NODE" -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; }
sacct_answers() { timeout 5 sacct -n -X -S now >/dev/null 2>&1; }

start_slurm() {
  if ! alive "$DIR/run/slurmdbd.pid"; then slurmdbd; fi
  wait_for 60 slurmdbd timeout 5 sacctmgr -n list cluster
  sacctmgr -i -Q add cluster "$CLUSTER" >/dev/null 2>&1 || true
  if ! alive "$DIR/run/slurmctld.pid"; then slurmctld; fi
  if ! alive "$DIR/run/slurmd.pid"; then slurmd -N "$NODE"; fi
  wait_for 60 "slurmd ($NODE idle)" takes_jobs
  wait_for 30 "sacct" sacct_answers
}

up() {
  [[ $EUID -eq 0 ]] || die "run as root (it installs packages and starts daemons)"
  install_missing
  write_config
  start_munge
  start_mariadb
  start_slurm
  log "up: node $NODE with $CPUS CPUs; export SLURM_CONF=$SLURM_CONF"
}

stop_pid() {  # stop_pid NAME: TERM the pid in run/NAME.pid, KILL after 15 s
  local file="$DIR/run/$1.pid" pid
  alive "$file" || return 0
  pid="$(cat "$file")"
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.5; done
  log "$1 ($pid) ignored TERM: killing it"
  kill -9 "$pid" 2>/dev/null || true
}

down() {
  [[ -d "$DIR" ]] || { log "down: nothing under $DIR"; return 0; }
  if alive "$DIR/run/slurmctld.pid"; then
    scancel --full -p debug 2>/dev/null || true
    for _ in $(seq 1 60); do [[ -z "$(squeue -h -o %i 2>/dev/null)" ]] && break; sleep 0.5; done
  fi
  stop_pid slurmd
  stop_pid slurmctld
  stop_pid slurmdbd
  if alive "$DIR/run/mariadbd.pid"; then
    stop_pid mariadbd
  elif db_up; then
    db "DROP DATABASE IF EXISTS $DB_NAME; DROP USER IF EXISTS '$DB_USER'@'127.0.0.1';
        DROP USER IF EXISTS '$DB_USER'@'localhost';" || true
  fi
  stop_pid munged
  rm -rf "$DIR"
  log "down: stopped and removed $DIR"
}

status() {
  local name rc=0
  for name in munged mariadbd slurmdbd slurmctld slurmd; do
    if alive "$DIR/run/$name.pid"; then
      echo "$name: running (pid $(cat "$DIR/run/$name.pid"))"
    elif [[ $name == mariadbd ]] && db_up; then
      echo "mariadbd: not ours; a MariaDB answers on 127.0.0.1:$DB_PORT"
    else
      echo "$name: stopped"; rc=1
    fi
  done
  if (( rc == 0 )) && takes_jobs; then sinfo; else rc=1; fi
  return "$rc"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) sed -n '2,18p' "$0"; exit 2 ;;
esac
