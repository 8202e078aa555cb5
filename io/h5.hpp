#pragma once
// A thin RAII layer over the HDF5 C API for the files loom writes and reads (the oracle export now,
// checkpoints later). Paths like "/params/init/wte.weight" create their intermediate groups.
#include <hdf5.h>

#include <cstdint>
#include <string>
#include <vector>

namespace loom::h5 {

class File {
 public:
  // Creates (truncating) `path` for writing on this process alone.
  static File create(const std::string& path);
  ~File();
  File(File&& o) noexcept : id_(o.id_), path_(std::move(o.path_)) { o.id_ = -1; }
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  void write(const std::string& dataset, const float* data, const std::vector<std::int64_t>& shape);
  void write(const std::string& dataset, const double* data, const std::vector<std::int64_t>& shape);
  void write(const std::string& dataset, const std::int32_t* data, const std::vector<std::int64_t>& shape);
  void attr(const std::string& name, std::int64_t value);  // on the root group
  void attr(const std::string& name, double value);
  void attr(const std::string& name, const std::string& value);
  hid_t id() const { return id_; }

 private:
  File(hid_t id, std::string path) : id_(id), path_(std::move(path)) {}
  void write_raw(const std::string& dataset, hid_t type, const void* data, const std::vector<std::int64_t>& shape);
  hid_t id_ = -1;
  std::string path_;
};

}  // namespace loom::h5
