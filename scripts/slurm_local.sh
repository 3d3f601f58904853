#!/usr/bin/env bash
# Start or stop a one-node Slurm on this machine, for tests (root; Debian's slurm-wlm, munge).
#   scripts/slurm_local.sh start DIR   # prints `export SLURM_CONF=DIR/slurm.conf`
#   scripts/slurm_local.sh stop DIR
# Nodes talk over 127.0.0.1 only (NodeAddr), on non-default ports.
set -euo pipefail
action=${1:?start or stop}
dir=$(realpath -m "${2:?scratch directory}")

stop() {
  for pid_file in "$dir/slurmd.pid" "$dir/slurmctld.pid"; do
    [ -f "$pid_file" ] && kill "$(cat "$pid_file")" 2>/dev/null || true
  done
  [ -f "$dir/munge/munged.pid" ] && kill "$(cat "$dir/munge/munged.pid")" 2>/dev/null || true
  return 0
}

if [ "$action" = stop ]; then stop; exit 0; fi

mkdir -p "$dir/state" "$dir/spool" "$dir/munge"
. "$(dirname "$0")/munge_start.sh"
node=$(hostname)
cat > "$dir/slurm.conf" <<CONF
ClusterName=distrib_tf_test
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
SlurmctldPort=16817
SlurmdPort=16818
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ReturnToService=2
NodeName=$node NodeAddr=127.0.0.1 CPUs=2 RealMemory=20000 State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
export SLURM_CONF="$dir/slurm.conf"
slurmctld -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"
for _ in $(seq 1 30); do
  if sinfo -h -o %T 2>/dev/null | grep -q idle; then
    echo "export SLURM_CONF=$SLURM_CONF"
    exit 0
  fi
  sleep 1
done
echo "slurm did not come up; see $dir/slurmctld.log and $dir/slurmd.log" >&2
stop
exit 1
