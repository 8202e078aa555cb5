#pragma once
// run.tensorboard: the run's metrics as a TensorBoard event file, written by hand (no TensorFlow or
// protobuf library to build against). The file is a sequence of TFRecords, each an `Event` message:
//   record = uint64 LE length, uint32 masked CRC32C(length), data, uint32 masked CRC32C(data)
// with mask(c) = ((c >> 15) | (c << 17)) + 0xa282ead8 and CRC32C the Castagnoli CRC.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace loom {

// CRC32C (Castagnoli, reflected polynomial 0x82F63B78): CRC32C("123456789") = 0xE3069283.
std::uint32_t crc32c(const void* data, std::size_t size);
// The masked CRC TFRecord stores: a CRC of data that holds CRCs is then not itself a CRC of them.
std::uint32_t masked_crc32c(const void* data, std::size_t size);

// Every number of a metrics row as a TensorBoard tag: nested objects joined with '/' ("times_ms/forward"),
// array elements by index ("spike/batches_skipped/0"), booleans as 0 or 1; strings and nulls left out,
// and the top-level "step", which is the event's step. Derived from the row, so a number added to
// metrics.jsonl later appears without a change here.
std::vector<std::pair<std::string, double>> tensorboard_scalars(const nlohmann::json& row);

// An I/O failure on the event file: "cannot write 'FILE': REASON (run.tensorboard)".
struct TensorBoardError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class TensorBoardWriter {
 public:
  // Creates events.out.tfevents.<unix seconds>.<hostname> in `dir` (".2", ".3", ... appended when that
  // exists: an earlier run's file is never replaced), writes the file_version event, then a SessionLog
  // START at `first_step`, which makes TensorBoard drop the steps from `first_step` on that earlier files
  // hold (a resumed run's superseded steps). Throws TensorBoardError.
  void open(const std::string& dir, std::int64_t first_step);
  // One event at `step` with every scalar of `row`, flushed, so a TensorBoard watching sees it at once.
  void write_row(std::int64_t step, const nlohmann::json& row);
  // A rollback to `step`: the steps after it are written again, and TensorBoard drops the old ones.
  void restart_at(std::int64_t first_step);
  const std::string& path() const { return path_; }
  bool is_open() const { return out_ != nullptr; }
  TensorBoardWriter() = default;
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;
  ~TensorBoardWriter();

 private:
  void write_record(const std::string& event);
  std::string path_;
  std::FILE* out_ = nullptr;
};

}  // namespace loom
