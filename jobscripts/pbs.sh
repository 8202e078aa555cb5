#!/usr/bin/env bash
# PBS / Torque batch script: one loom run of a deck.
#   qsub -l select=2:ncpus=4:mpiprocs=4 -v DECK=inputs/data_parallel.deck,SETS="--set parallel.dp=8" jobscripts/pbs.sh
# A chain of jobs, each going on from the previous one's checkpoint when it was interrupted:
#   id=$(qsub -v DECK=... jobscripts/pbs.sh); qsub -W depend=afternotok:$id -v DECK=... jobscripts/pbs.sh
# The deck's parallel.dp x cp x tp x pp must equal the number of MPI processes PBS grants.
#
# Defaults, each only when neither SETS nor (for the checkpoint keys) the deck gives the key:
#   run.dir            runs/RUN_NAME/pbs-JOBID (per job)
#   checkpoint.dir     runs/RUN_NAME/checkpoints (the same for every job of a chain)
#   checkpoint.resume  auto: go on from `latest` in checkpoint.dir, or start fresh when there is none
# Environment (qsub -v): DECK (required), SETS (--set arguments), RUN_NAME (default: the deck's file
#   name without .deck, then a digest of SETS when given), THREADS (BLAS threads per rank, default 1: ask for ncpus = mpiprocs x THREADS),
#   LOOM (default build/loom, else loom on PATH), MPIRUN (default mpirun).
# Interruption: loom exits 3 after saving a checkpoint on SIGTERM, and so does this script. PBS has
# no requeue a job may ask for itself (qrerun needs operator rights), so interrupted runs continue in
# the next job of an afternotok chain as above (a failed job, exit 1 or 2, also releases it; that job
# then resumes from the latest checkpoint or fails the same way at once).
#PBS -N loom
#PBS -l select=1:ncpus=2:mpiprocs=2
#PBS -l walltime=01:00:00
#PBS -j oe
set -euo pipefail
cd "${PBS_O_WORKDIR:-.}"
: "${DECK:?set DECK=path/to/deck with qsub -v DECK=...}"
# SETS is a list of --set arguments, split on blanks (and not glob-expanded: tokens:data/*.bin is loom's).
read -r -a sets <<< "${SETS:-}"

# True when the arguments give KEY with --set ("--set KEY=..." or "--set=KEY=...").
sets_key() {
  local key=$1 previous='' arg
  shift
  for arg in "$@"; do
    case "$previous:$arg" in
      --set:"$key"=* | *:--set="$key"=*) return 0 ;;
    esac
    previous=$arg
  done
  return 1
}

