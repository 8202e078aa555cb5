#include "core/backend/blas_core.hpp"

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>

extern "C" char* openblas_get_corename(void) __attribute__((weak));

namespace loom {
namespace {
std::string g_note;
}

void select_openblas_core(char** argv) {
  if (const char* set = std::getenv("LOOM_OPENBLAS_CORE_NOTE")) g_note = set;  // after our own re-exec
  if (!openblas_get_corename || std::getenv("OPENBLAS_CORETYPE")) return;
  const std::string core = openblas_get_corename();
  const bool generic = core == "Prescott" || core == "Core2" || core == "Penryn" || core == "Dunnington" ||
                       core == "Nehalem" || core == "Sandybridge";
  if (!generic) return;
  __builtin_cpu_init();
  const char* better = nullptr;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
    better = "SkylakeX";
  else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    better = "Haswell";
  if (!better) return;
  const std::string note = std::string("OPENBLAS_CORETYPE=") + better + " set by loom (OpenBLAS detected " + core +
                           " but the CPU supports " + (std::strcmp(better, "SkylakeX") == 0 ? "AVX-512" : "AVX2") +
                           "; set OPENBLAS_CORETYPE yourself to choose)";
  setenv("OPENBLAS_CORETYPE", better, 1);
  setenv("LOOM_OPENBLAS_CORE_NOTE", note.c_str(), 1);
  // Exec the real path (not /proc/self/exe) so the process keeps its name for ps, top and pkill.
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n > 0) {
    self[n] = '\0';
    execv(self, argv);  // returns only on failure: carry on with the slow kernels
  }
  g_note = "OpenBLAS core " + core + " (re-exec with OPENBLAS_CORETYPE failed)";
}

const char* openblas_core_note() { return g_note.c_str(); }

}  // namespace loom
