#include "io/h5.hpp"

#include <stdexcept>

namespace loom::h5 {
namespace {
[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw std::runtime_error("HDF5 file '" + path + "': " + what);
}
}  // namespace

File File::create(const std::string& path) {
  hid_t id = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  if (id < 0) fail(path, "cannot be created");
  return File(id, path);
}

File::~File() {
  if (id_ >= 0) H5Fclose(id_);
}

void File::write_raw(const std::string& dataset, hid_t type, const void* data, const std::vector<std::int64_t>& shape) {
  std::vector<hsize_t> dims(shape.begin(), shape.end());
  hid_t space = H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr);
  hid_t lcpl = H5Pcreate(H5P_LINK_CREATE);
  H5Pset_create_intermediate_group(lcpl, 1);
  hid_t ds = H5Dcreate2(id_, dataset.c_str(), type, space, lcpl, H5P_DEFAULT, H5P_DEFAULT);
  H5Pclose(lcpl);
  if (ds < 0) {
    H5Sclose(space);
    fail(path_, "cannot create dataset " + dataset);
  }
  const herr_t st = H5Dwrite(ds, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data);
  H5Dclose(ds);
  H5Sclose(space);
  if (st < 0) fail(path_, "cannot write dataset " + dataset);
}

void File::write(const std::string& d, const float* p, const std::vector<std::int64_t>& s) {
  write_raw(d, H5T_NATIVE_FLOAT, p, s);
}
void File::write(const std::string& d, const double* p, const std::vector<std::int64_t>& s) {
  write_raw(d, H5T_NATIVE_DOUBLE, p, s);
}
void File::write(const std::string& d, const std::int32_t* p, const std::vector<std::int64_t>& s) {
  write_raw(d, H5T_NATIVE_INT32, p, s);
}

namespace {
void write_attr(hid_t obj, const std::string& path, const std::string& name, hid_t type, const void* value) {
  hid_t space = H5Screate(H5S_SCALAR);
  hid_t a = H5Acreate2(obj, name.c_str(), type, space, H5P_DEFAULT, H5P_DEFAULT);
  if (a < 0) {
    H5Sclose(space);
    fail(path, "cannot create attribute " + name);
  }
  H5Awrite(a, type, value);
  H5Aclose(a);
  H5Sclose(space);
}
}  // namespace

void File::attr(const std::string& name, std::int64_t v) { write_attr(id_, path_, name, H5T_NATIVE_INT64, &v); }
void File::attr(const std::string& name, double v) { write_attr(id_, path_, name, H5T_NATIVE_DOUBLE, &v); }
void File::attr(const std::string& name, const std::string& v) {
  hid_t type = H5Tcopy(H5T_C_S1);
  H5Tset_size(type, v.size() + 1);
  H5Tset_strpad(type, H5T_STR_NULLTERM);
  write_attr(id_, path_, name, type, v.c_str());
  H5Tclose(type);
}

}  // namespace loom::h5
