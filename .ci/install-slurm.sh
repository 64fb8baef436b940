#!/usr/bin/env bash
# Installs a single-node Slurm (Debian packages) for the Slurm test tier: slurmctld, slurmd, the client
# commands and munge. Idempotent: does nothing when the commands are already there.
# No systemd is assumed; .ci/slurm/cluster.sh starts the daemons. Measured: ~5-10 s with
# --no-install-recommends on Debian 12 (Slurm 22.05, munge 0.5.15).
set -euo pipefail

need=()
for cmd in sbatch srun scancel squeue sinfo scontrol slurmctld slurmd munged munge; do
    command -v "$cmd" >/dev/null 2>&1 || need+=("$cmd")
done
if [ "${#need[@]}" -eq 0 ]; then
    echo "install-slurm: Slurm and munge already installed ($(dpkg-query -W -f='${Version}' slurmd 2>/dev/null || echo unknown))"
    exit 0
fi
echo "install-slurm: missing ${need[*]}; installing slurmctld slurmd slurm-client munge"
if [ "$(id -u)" -ne 0 ]; then
    echo "install-slurm: needs root for apt-get (running as uid $(id -u))" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
# The munge package creates /etc/munge/munge.key in its postinst; make sure one exists all the same.
if [ ! -s /etc/munge/munge.key ]; then
    mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null \
        || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
fi
echo "install-slurm: installed slurmd $(dpkg-query -W -f='${Version}' slurmd)"
