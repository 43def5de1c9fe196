// The C API of tokenizers-cpp's include/tokenizers_c.h (tokenizers_new_from_str, tokenizers_encode, ...)
// implemented over embedded CPython and the `tokenizers` wheel, instead of the Rust static library that
// tokenizers-cpp normally links. tokenizers-cpp's own src/huggingface_tokenizer.cc (compiled unmodified from
// the vendor archive) builds its Tokenizer::FromBlobJSON / FromBlobByteLevelBPE on top of these functions, and
// MLC-LLM's cpp/tokenizers/tokenizers.cc builds on that. Written for this project; see docs/mlc-engine.md.
//
// Threads and the GIL: MLC's engine calls the tokenizer from its background threads (the engine loop, the
// stream-back loop) as well as from the thread that called into it. Every entry point takes the GIL with
// PyGILState_Ensure / PyGILState_Release, which works whether or not the calling thread is a Python thread
// and whether or not it already holds the GIL. When the library runs inside a program that has no Python
// (a standalone C++ client), the first call starts an interpreter (Py_InitializeEx(0)), puts the venv's
// site-packages that this library was built against on sys.path, and releases the GIL (PyEval_SaveThread)
// so that any thread can take it.
//
// Errors: a Python exception (a malformed tokenizer.json, `tokenizers` not importable, ...) becomes a
// tvm::ffi::Error "RuntimeError: tokenizer (python `tokenizers` backend): <Type>: <message>", which reaches
// the engine's caller as an ordinary FFI error; it never aborts the process (the Rust backend panics).
//
// Returned strings (tokenizers_get_decode_str, tokenizers_id_to_token) stay valid until the next call of the
// same function on the same handle from the same thread: each handle keeps one buffer per calling thread.

#define PY_SSIZE_T_CLEAN
#include <Python.h>
// Python.h first (it may set feature macros that the standard headers read).

#include <tokenizers_c.h>
#include <tvm/ffi/error.h>

#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace {

// The Python side: small functions over a `tokenizers.Tokenizer`, run in a private module namespace.
const char* kHelperSource = R"PY(
import json as _json


def _tokenizers():
    try:
        import tokenizers
    except ImportError as err:
        import sys
        raise ImportError(
            "the Python package `tokenizers` is not importable here (%s); install it into this "
            "interpreter (pip install tokenizers) or put it on PYTHONPATH; sys.path=%r" % (err, sys.path)
        ) from None
    return tokenizers


def from_str(text):
    return _tokenizers().Tokenizer.from_str(text)


def byte_level_bpe(vocab_text, merges_text, added_tokens_text):
    tk = _tokenizers()
    vocab = {}
    for source, name in ((vocab_text, "vocab.json"), (added_tokens_text, "added_tokens.json")):
        if name == "added_tokens.json" and not source:
            continue
        table = _json.loads(source)
        if not isinstance(table, dict):
            raise ValueError("invalid %s: not a JSON object" % name)
        vocab.update({k: int(v) for k, v in table.items() if isinstance(v, int) and not isinstance(v, bool)})
    merges = []
    for line in merges_text.splitlines():
        if line.startswith("#version"):
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            raise ValueError("invalid merges.txt line %r" % line)
        merges.append((parts[0], parts[1]))
    tok = tk.Tokenizer(tk.models.BPE(vocab, merges))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = tk.decoders.ByteLevel()
    return tok


def encode(tok, text, add_special_tokens):
    return tok.encode(text, add_special_tokens=add_special_tokens).ids


def encode_batch(tok, texts, add_special_tokens):
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=add_special_tokens)]


def decode(tok, ids, skip_special_tokens):
    return tok.decode(ids, skip_special_tokens=skip_special_tokens)


def vocab_size(tok):
    return tok.get_vocab_size(with_added_tokens=True)


def id_to_token(tok, token_id):
    token = tok.id_to_token(token_id)
    return "" if token is None else token


def token_to_id(tok, token):
    token_id = tok.token_to_id(token)
    return -1 if token_id is None else token_id
)PY";

struct PyTokenizer {
  PyObject* tok = nullptr;  // a tokenizers.Tokenizer (strong reference)
  std::mutex mu;            // guards the buffers (the GIL is released while a caller copies them out)
  std::unordered_map<std::thread::id, std::string> decode_str;
  std::unordered_map<std::thread::id, std::string> id_to_token_str;
};

