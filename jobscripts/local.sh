#!/usr/bin/env bash
# Run a deck on this machine with mpirun: the rank count comes from the deck's layout.
#   jobscripts/local.sh inputs/data_parallel.deck
#   jobscripts/local.sh inputs/quickstart.deck --set parallel.dp=2 --set train.steps=50
# Environment: LOOM (default: build/loom of this checkout, the installed one), MPIRUN, RANKS.
set -euo pipefail
if [ $# -lt 1 ]; then
  sed -n '2,5p' "$0" >&2
  exit 2
fi
deck=$1
shift
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The loom to run: LOOM, else this checkout's build/loom (jobscripts/ in a source tree), else the
# installed one this script came with (P/share/loom/jobscripts -> P/bin/loom), else loom on PATH.
if [ -n "${LOOM:-}" ]; then
  loom=$LOOM
elif [ -x "$here/build/loom" ]; then
  loom=$here/build/loom
elif [ -x "$here/../../bin/loom" ]; then
  loom=$(cd "$here/../../bin" && pwd)/loom
elif command -v loom >/dev/null 2>&1; then
  loom=$(command -v loom)
else
  echo "jobscripts/local.sh: no loom: not $here/build/loom, not $here/../../bin/loom, none on PATH; set LOOM" >&2
  exit 2
fi
# The layout is dp x cp x tp x pp: ask loom for the resolved deck (with the overrides) and multiply.
resolved=$("$loom" check "$deck" "$@")
section_get() {  # section key
  echo "$resolved" | awk -v s="[$1]" -v k="$2" '
    $0 == s {in_s = 1; next} /^\[/ {in_s = 0}
    in_s && $1 == k {print $3; exit}'
}
dp=$(section_get parallel dp); tp=$(section_get parallel tp); pp=$(section_get parallel pp)
cp=$(section_get parallel cp)
ranks=${RANKS:-$((dp * ${cp:-1} * tp * pp))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
echo "jobscripts/local.sh: $ranks ranks (dp $dp x cp ${cp:-1} x tp $tp x pp $pp) of $loom"
# MPIRUN_NP_FLAG / MPIRUN_PREFLAGS: the launcher's rank-count flag and flags before the program (CTest
# passes CMake's MPIEXEC_NUMPROC_FLAG and MPIEXEC_PREFLAGS).
# shellcheck disable=SC2086
exec "${MPIRUN:-mpirun}" "${MPIRUN_NP_FLAG:--n}" "$ranks" ${MPIRUN_PREFLAGS:-} "$loom" run "$deck" "$@"
