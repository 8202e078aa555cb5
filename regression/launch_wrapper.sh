#!/usr/bin/env bash
# A stand-in MPI launcher: records each launch, then becomes the real one. Point CMake at it to check
# that every test starts its ranks through MPIEXEC_EXECUTABLE (regression/launcher_check.py does, and
#   cmake -B build -DMPIEXEC_EXECUTABLE=$PWD/regression/launch_wrapper.sh && ctest --test-dir build
# runs the whole suite through it).
#   LOOM_LAUNCH_LOG      file that gets one line per launch: "pid argv..." (default: none)
#   LOOM_REAL_MPIEXEC    the launcher to run (default: mpiexec on PATH)
if [ -n "${LOOM_LAUNCH_LOG:-}" ]; then
  printf '%s %s\n' "$$" "$*" >>"$LOOM_LAUNCH_LOG"
fi
exec "${LOOM_REAL_MPIEXEC:-mpiexec}" "$@"