std::once_flag g_init_once;
PyObject* g_helpers = nullptr;  // the helper module's __dict__ (strong reference, never released)

bool PythonFinalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// Starts an interpreter when the host program has none (a standalone C++ client); a no-op inside Python.
void EnsureInterpreter() {
  std::call_once(g_init_once, [] {
    if (Py_IsInitialized()) return;
    Py_InitializeEx(0);  // 0: leave the host's signal handlers alone
#ifdef MLC_CLIENT_PYTHON_SITE
    // The site-packages that this library was built against (the venv holding `tokenizers`); an
    // interpreter started from a C++ program only knows the base installation's.
    PyObject* site = PyImport_ImportModule("site");
    if (site != nullptr) {
      PyObject* r = PyObject_CallMethod(site, "addsitedir", "s", MLC_CLIENT_PYTHON_SITE);
      Py_XDECREF(r);
      Py_DECREF(site);
    }
    PyErr_Clear();
#endif
    PyEval_SaveThread();  // release the GIL: every entry point takes it with PyGILState_Ensure
  });
}

class GILGuard {
 public:
  GILGuard() {
    EnsureInterpreter();
    if (PythonFinalizing()) {
      TVM_FFI_THROW(RuntimeError) << "tokenizer (python `tokenizers` backend): the Python interpreter is "
                                     "shutting down";
    }
    state_ = PyGILState_Ensure();
  }
  ~GILGuard() { PyGILState_Release(state_); }
  GILGuard(const GILGuard&) = delete;
  GILGuard& operator=(const GILGuard&) = delete;

 private:
  PyGILState_STATE state_;
};

// The pending Python exception as one line "Type: message"; clears it. GIL held.
std::string FetchPythonError() {
  std::string out = "unknown Python error";
#if PY_VERSION_HEX >= 0x030C0000
  PyObject* value = PyErr_GetRaisedException();
  PyObject* type = value != nullptr ? reinterpret_cast<PyObject*>(Py_TYPE(value)) : nullptr;
  Py_XINCREF(type);
  PyObject* tb = nullptr;
#else
  PyObject *type = nullptr, *value = nullptr, *tb = nullptr;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
#endif
  if (type != nullptr) {
    out = reinterpret_cast<PyTypeObject*>(type)->tp_name;
    if (value != nullptr) {
      PyObject* s = PyObject_Str(value);
      if (s != nullptr) {
        const char* msg = PyUnicode_AsUTF8(s);
        if (msg != nullptr && *msg != '\0') out += std::string(": ") + msg;
        Py_DECREF(s);
      }
    }
  }
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(tb);
  PyErr_Clear();
  for (char& ch : out) {
    if (ch == '\n' || ch == '\r') ch = ' ';
  }
  return out;
}

[[noreturn]] void ThrowPythonError(const char* what) {
  std::string msg = FetchPythonError();
  TVM_FFI_THROW(RuntimeError) << "tokenizer (python `tokenizers` backend): " << what << ": " << msg;
}

// The helper namespace, compiled on first use. GIL held.
PyObject* Helpers() {
  if (g_helpers != nullptr) return g_helpers;
  PyObject* module = PyModule_New("_mlc_client_tokenizers");
  if (module == nullptr) ThrowPythonError("creating the helper module");
  PyObject* dict = PyModule_GetDict(module);  // borrowed
  if (PyDict_GetItemString(dict, "__builtins__") == nullptr) {
    PyDict_SetItemString(dict, "__builtins__", PyEval_GetBuiltins());
  }
  PyObject* r = PyRun_String(kHelperSource, Py_file_input, dict, dict);
  if (r == nullptr) {
    Py_DECREF(module);
    ThrowPythonError("compiling the helper module");
  }
  Py_DECREF(r);
  Py_INCREF(dict);
  g_helpers = dict;
  Py_DECREF(module);  // the dict keeps the functions alive
  return g_helpers;
}

// helper(args...) -> new reference; throws on a Python error. GIL held; steals `args`.
PyObject* CallHelper(const char* name, PyObject* args) {
  if (args == nullptr) ThrowPythonError(name);
  PyObject* fn = PyDict_GetItemString(Helpers(), name);  // borrowed
  if (fn == nullptr) {
    Py_DECREF(args);
    TVM_FFI_THROW(RuntimeError) << "tokenizer (python `tokenizers` backend): no helper " << name;
  }
  PyObject* r = PyObject_CallObject(fn, args);
  Py_DECREF(args);
  if (r == nullptr) ThrowPythonError(name);
  return r;
}

