#!/usr/bin/env bash
# A single-node SLURM cluster on this machine, and allgrad's ranks under srun and sbatch.
#
#   sudo scripts/launch/slurm_local.sh          (root: it installs packages and starts daemons)
#
# 1. Installs Debian's slurm-wlm and munge (apt-get) unless present.
# 2. Creates a munge key if none exists and starts munged as the munge user.
# 3. Writes a slurm.conf (this host as the only node, SlurmUser=root,
#    ProctrackType=proctrack/linuxproc, TaskPlugin=task/none, SelectType=select/cons_tres)
#    into a temporary state folder (SLURM_CONF points at it; /etc/slurm is not touched) and
#    starts slurmctld and slurmd.
# 4. Runs `srun -n 2 train --config configs/vectors.yaml` WITHOUT MASTER_ADDR/MASTER_PORT or
#    ALLGRAD_JOB_TOKEN (allgrad derives them from SLURM_JOB_NODELIST and SLURM_JOB_ID), then
#    `launch` on the same config for comparison, then an sbatch script with srun inside on the
#    vectors config and on a short image (SimCLR, Fashion-MNIST) run.
# 5. Stops the daemons it started (by their pid files) on exit, success or not.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
[ "$(id -u)" = 0 ] || { echo "run as root (apt-get, munged, slurmd)" >&2; exit 2; }

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurm-wlm munge
fi
# ALLGRAD_BIN_DIR=target/debug uses binaries built already (default: build target/release).
BIN="${ALLGRAD_BIN_DIR:-}"
if [ -z "$BIN" ]; then cargo build --release --bin train --bin launch; BIN=target/release; fi

STATE="$(mktemp -d "${TMPDIR:-/tmp}/allgrad-slurm.XXXXXX")"
chmod 755 "$STATE"
HOST="$(hostname -s)"
export SLURM_CONF="$STATE/slurm.conf"
MUNGE_PID=""

stop() {
    for f in "$STATE/slurmd.pid" "$STATE/slurmctld.pid"; do
        [ -s "$f" ] && kill "$(cat "$f")" 2>/dev/null || true
    done
    [ -n "$MUNGE_PID" ] && kill "$MUNGE_PID" 2>/dev/null || true
    echo "daemons stopped; logs and outputs in $STATE"
}
trap stop EXIT

# munge: a key readable only by the munge user, and munged running as that user.
if [ ! -s /etc/munge/munge.key ]; then
    if command -v mungekey >/dev/null; then mungekey --create --keyfile /etc/munge/munge.key
    else dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none; fi
fi
chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
mkdir -p /run/munge /var/log/munge /var/lib/munge && chown munge:munge /run/munge /var/log/munge /var/lib/munge
if ! munge -n >/dev/null 2>&1; then
    runuser -u munge -- /usr/sbin/munged --force
    sleep 1
    MUNGE_PID="$(cat /run/munge/munged.pid)"
fi
munge -n | unmunge | grep -q "STATUS: *Success" && echo "munge works"

cat >"$SLURM_CONF" <<CONF
ClusterName=allgrad
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
SlurmctldPort=${SLURMCTLD_PORT:-6817}
SlurmdPort=${SLURMD_PORT:-6818}
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=$HOST CPUs=$(nproc) State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
mkdir -p "$STATE/ctld" "$STATE/spool"
slurmctld -c -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"
for _ in $(seq 1 60); do sinfo -h -o %T 2>/dev/null | grep -qE "idle|mixed" && break; sleep 1; done
sinfo
echo "slurm: $(sinfo -V)"

unset MASTER_ADDR MASTER_PORT ALLGRAD_JOB_TOKEN RANK WORLD_SIZE
echo "== srun -n 2 train --config configs/vectors.yaml (no MASTER_ADDR, MASTER_PORT, ALLGRAD_JOB_TOKEN)"
srun -n 2 "$BIN/train" --config configs/vectors.yaml --output-dir "$STATE/srun" | tee "$STATE/srun.txt"
"$BIN/launch" --nproc-per-node 2 "$BIN/train" --config configs/vectors.yaml \
    --output-dir "$STATE/launch" | tee "$STATE/launch.txt"
loss() { grep -o 'last loss [0-9.eE+-]*' "$1"; }
echo "srun:   $(loss "$STATE/srun.txt")"
echo "launch: $(loss "$STATE/launch.txt")"
[ "$(loss "$STATE/srun.txt")" = "$(loss "$STATE/launch.txt")" ] || { echo "the losses differ" >&2; exit 1; }

echo "== sbatch (srun inside): vectors, then a short SimCLR image run"
cat >"$STATE/job.sbatch" <<JOB
#!/bin/bash
#SBATCH --job-name=allgrad
#SBATCH --ntasks=2
#SBATCH --output=$STATE/sbatch-%j.out
cd "$ROOT"
srun "$BIN/train" --config configs/vectors.yaml --output-dir "$STATE/sbatch-vectors"
srun "$BIN/train" --config configs/simclr.yaml --set train.global_batch=64 --stop-after 3 \\
    --output-dir "$STATE/sbatch-simclr"
JOB
sbatch --wait "$STATE/job.sbatch"
cat "$STATE"/sbatch-*.out
grep -q "trained 64 of 64 steps on 2 rank" "$STATE"/sbatch-*.out && grep -q "trained 3 of" "$STATE"/sbatch-*.out \
    && echo "sbatch: both runs trained"
