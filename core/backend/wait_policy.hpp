#pragma once
// How a multi-threaded rank's idle OpenMP threads wait (oneDNN's and loom's threads run on libgomp,
// which reads OMP_WAIT_POLICY once, when it loads). Spinning costs nothing on cores of one's own;
// on cores that loom's own ranks share, each rank's spinning threads take the cores the others need
// (2 ranks x 2 threads on 2 cores, bench model: 177-2215 tokens/s spinning against 4080-4397
// sleeping, docs/benchmarks.md). Before anything else starts, when the caller has set neither
// OMP_WAIT_POLICY nor GOMP_SPINCOUNT and this node's ranks x threads exceed the CPUs this process
// may run on, loom re-executes itself with OMP_WAIT_POLICY=PASSIVE. Ranks per node come from the
// launcher (MPI_LOCALNRANKS, OMPI_COMM_WORLD_LOCAL_SIZE, SLURM_NTASKS_PER_NODE), threads from
// OMP_NUM_THREADS or SLURM_CPUS_PER_TASK (what run.threads = auto takes). A core shared with another
// job cannot be seen from here: set OMP_WAIT_POLICY=PASSIVE on such nodes (docs/clusters.md).
namespace loom {
// Returns only if no re-exec was needed (or it failed).
void select_wait_policy(char** argv);
// What was decided, for the banner and report: "OMP_WAIT_POLICY=PASSIVE set by loom (...)",
// "OMP_WAIT_POLICY=... (set by the caller)", or "" (libgomp's default: spin a while, then sleep).
const char* wait_policy_note();
}  // namespace loom