PyObject* Utf8(const char* data, size_t len) {
  // "replace": invalid UTF-8 becomes U+FFFD instead of an error (the Rust backend reads JSON lossily too)
  return PyUnicode_DecodeUTF8(data != nullptr ? data : "", static_cast<Py_ssize_t>(len), "replace");
}

std::string ToStdString(PyObject* s, const char* what) {
  Py_ssize_t n = 0;
  const char* p = PyUnicode_AsUTF8AndSize(s, &n);
  if (p == nullptr) ThrowPythonError(what);
  return std::string(p, static_cast<size_t>(n));
}

// A Python list of ints -> a new[]-allocated array (freed by tokenizers_free_encode_results).
void ToEncodeResult(PyObject* ids, TokenizerEncodeResult* out) {
  PyObject* seq = PySequence_Fast(ids, "token ids are not a sequence");
  if (seq == nullptr) ThrowPythonError("encode");
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  int* buf = n > 0 ? new int[n] : nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
    if (v == -1 && PyErr_Occurred()) {
      delete[] buf;
      Py_DECREF(seq);
      ThrowPythonError("encode");
    }
    buf[i] = static_cast<int>(v);
  }
  Py_DECREF(seq);
  out->token_ids = buf;
  out->len = static_cast<size_t>(n);
}

PyTokenizer* Wrap(PyObject* tok) {
  auto* h = new PyTokenizer();
  h->tok = tok;
  return h;
}

PyTokenizer* Handle(TokenizerHandle handle) {
  if (handle == nullptr) {
    TVM_FFI_THROW(RuntimeError) << "tokenizer (python `tokenizers` backend): null tokenizer handle";
  }
  return static_cast<PyTokenizer*>(handle);
}

}  // namespace

