#pragma once
// What a run writes next to its results: metrics.jsonl (one JSON object per logged step),
// summary.json, and report.json (parameters, platform, build, timings), as ExaMiniMD/miniFE do.
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace loom {

// Creates `dir` (and parents); throws InputError naming run.dir when it cannot.
void make_run_dir(const std::string& dir);

class JsonLines {
 public:
  JsonLines() = default;
  void open(const std::string& path);  // truncates
  void write(const nlohmann::json& record);
  bool is_open() const { return out_.is_open(); }

 private:
  std::ofstream out_;
  std::string path_;
};

void write_json(const std::string& path, const nlohmann::json& value);

// The process's command line, as main() saw it (recorded once, for report.json).
void set_command_line(int argc, char** argv);
const std::vector<std::string>& command_line();

// Host name, OS, CPU model and cores, MPI library.
nlohmann::json platform_info();
// Version, commit, compiler, flags, Kokkos, BLAS, HDF5 (from the generated build_info.hpp).
nlohmann::json build_info();
// "MPICH Version: 4.0.2 ..." first line of MPI_Get_library_version.
std::string mpi_library();

}  // namespace loom
