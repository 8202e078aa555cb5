#include "io/report.hpp"

#include <mpi.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <filesystem>
#include <thread>

#include "core/base/error.hpp"
#include "loom/build_info.hpp"

namespace loom {

void make_run_dir(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw InputError("run.dir = " + quote_path(dir) + ": cannot create the directory (" + ec.message() + ")");
}

void JsonLines::open(const std::string& path) {
  path_ = path;
  out_.open(path, std::ios::trunc);
  if (!out_) throw InputError("cannot write " + quote_path(path) + " (check run.dir)");
}

void JsonLines::write(const nlohmann::json& record) {
  out_ << record.dump() << '\n';
  out_.flush();
}

void write_json(const std::string& path, const nlohmann::json& value) {
  std::ofstream out(path, std::ios::trunc);
  if (!out) throw InputError("cannot write " + quote_path(path) + " (check run.dir)");
  out << value.dump(2) << '\n';
}

namespace {
std::vector<std::string>& command_line_storage() {
  static std::vector<std::string> args;
  return args;
}
}  // namespace

void set_command_line(int argc, char** argv) { command_line_storage().assign(argv, argv + argc); }
const std::vector<std::string>& command_line() { return command_line_storage(); }

std::string mpi_library() {
  char buf[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(buf, &len);
  std::string s(buf, static_cast<std::size_t>(len));
  auto nl = s.find('\n');
  if (nl != std::string::npos) s.resize(nl);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.pop_back();
  return s;
}

nlohmann::json platform_info() {
  nlohmann::json p;
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  p["hostname"] = host;
  struct utsname u {};
  if (uname(&u) == 0) p["os"] = std::string(u.sysname) + " " + u.release + " " + u.machine;
  std::ifstream cpu("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpu, line)) {
    if (line.rfind("model name", 0) == 0) {
      auto c = line.find(':');
      if (c != std::string::npos) p["cpu"] = line.substr(c + 2);
      break;
    }
  }
  p["hardware_threads"] = std::thread::hardware_concurrency();
  int ranks = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  p["mpi_ranks"] = ranks;
  p["mpi_library"] = mpi_library();
  return p;
}

nlohmann::json build_info() {
  return {{"version", build::version},     {"git_commit", build::git_commit}, {"build_type", build::build_type},
          {"compiler", build::compiler},   {"cxx_flags", build::cxx_flags},   {"kokkos", build::kokkos_origin},
          {"blas", build::blas_libraries}, {"hdf5", build::hdf5_version}};
}

}  // namespace loom
