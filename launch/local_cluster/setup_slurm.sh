#!/usr/bin/env bash
# A one-node Slurm cluster on this machine (root, Debian 12 packages of Slurm 22.05), enough for
# `sbatch --wait launch/slurm.sbatch` and the Slurm test in tests/integration/.
#
#   sudo launch/local_cluster/setup_slurm.sh        # safe to run again: does only what is missing
#
# Installs munge, slurmctld, slurmd and slurm-client; creates a munge key; writes
# /etc/slurm/slurm.conf (one node = this host, all its CPUs, partition "debug") and
# /etc/slurm/cgroup.conf (needed even without cgroup confinement: CgroupPlugin=disabled stops
# slurmd from starting); starts munged, slurmctld and slurmd; waits until the node is idle.
# A job credential lives 10 s here (AuthInfo=cred_expire, Slurm's default 120 s), and a requeued
# job waits that long before it may start again: slurmd refuses to start a job whose previous
# start's credential it still holds as revoked ("Job credential revoked"), so a requeued job
# forced to start at once fails. A production cluster keeps its own setting.
#
# Environment (defaults): PARTITION (debug), WAIT_S (90, seconds to wait for the node).
set -euo pipefail

PARTITION=${PARTITION:-debug}
WAIT_S=${WAIT_S:-90}
[[ $(id -u) -eq 0 ]] || { echo "error: run as root" >&2; exit 1; }

log() { echo "setup_slurm: $*"; }

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
        || ! command -v munged >/dev/null; then
    log "installing munge and Slurm packages"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends munge slurmctld slurmd slurm-client >/dev/null
fi

# munge: a random key readable only by the munge user, then the daemon.
if [[ ! -s /etc/munge/munge.key ]]; then
    log "creating /etc/munge/munge.key"
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
fi
chown munge:munge /etc/munge/munge.key
chmod 400 /etc/munge/munge.key
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge:munge /run/munge /var/log/munge /var/lib/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    log "starting munged"
    runuser -u munge -- /usr/sbin/munged || /usr/sbin/munged --force
    for _ in $(seq 20); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.5; done
    munge -n | unmunge >/dev/null
fi

host=$(hostname -s)
cpus=$(nproc)
mem_mib=$(awk '/^MemTotal:/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm

conf=$(cat <<CONF
# One-node cluster written by launch/local_cluster/setup_slurm.sh
ClusterName=local
SlurmctldHost=${host}
SlurmUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
NodeName=${host} CPUs=${cpus} RealMemory=${mem_mib} State=UNKNOWN
PartitionName=${PARTITION} Nodes=${host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
)
cgroup=$(cat <<CONF
# Written by launch/local_cluster/setup_slurm.sh: no confinement, but slurmd needs the file.
CgroupPlugin=cgroup/v1
CgroupAutomount=no
ConstrainCores=no
ConstrainRAMSpace=no
CONF
)
changed=0
if [[ "$(cat /etc/slurm/slurm.conf 2>/dev/null)" != "$conf" ]]; then
    log "writing /etc/slurm/slurm.conf (node ${host}, ${cpus} CPUs, ${mem_mib} MiB)"
    printf '%s\n' "$conf" > /etc/slurm/slurm.conf
    changed=1
fi
if [[ "$(cat /etc/slurm/cgroup.conf 2>/dev/null)" != "$cgroup" ]]; then
    printf '%s\n' "$cgroup" > /etc/slurm/cgroup.conf
    changed=1
fi

running() { [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

if [[ $changed -eq 1 ]] && { running /run/slurmctld.pid || running /run/slurmd.pid; }; then
    # a restart, not `scontrol reconfigure`: AuthInfo is read only when a daemon starts
    log "configuration changed: restarting slurmctld and slurmd"
    for pidfile in /run/slurmctld.pid /run/slurmd.pid; do
        running "$pidfile" && kill "$(cat "$pidfile")"
    done
    for _ in $(seq 60); do
        running /run/slurmctld.pid || running /run/slurmd.pid || break
        sleep 0.5
    done
fi
if ! running /run/slurmctld.pid; then
    log "starting slurmctld"
    slurmctld
fi
for _ in $(seq 30); do scontrol ping >/dev/null 2>&1 && break; sleep 0.5; done
if ! running /run/slurmd.pid; then
    log "starting slurmd"
    slurmd
fi

state=""
for _ in $(seq "$WAIT_S"); do
    state=$(sinfo -h -N -n "$host" -o '%T' 2>/dev/null | head -n1 || true)
    case "$state" in
        idle|mixed|allocated) break ;;
        down*|drain*|drained*)
            scontrol update NodeName="$host" State=RESUME >/dev/null 2>&1 || true ;;
    esac
    sleep 1
done
case "$state" in
    idle|mixed|allocated) log "node ${host} is ${state}"; sinfo ;;
    *) echo "setup_slurm: node ${host} is '${state}' after ${WAIT_S}s; see /var/log/slurm/" >&2; exit 1 ;;
esac
