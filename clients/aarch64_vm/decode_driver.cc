/*
 * Runs an android-cpu bundle's library the way an Android app does: the library's objects (lib0.o and the
 * VM bytecode object of its .tar) linked into one executable with the TVM runtime, loaded as a system
 * library, weights read from the bundle's tensor cache. Built for aarch64 by clients/aarch64_vm/build.py and
 * run under qemu-aarch64 by clients/aarch64_vm/run.py.
 *
 *   decode_driver PREFIX BUNDLE IDS STEPS LOGITS OUT_IDS [FORCED]
 *
 * PREFIX  the library's system-lib prefix        BUNDLE  the bundle folder (tensor-cache.json)
 * IDS     prompt token ids, whitespace separated  STEPS   greedy decode steps after the prompt
 * LOGITS  written: float32 logits, the prompt's last position then each decode step ([STEPS + 1, V]);
 *         "-": none read back, no argmax, each step fed the prompt's last id (what llama-bench does: the
 *         benchmark counts the library's and the runtime's work, not the caller's sampling)
 * OUT_IDS written: the STEPS greedy ids, one per line
 * FORCED  ids fed at the decode steps instead of the greedy ones (teacher forcing: logits compared position by
 *         position with another runtime even where a near-tie makes the two greedy paths part)
 * Like an app runtime, it reads the parameter names, context window, prefill chunk and KV-state kind from
 * the library's `_metadata()`. Threads: TVM_NUM_THREADS, as in an app.
 */
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/container/map.h>
#include <tvm/ffi/extra/json.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/runtime/tensor.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

namespace {

using tvm::ffi::Any;
using tvm::ffi::Array;
using tvm::ffi::Function;
using tvm::ffi::Module;
using tvm::ffi::Shape;
using tvm::ffi::String;
using tvm::runtime::Tensor;

constexpr int kPageSize = 16;
constexpr int kPooledAllocator = 2;
const DLDevice kCPU{kDLCPU, 0};

Function Global(const char* name) { return Function::GetGlobalRequired(name); }

Function Entry(const Module& vm, const char* name) {
  auto f = vm->GetFunction(name);
  if (!f.has_value()) {
    std::fprintf(stderr, "decode_driver: the library has no function `%s`\n", name);
    std::exit(2);
  }
  return f.value();
}

/*! What the runtime needs from the library's `_metadata()` JSON. */
struct Metadata {
  Array<String> param_names;
  int64_t context = 0, chunk = 0;
  bool hybrid = false;

