#!/usr/bin/env bash
# A two-node Slurm on one machine, for tests (root; Debian's slurm-wlm, munge, iproute2).
#   scripts/slurm_two_nodes.sh start DIR          # nodes dtf-n1, dtf-n2; controller on dtf-n1
#   scripts/slurm_two_nodes.sh run DIR -- CMD...  # CMD on dtf-n1 (srun, sbatch, sinfo ...), in this process
#   scripts/slurm_two_nodes.sh stop DIR
# Each node is a network namespace (its own address on a veth pair, 10.81.0.1 and .2) with
# its own hostname (UTS namespace) and /etc/hosts (mount namespace). Each node declares 2
# CPUs, so a step can run 2 tasks per node. Slurm reserves ports for every step
# (MpiParams=ports), so tasks get SLURM_STEP_RESV_PORTS. Nothing leaves the veth pair.
set -euo pipefail
action=${1:?start, run or stop}
dir=$(realpath -m "${2:?scratch directory}")
shift 2
nodes=(dtf-n1 dtf-n2)
namespaces=(dtfslurm1 dtfslurm2)

on_node() {  # on_node I CMD...: CMD in node I's namespaces (not `ip netns exec`: it remounts
  local i=$1; shift  # /sys, and slurmd then finds no cgroup file system).
  nsenter --net="/run/netns/${namespaces[$i]}" unshare --uts --mount --propagation private \
    bash -c 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"' \
    bash "$dir/hosts" "${nodes[$i]}" "$@"
}

stop() {
  for pid_file in "$dir"/slurmd-*.pid "$dir/slurmctld.pid"; do
    [ -f "$pid_file" ] && kill "$(cat "$pid_file")" 2>/dev/null || true
  done
  sleep 1
  for ns in "${namespaces[@]}"; do ip netns delete "$ns" 2>/dev/null || true; done
  [ -f "$dir/munge/munged.pid" ] && kill "$(cat "$dir/munge/munged.pid")" 2>/dev/null || true
  return 0
}

case "$action" in
  stop) stop; exit 0 ;;
  run) [ "${1:-}" = "--" ] && shift; export SLURM_CONF="$dir/slurm.conf"  # CMD becomes this process.
    exec nsenter --net="/run/netns/${namespaces[0]}" unshare --uts --mount --propagation private \
      bash -c 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"' \
      bash "$dir/hosts" "${nodes[0]}" "$@" ;;
  start) ;;
  *) echo "unknown action $action: expected start, run or stop" >&2; exit 2 ;;
esac

mkdir -p "$dir/state" "$dir/spool/dtf-n1" "$dir/spool/dtf-n2" "$dir/munge"
. "$(dirname "$0")/munge_start.sh"

ip netns add "${namespaces[0]}"
ip netns add "${namespaces[1]}"
ip link add vdtfslurm1 type veth peer name vdtfslurm2
for i in 0 1; do
  ip link set "vdtfslurm$((i + 1))" netns "${namespaces[$i]}"
  ip -n "${namespaces[$i]}" addr add "10.81.0.$((i + 1))/24" dev "vdtfslurm$((i + 1))"
  ip -n "${namespaces[$i]}" link set "vdtfslurm$((i + 1))" up
  ip -n "${namespaces[$i]}" link set lo up
done
printf '127.0.0.1 localhost\n10.81.0.1 dtf-n1\n10.81.0.2 dtf-n2\n' > "$dir/hosts"

cat > "$dir/slurm.conf" <<CONF
ClusterName=distrib_tf_two
SlurmctldHost=dtf-n1(10.81.0.1)
SlurmUser=root
SlurmctldPort=16827
SlurmdPort=16828
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
MpiParams=ports=12000-12999
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
ReturnToService=2
NodeName=dtf-n1 NodeAddr=10.81.0.1 CPUs=2 RealMemory=10000 State=UNKNOWN
NodeName=dtf-n2 NodeAddr=10.81.0.2 CPUs=2 RealMemory=10000 State=UNKNOWN
PartitionName=debug Nodes=dtf-n[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
export SLURM_CONF="$dir/slurm.conf"
on_node 0 slurmctld -f "$SLURM_CONF"
on_node 0 slurmd -f "$SLURM_CONF"
on_node 1 slurmd -f "$SLURM_CONF"
for _ in $(seq 1 30); do
  if [ "$(on_node 0 sinfo -h -o %T 2>/dev/null | grep -c idle)" -ge 1 ] \
      && [ "$(on_node 0 sinfo -h -N -o %T 2>/dev/null | grep -c idle)" -eq 2 ]; then
    echo "export SLURM_CONF=$SLURM_CONF"
    exit 0
  fi
  sleep 1
done
echo "the two-node slurm did not come up; see $dir/slurm*.log" >&2
stop
exit 1
