// Keeps the engine's recent log messages so that a client can report them.
//
// Why: some of MLC's errors reach the caller without their text. ModelMetadata::FromModule
// (cpp/metadata/model.cc) logs "Failed to parse metadata: <json> error: <what>" as a warning and then
// rethrows the exception by value as a plain std::exception, so the FFI error says only "std::exception"
// and the reason is on stderr alone. TVM's LOG(...) writes each message to std::cerr in one piece
// (tvm/runtime/logging.h, LogMessage::~LogMessage), so a tee on std::cerr's stream buffer sees every message
// whole: it passes everything on to the original buffer unchanged and keeps the last messages that look like
// TVM log records ("[HH:MM:SS] file:line: ...") in a ring, numbered.
//
// Global functions (tvm-ffi registry):
//   mlc_client.log_capture_start() -> int   installs the tee once; returns the number of the last record
//   mlc_client.log_records_since(int) -> str JSON array of {"seq": n, "text": message} newer than that number
// Written for this project; see docs/mlc-engine.md.

#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>
#include <tvm/ffi/string.h>

#include <cstdint>
#include <deque>
#include <iostream>
#include <mutex>
#include <sstream>
#include <streambuf>
#include <string>
#include <utility>

namespace mlc_client {
namespace {

constexpr size_t kMaxRecords = 64;
constexpr size_t kMaxRecordBytes = 1 << 20;

bool LooksLikeLogRecord(const std::string& s) {
  // "[HH:MM:SS] " as LogMessage writes it
  return s.size() > 11 && s[0] == '[' && s[3] == ':' && s[6] == ':' && s[9] == ']' && s[10] == ' ';
}

class TeeBuf : public std::streambuf {
 public:
  explicit TeeBuf(std::streambuf* out) : out_(out) {}

  int64_t LastSeq() {
    std::lock_guard<std::mutex> lock(mu_);
    return seq_;
  }

  std::string RecordsSinceJSON(int64_t since) {
    std::lock_guard<std::mutex> lock(mu_);
    std::ostringstream os;
    os << "[";
    bool first = true;
    for (const auto& [seq, text] : records_) {
      if (seq <= since) continue;
      os << (first ? "" : ",") << "{\"seq\":" << seq << ",\"text\":\"" << Escape(text) << "\"}";
      first = false;
    }
    os << "]";
    return os.str();
  }

 protected:
  std::streamsize xsputn(const char* s, std::streamsize n) override {
    std::lock_guard<std::mutex> lock(mu_);
    Keep(std::string(s, static_cast<size_t>(n)));
    return out_->sputn(s, n);
  }

  int_type overflow(int_type ch) override {
    if (traits_type::eq_int_type(ch, traits_type::eof())) return traits_type::not_eof(ch);
    std::lock_guard<std::mutex> lock(mu_);
    return out_->sputc(traits_type::to_char_type(ch));
  }

  int sync() override {
    std::lock_guard<std::mutex> lock(mu_);
    return out_->pubsync();
  }

 private:
  void Keep(std::string chunk) {
    if (!LooksLikeLogRecord(chunk)) return;
    if (chunk.size() > kMaxRecordBytes) chunk.resize(kMaxRecordBytes);
    records_.emplace_back(++seq_, std::move(chunk));
    while (records_.size() > kMaxRecords) records_.pop_front();
  }

  static std::string Escape(const std::string& s) {
    std::string out;
    out.reserve(s.size() + 16);
    for (unsigned char c : s) {
      switch (c) {
        case '"': out += "\\\""; break;
        case '\\': out += "\\\\"; break;
        case '\n': out += "\\n"; break;
        case '\r': out += "\\r"; break;
        case '\t': out += "\\t"; break;
        default:
          if (c < 0x20) {
            char buf[8];
            snprintf(buf, sizeof(buf), "\\u%04x", c);
            out += buf;
          } else {
            out += static_cast<char>(c);  // UTF-8 passes through
          }
      }
    }
    return out;
  }

  std::streambuf* out_;
  std::mutex mu_;
  int64_t seq_ = 0;
  std::deque<std::pair<int64_t, std::string>> records_;
};

std::mutex g_install_mu;
TeeBuf* g_tee = nullptr;  // never freed: std::cerr may be written until the process ends

TeeBuf* Install() {
  std::lock_guard<std::mutex> lock(g_install_mu);
  if (g_tee == nullptr) {
    g_tee = new TeeBuf(std::cerr.rdbuf());
    std::cerr.rdbuf(g_tee);
  }
  return g_tee;
}

}  // namespace

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  refl::GlobalDef()
      .def("mlc_client.log_capture_start", []() -> int64_t { return Install()->LastSeq(); })
      .def("mlc_client.log_records_since", [](int64_t since) -> tvm::ffi::String {
        return Install()->RecordsSinceJSON(since);
      });
}

}  // namespace mlc_client