# True when the deck file sets SECTION.KEY itself.
deck_sets_key() {
  awk -v section="[${2%%.*}]" -v key="${2#*.}" '
    { sub(/#.*/, ""); gsub(/^[ \t]+|[ \t]+$/, "") }
    /^\[/ { inside = ($0 == section); next }
    inside && index($0, "=") { name = substr($0, 1, index($0, "=") - 1); gsub(/[ \t]+$/, "", name); if (name == key) found = 1 }
    END { exit !found }' "$1"
}

# The run's name keys its checkpoint chain: RUN_NAME, else the deck's file name, followed, when the
# job has overrides, by a digest of them: a job with other --set values starts a chain of its own
# instead of going on from another experiment's checkpoints; the same command continues its own.
if [ -n "${RUN_NAME:-}" ]; then
  run_name=$RUN_NAME
else
  run_name=$(basename "$DECK" .deck)
  if [ ${#sets[@]} -gt 0 ]; then
    run_name="$run_name-$(printf '%08x' "$(printf '%s\n' "${sets[@]}" | cksum | cut -d' ' -f1)")"
  fi
fi
echo "pbs.sh: run name $run_name (checkpoints in runs/$run_name/checkpoints unless the deck or --set names them)"
defaults=()
if ! sets_key run.dir ${sets[@]+"${sets[@]}"}; then
  defaults+=(--set "run.dir=runs/$run_name/pbs-${PBS_JOBID:-local}")
fi
if ! sets_key checkpoint.dir ${sets[@]+"${sets[@]}"} && ! deck_sets_key "$DECK" checkpoint.dir; then
  defaults+=(--set "checkpoint.dir=runs/$run_name/checkpoints")
fi
if ! sets_key checkpoint.resume ${sets[@]+"${sets[@]}"} && ! deck_sets_key "$DECK" checkpoint.resume; then
  defaults+=(--set checkpoint.resume=auto)
fi

ranks=$(wc -l < "${PBS_NODEFILE:-/dev/null}" 2>/dev/null || echo 1)
[ "$ranks" -ge 1 ] || ranks=1
export OMP_NUM_THREADS=${THREADS:-1}
mpirun=${MPIRUN:-mpirun}
# The host file flag depends on the MPI: MPICH's hydra takes -f, Open MPI --hostfile; -machinefile
# is understood by both and by Intel MPI, for anything else.
hostfile=()
if [ -n "${PBS_NODEFILE:-}" ]; then
  case "$("$mpirun" --version 2>&1 || true)" in
    *HYDRA*) hostfile=(-f "$PBS_NODEFILE") ;;
    *"Open MPI"* | *OpenRTE*) hostfile=(--hostfile "$PBS_NODEFILE") ;;
    *) hostfile=(-machinefile "$PBS_NODEFILE") ;;
  esac
fi

# The loom to run: LOOM, else build/loom under the submit directory (a source checkout), else loom on
# PATH (an installed one: P/bin on PATH). The batch system runs a copy of this script, so its own
# folder says nothing.
if [ -n "${LOOM:-}" ]; then
  loom=$LOOM
elif [ -x build/loom ]; then
  loom=build/loom
elif command -v loom >/dev/null 2>&1; then
  loom=$(command -v loom)
else
  echo "pbs.sh: no loom: neither build/loom under $(pwd) nor loom on PATH; set LOOM=/path/to/loom" >&2
  exit 2
fi
# The user's SETS come last, so they would win even over a default added by mistake.
command=("$mpirun" -n "$ranks" ${hostfile[@]+"${hostfile[@]}"} "$loom" run "$DECK"
         ${defaults[@]+"${defaults[@]}"} ${sets[@]+"${sets[@]}"})
echo "pbs.sh: job ${PBS_JOBID:-local}: ${command[*]}"
# loom's own exit status, written by its rank 0: a launcher may lose it (MPICH's mpiexec, signalled,
# often exits 0 though every rank exits 3 after saving its checkpoint). Without a temporary file
# (no writable TMPDIR or /tmp) the launcher's status alone decides, as before.
status_file=$(mktemp "${TMPDIR:-/tmp}/loom-status.XXXXXX" 2>/dev/null || mktemp /tmp/loom-status.XXXXXX 2>/dev/null ||
              true)
if [ -n "$status_file" ]; then
  export LOOM_STATUS_FILE=$status_file
  trap 'rm -f "$status_file"' EXIT
fi
# A signal to the whole job (a scheduler's time limit or cancel) must not end this shell before the
# status is read: a handler, not an ignore, so the launcher and loom still get the signal.
trap ':' TERM INT
status=0
"${command[@]}" || status=$?
loom_status=$(cat "${status_file:-/dev/null}" 2>/dev/null || true)
# loom's 3 (every rank saved its checkpoint) wins over whatever the launcher said; otherwise loom's
# status where the launcher says 0.
if [ -n "$loom_status" ] && [ "$loom_status" != "$status" ] &&
   { [ "$loom_status" = 3 ] || { [ "$status" -eq 0 ] && [ "$loom_status" != 0 ]; }; }; then
  echo "pbs.sh: the launcher exited $status, loom exited $loom_status: taking loom's"
  status=$loom_status
fi
if [ "$status" -eq 3 ]; then
  echo "pbs.sh: loom was interrupted and saved a checkpoint; the next job of the chain (or the same qsub again) resumes from it"
fi
exit "$status"