  static Metadata Read(const Module& vm) {
    String text = Entry(vm, "_metadata")().cast<String>();
    auto meta = tvm::ffi::json::Parse(text).cast<tvm::ffi::json::Object>();
    Metadata m;
    for (const Any& p : meta.at("params").cast<tvm::ffi::json::Array>()) {
      m.param_names.push_back(p.cast<tvm::ffi::json::Object>().at("name").cast<String>());
    }
    m.context = meta.at("context_window_size").cast<int64_t>();
    m.chunk = meta.at("prefill_chunk_size").cast<int64_t>();
    auto kind = meta.find("kv_state_kind");
    m.hybrid = kind != meta.end() && (*kind).second.cast<String>() == "hybrid";
    return m;
  }
};

float HalfToFloat(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do { ++e; mant <<= 1; } while ((mant & 0x400) == 0);
      bits = sign | ((127 - 15 - e) << 23) | ((mant & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

/*! The last position's logits of a [1, n, V] output, as float32. */
std::vector<float> LastLogits(const Tensor& out) {
  int64_t vocab = out->shape[out->ndim - 1];
  int64_t rows = 1;
  for (int i = 0; i < out->ndim - 1; ++i) rows *= out->shape[i];
  size_t width = out->dtype.bits / 8;
  std::vector<uint8_t> bytes(rows * vocab * width);
  out.CopyToBytes(bytes.data(), bytes.size());
  std::vector<float> logits(vocab);
  const uint8_t* last = bytes.data() + (rows - 1) * vocab * width;
  for (int64_t v = 0; v < vocab; ++v) {
    if (out->dtype.code == kDLFloat && out->dtype.bits == 32) {
      std::memcpy(&logits[v], last + 4 * v, 4);
    } else if (out->dtype.code == kDLFloat && out->dtype.bits == 16) {
      uint16_t h;
      std::memcpy(&h, last + 2 * v, 2);
      logits[v] = HalfToFloat(h);
    } else {
      std::fprintf(stderr, "decode_driver: logits of dtype code %d bits %d not handled\n", out->dtype.code,
                   out->dtype.bits);
      std::exit(2);
    }
  }
  return logits;
}

int Argmax(const std::vector<float>& v) {
  int best = 0;
  for (size_t i = 1; i < v.size(); ++i) {
    if (v[i] > v[best]) best = static_cast<int>(i);
  }
  return best;
}

struct Session {
  Module vm;
  Array<Tensor> params;
  std::vector<Any> states;  // KV cache, then (hybrid) the RNN state
  // looked up once, as an app runtime does: not per step inside the counted decode
  Function embed, prefill, decode, begin_forward, end_forward;

  explicit Session(Module vm)
      : vm(std::move(vm)),
        embed(Entry(this->vm, "embed")),
        prefill(Entry(this->vm, "prefill")),
        decode(Entry(this->vm, "decode")),
        begin_forward(Global("vm.builtin.kv_state_begin_forward")),
        end_forward(Global("vm.builtin.kv_state_end_forward")) {}

  /*! Embed `ids`, run `fn` over them (begin / end forward around it), return the last position's logits
   * (none when `read_logits` is false). */
  std::vector<float> Forward(const Function& fn, const std::vector<int32_t>& ids, bool read_logits = true) {
    int64_t n = static_cast<int64_t>(ids.size());
    Tensor tokens = Tensor::Empty(Shape({n}), DLDataType{kDLInt, 32, 1}, kCPU);
    tokens.CopyFromBytes(ids.data(), ids.size() * sizeof(int32_t));
    Tensor emb = embed(tokens, params).cast<Tensor>();
    Tensor first = emb.CreateView(Shape({1, n, emb->shape[emb->ndim - 1]}), emb->dtype);
    for (const Any& s : states) begin_forward(s, Shape({0}), Shape({n}));
    std::vector<tvm::ffi::AnyView> args{first};
    for (const Any& s : states) args.push_back(s);
    args.push_back(params);
    Any result;
    fn.CallPacked(args.data(), static_cast<int>(args.size()), &result);
    Array<Any> outs = result.cast<Array<Any>>();
    for (size_t i = 0; i < states.size(); ++i) states[i] = outs[i + 1];
    for (const Any& s : states) end_forward(s);
    return read_logits ? LastLogits(outs[0].cast<Tensor>()) : std::vector<float>();
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7 && argc != 8) {
    std::fprintf(stderr, "usage: %s PREFIX BUNDLE IDS STEPS LOGITS OUT_IDS [FORCED]\n", argv[0]);
    return 2;
  }
  const std::string prefix = argv[1], bundle = argv[2];
  const char *ids_path = argv[3], *logits_path = argv[5], *out_ids_path = argv[6];
  const int steps = std::atoi(argv[4]);

  Module lib = Global("ffi.SystemLib")(prefix).cast<Module>();
  Session s(Entry(lib, "vm_load_executable")().cast<Module>());
  Entry(s.vm, "vm_initialization")(static_cast<int>(kDLCPU), 0, kPooledAllocator, static_cast<int>(kDLCPU), 0,
                                   kPooledAllocator);
  const Metadata meta = Metadata::Read(s.vm);
  const int64_t chunk = meta.chunk;
  Global("vm.builtin.tensor_cache.load")(bundle, static_cast<int>(kDLCPU), 0);
  s.params = Global("vm.builtin.param_array_from_cache_by_name")(meta.param_names).cast<Array<Tensor>>();

  Any kv = Entry(s.vm, "create_tir_paged_kv_cache")(Shape({1}), Shape({meta.context}), Shape({chunk}),
                                                     Shape({kPageSize}), Shape({0}));
  Global("vm.builtin.kv_state_add_sequence")(kv, 0);
  s.states.push_back(kv);
  if (meta.hybrid) {
    Any rnn = Entry(s.vm, "create_rnn_state")(Shape({1}), Shape({1}));
    Global("vm.builtin.kv_state_add_sequence")(rnn, 0);
    s.states.push_back(rnn);
  }

  auto read_ids = [](const char* path) {
    std::vector<int32_t> ids;
    std::ifstream in(path);
    for (int32_t id; in >> id;) ids.push_back(id);
    return ids;
  };
  const std::vector<int32_t> prompt = read_ids(ids_path);
  const std::vector<int32_t> forced = argc == 8 ? read_ids(argv[7]) : std::vector<int32_t>();
  if (argc == 8 && static_cast<int>(forced.size()) < steps) {
    std::fprintf(stderr, "decode_driver: %s has %zu ids for %d steps\n", argv[7], forced.size(), steps);
    return 2;
  }
  if (prompt.empty()) {
    std::fprintf(stderr, "decode_driver: no token ids in %s\n", ids_path);
    return 2;
  }
  std::vector<float> logits;
  if (std::strcmp(logits_path, "-") == 0) {  // benchmark mode: the library's and the runtime's work only
    for (size_t start = 0; start < prompt.size(); start += chunk) {
      size_t end = std::min(prompt.size(), start + static_cast<size_t>(chunk));
      s.Forward(s.prefill, std::vector<int32_t>(prompt.begin() + start, prompt.begin() + end), false);
    }
    for (int step = 0; step < steps; ++step) s.Forward(s.decode, {prompt.back()}, false);
    return 0;
  }
  for (size_t start = 0; start < prompt.size(); start += chunk) {
    size_t end = std::min(prompt.size(), start + static_cast<size_t>(chunk));
    logits = s.Forward(s.prefill, std::vector<int32_t>(prompt.begin() + start, prompt.begin() + end));
  }
  FILE* flog = std::fopen(logits_path, "wb");
  FILE* fids = std::fopen(out_ids_path, "w");
  if (flog == nullptr || fids == nullptr) {
    std::fprintf(stderr, "decode_driver: cannot write %s / %s\n", logits_path, out_ids_path);
    return 2;
  }
  std::fwrite(logits.data(), sizeof(float), logits.size(), flog);
  for (int step = 0; step < steps; ++step) {
    int next = Argmax(logits);
    std::fprintf(fids, "%d\n", next);
    logits = s.Forward(s.decode, {forced.empty() ? next : forced[step]});
    std::fwrite(logits.data(), sizeof(float), logits.size(), flog);
  }
  std::fclose(flog);
  std::fclose(fids);
  return 0;
}
