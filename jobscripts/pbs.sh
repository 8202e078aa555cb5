#!/usr/bin/env bash
# PBS / Torque batch script: one loom run of a deck.
#   qsub -l select=2:ncpus=4:mpiprocs=4 -v DECK=inputs/data_parallel.deck,SETS="--set parallel.dp=8" jobscripts/pbs.sh
# The deck's parallel.dp x tp x pp must equal the number of MPI processes PBS grants.
#PBS -N loom
#PBS -l select=1:ncpus=2:mpiprocs=2
#PBS -l walltime=01:00:00
#PBS -j oe
set -euo pipefail
cd "${PBS_O_WORKDIR:-.}"
: "${DECK:?set DECK=path/to/deck with qsub -v DECK=...}"
ranks=$(wc -l < "${PBS_NODEFILE:-/dev/null}" 2>/dev/null || echo 1)
[ "$ranks" -ge 1 ] || ranks=1
export OMP_NUM_THREADS=1
# shellcheck disable=SC2086  # SETS is a list of --set arguments
mpirun -n "$ranks" ${PBS_NODEFILE:+-f "$PBS_NODEFILE"} "${LOOM:-build/loom}" run "$DECK" ${SETS:-} \
  --set run.dir="runs/pbs-${PBS_JOBID:-local}"