extern "C" {

TokenizerHandle tokenizers_new_from_str(const char* json, size_t len) {
  GILGuard gil;
  PyObject* tok = CallHelper("from_str", Py_BuildValue("(N)", Utf8(json, len)));
  return Wrap(tok);
}

TokenizerHandle byte_level_bpe_tokenizers_new_from_str(const char* vocab, size_t vocab_len,
                                                       const char* merges, size_t merges_len,
                                                       const char* added_tokens, size_t added_tokens_len) {
  GILGuard gil;
  PyObject* tok = CallHelper("byte_level_bpe",
                             Py_BuildValue("(NNN)", Utf8(vocab, vocab_len), Utf8(merges, merges_len),
                                           Utf8(added_tokens, added_tokens_len)));
  return Wrap(tok);
}

void tokenizers_encode(TokenizerHandle handle, const char* data, size_t len, int add_special_token,
                       TokenizerEncodeResult* result) {
  PyTokenizer* h = Handle(handle);
  GILGuard gil;
  PyObject* ids = CallHelper("encode", Py_BuildValue("(ONO)", h->tok, Utf8(data, len),
                                                     add_special_token ? Py_True : Py_False));
  try {
    ToEncodeResult(ids, result);
  } catch (...) {
    Py_DECREF(ids);
    throw;
  }
  Py_DECREF(ids);
}

void tokenizers_encode_batch(TokenizerHandle handle, const char** data, size_t* len, size_t num_seqs,
                             int add_special_token, TokenizerEncodeResult* results) {
  PyTokenizer* h = Handle(handle);
  GILGuard gil;
  PyObject* texts = PyList_New(static_cast<Py_ssize_t>(num_seqs));
  if (texts == nullptr) ThrowPythonError("encode_batch");
  for (size_t i = 0; i < num_seqs; ++i) {
    PyObject* s = Utf8(data[i], len[i]);
    if (s == nullptr) {
      Py_DECREF(texts);
      ThrowPythonError("encode_batch");
    }
    PyList_SET_ITEM(texts, static_cast<Py_ssize_t>(i), s);  // steals s
  }
  PyObject* batch = CallHelper("encode_batch", Py_BuildValue("(ONO)", h->tok, texts,
                                                             add_special_token ? Py_True : Py_False));
  size_t done = 0;
  try {
    if (PyList_Size(batch) != static_cast<Py_ssize_t>(num_seqs)) {
      TVM_FFI_THROW(RuntimeError) << "tokenizer (python `tokenizers` backend): encode_batch returned "
                                  << PyList_Size(batch) << " results for " << num_seqs << " texts";
    }
    for (; done < num_seqs; ++done) {
      ToEncodeResult(PyList_GET_ITEM(batch, static_cast<Py_ssize_t>(done)), &results[done]);
    }
  } catch (...) {
    for (size_t i = 0; i < done; ++i) delete[] results[i].token_ids;
    Py_DECREF(batch);
    throw;
  }
  Py_DECREF(batch);
}

void tokenizers_free_encode_results(TokenizerEncodeResult* results, size_t num_seqs) {
  for (size_t i = 0; i < num_seqs; ++i) {
    delete[] results[i].token_ids;
    results[i].token_ids = nullptr;
    results[i].len = 0;
  }
}

void tokenizers_decode(TokenizerHandle handle, const uint32_t* data, size_t len, int skip_special_token) {
  PyTokenizer* h = Handle(handle);
  std::string text;
  {
    GILGuard gil;
    PyObject* ids = PyList_New(static_cast<Py_ssize_t>(len));
    if (ids == nullptr) ThrowPythonError("decode");
    for (size_t i = 0; i < len; ++i) {
      PyList_SET_ITEM(ids, static_cast<Py_ssize_t>(i), PyLong_FromUnsignedLong(data[i]));
    }
    PyObject* s = CallHelper("decode", Py_BuildValue("(ONO)", h->tok, ids,
                                                     skip_special_token ? Py_True : Py_False));
    try {
      text = ToStdString(s, "decode");
    } catch (...) {
      Py_DECREF(s);
      throw;
    }
    Py_DECREF(s);
  }
  std::lock_guard<std::mutex> lock(h->mu);
  h->decode_str[std::this_thread::get_id()] = std::move(text);
}

void tokenizers_get_decode_str(TokenizerHandle handle, const char** data, size_t* len) {
  PyTokenizer* h = Handle(handle);
  std::lock_guard<std::mutex> lock(h->mu);
  const std::string& s = h->decode_str[std::this_thread::get_id()];
  *data = s.data();
  *len = s.size();
}

void tokenizers_get_vocab_size(TokenizerHandle handle, size_t* size) {
  PyTokenizer* h = Handle(handle);
  GILGuard gil;
  PyObject* n = CallHelper("vocab_size", Py_BuildValue("(O)", h->tok));
  size_t v = PyLong_AsSize_t(n);
  Py_DECREF(n);
  if (v == static_cast<size_t>(-1) && PyErr_Occurred()) ThrowPythonError("get_vocab_size");
  *size = v;
}

void tokenizers_id_to_token(TokenizerHandle handle, uint32_t id, const char** data, size_t* len) {
  PyTokenizer* h = Handle(handle);
  std::string token;
  {
    GILGuard gil;
    PyObject* s = CallHelper("id_to_token", Py_BuildValue("(Ok)", h->tok, static_cast<unsigned long>(id)));
    try {
      token = ToStdString(s, "id_to_token");
    } catch (...) {
      Py_DECREF(s);
      throw;
    }
    Py_DECREF(s);
  }
  std::lock_guard<std::mutex> lock(h->mu);
  std::string& slot = h->id_to_token_str[std::this_thread::get_id()];
  slot = std::move(token);
  *data = slot.data();
  *len = slot.size();
}

void tokenizers_token_to_id(TokenizerHandle handle, const char* token, size_t len, int32_t* id) {
  PyTokenizer* h = Handle(handle);
  GILGuard gil;
  PyObject* r = CallHelper("token_to_id", Py_BuildValue("(ON)", h->tok, Utf8(token, len)));
  long v = PyLong_AsLong(r);
  Py_DECREF(r);
  if (v == -1 && PyErr_Occurred()) ThrowPythonError("token_to_id");
  *id = static_cast<int32_t>(v);
}

void tokenizers_free(TokenizerHandle handle) {
  if (handle == nullptr) return;
  auto* h = static_cast<PyTokenizer*>(handle);
  // At process exit (static destructors after Python has shut down) the Python object is left to the OS.
  if (Py_IsInitialized() && !PythonFinalizing()) {
    PyGILState_STATE state = PyGILState_Ensure();
    Py_XDECREF(h->tok);
    PyGILState_Release(state);
  }
  delete h;
}

}  // extern "C"
