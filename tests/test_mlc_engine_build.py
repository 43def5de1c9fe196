"""MLC-LLM's C++ serving engine built as a client of our bundles (clients/mlc_engine/, docs/mlc-engine.md).

Default suite: the build script's prerequisites and cache rules, the client's error summaries, and — when the
engine library is already built for this checkout (`make mlc-engine`) — the library itself: MLC's global
functions, its C++ tokenizer over our Python-backed tokenizers C API (in Python and in a program without
Python), and the engine loading our host-cpu bundle. `make test-slow` builds the library from scratch.

The library is loaded in subprocesses only: a crash there fails a test instead of ending the session, and one
process never loads two copies (each registers the same global functions).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from clients.mlc_engine import build, client  # noqa: E402

BUILD = ROOT / "clients" / "mlc_engine" / "build.py"
TEXTS = ["Hello, world!", "The capital of France is Paris.", "naïve café — 東京 🚀🎉 Ünïcödé",
         "", "  two spaces\n\ttab", "<|im_start|>user\nhi<|im_end|>", "x" * 300]

# What the engine's module must offer (cpp/json_ffi/json_ffi_engine.cc, cpp/serve/threaded_engine.cc) and
# the global functions the client and tests use (cpp/tokenizers, cpp/serve/data.cc, cpp/multi_gpu, glue).
JSON_FFI_METHODS = ["init_background_engine", "reload", "unload", "reset", "chat_completion", "abort",
                    "get_last_error", "run_background_loop", "run_background_stream_back_loop",
                    "exit_background_loop"]
SERVE_METHODS = ["init_threaded_engine", "reload", "add_request", "create_request", "abort_request",
                 "run_background_loop", "run_background_stream_back_loop", "exit_background_loop",
                 "get_complete_engine_config", "reset"]
GLOBALS = ["mlc.json_ffi.CreateJSONFFIEngine", "mlc.serve.create_threaded_engine", "mlc.serve.create_engine",
           "mlc.serve.TokenData", "mlc.serve.TextData", "mlc.serve.RequestStreamOutputUnpack",
           "mlc.tokenizers.Tokenizer", "mlc.tokenizers.TokenizerEncode", "mlc.tokenizers.TokenizerEncodeBatch",
           "mlc.tokenizers.TokenizerDecode", "mlc.tokenizers.DetectTokenizerInfo",
           "mlc.multi_gpu.LoadMultiGPU", "mlc_client.log_capture_start", "mlc_client.log_records_since"]


def _run_py(code: str, *args: str, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def _one_line_error(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert lines, "nothing on stderr"
    return lines[-1]


# ------------------------------------------------------------------------------------------------------------
# the build script: prerequisites, cache key, cache entries (no compiler run)
# ------------------------------------------------------------------------------------------------------------


def test_missing_vendor_folder_is_one_line(tmp_path):
    for vendor in (tmp_path / "nowhere", tmp_path):   # absent; present without the archives
        env = {**os.environ, "MLC_VENDOR_DIR": str(vendor), "MLC_ENGINE_CACHE_DIR": str(tmp_path / "cache")}
        r = subprocess.run([sys.executable, str(BUILD)], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 1
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "mlc-llm-79d603f.tar.gz" in r.stderr and "MLC_VENDOR_DIR" in r.stderr
        assert not (tmp_path / "cache").exists()


def test_missing_compiler_is_one_line(vendor, tmp_path):
    env = {**os.environ, "CXX": "no-such-compiler-g++", "MLC_ENGINE_CACHE_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, str(BUILD)], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip() == ("mlc-engine: C++ compiler `no-such-compiler-g++` not found; install g++ "
                                "(apt-get install g++) or set CXX")


@pytest.fixture(scope="module")
def vendor() -> Path:
    try:
        return build.vendor_dir()
    except build.Missing as e:
        pytest.skip(f"vendor archives absent: {e}")


def test_cache_key_follows_every_input(vendor, tmp_path, monkeypatch):
    if shutil.which("g++") is None:
        pytest.skip("no g++ here")
    tc = build.toolchain()
    key = build._key(build.key_inputs(vendor, tc))
    assert key == build._key(build.key_inputs(vendor, tc))            # stable
    # one archive changed (same name), everything else the same
    changed = tmp_path / "vendor"
    changed.mkdir()
    for a in build.ARCHIVES:
        shutil.copy(vendor / a, changed / a)
    with open(changed / "stb-ae721c5.tar.gz", "ab") as f:
        f.write(b"\0")
    assert build._key(build.key_inputs(changed, tc)) != key
    # a compiler flag, the compiler, the wheel's runtime library
    monkeypatch.setattr(build, "CXXFLAGS", [*build.CXXFLAGS, "-DEXTRA"])
    assert build._key(build.key_inputs(vendor, tc)) != key
    monkeypatch.undo()
    assert build._key(build.key_inputs(vendor, tc)) == key
    tc2 = build.toolchain()
    tc2.cxx_version = "g++ (other) 99"
    assert build._key(build.key_inputs(vendor, tc2)) != key
    tc2 = build.toolchain()
    tc2.wheel = {**tc2.wheel, "libtvm_runtime.so": "0" * 64}
    assert build._key(build.key_inputs(vendor, tc2)) != key
    # a glue source
    glue = tmp_path / "glue"
    glue.mkdir()
    for g in build.GLUE:
        shutil.copy(build.HERE / g, glue / g)
    monkeypatch.setattr(build, "HERE", glue)
    assert build._key(build.key_inputs(vendor, tc)) == key
    (glue / build.GLUE[0]).write_text((glue / build.GLUE[0]).read_text() + "\n// edit\n")
    assert build._key(build.key_inputs(vendor, tc)) != key


def test_cache_entry_is_complete_only_with_manifest_and_matching_library(tmp_path):
    folder = tmp_path / "k"
    folder.mkdir()
    lib = folder / build.LIB_NAME
    lib.write_bytes(b"\x7fELF not really")
    assert build.complete(folder) is None                                # no manifest yet (written last)
    (folder / "manifest.json").write_text(json.dumps({"library": build.LIB_NAME, "sha256": build._sha256(lib)}))
    assert build.complete(folder) == lib
    lib.write_bytes(b"\x7fELF truncated")
    assert build.complete(folder) is None                                # library changed since
    (folder / "manifest.json").write_text("{")
    assert build.complete(folder) is None


def test_sources_are_mlc_cpp_xgrammar_without_bindings_and_the_hf_tokenizer(vendor, tmp_path):
    root = tmp_path / "src" / "mlc-llm"
    build._extract(vendor, root)
    assert (root / "3rdparty" / "tvm" / "src" / "support" / "base64.h").is_file()   # utils.h's relative include
    assert (root / "3rdparty" / "stb" / "stb_image.h").is_file()
    srcs = build.sources(root)
    mlc = [s for s in srcs if s.startswith("cpp/")]
    xgrammar = [s for s in srcs if s.startswith("3rdparty/xgrammar/")]
    assert len(mlc) == len(list((root / "cpp").rglob("*.cc"))) == 42
    assert len(xgrammar) == 10 and not any("pybind" in s for s in xgrammar)
    assert "cpp/multi_gpu/multi_gpu_loader.cc" in mlc and "cpp/serve/sampler/gpu_sampler.cc" in mlc
    assert [s for s in srcs if "tokenizers-cpp" in s] == ["3rdparty/tokenizers-cpp/src/huggingface_tokenizer.cc"]
    # the two tokenizers-cpp sources left out need submodules that a git archive does not hold
    assert not any(any((root / "3rdparty" / "tokenizers-cpp" / sub).glob("*")) for sub in ("sentencepiece", "msgpack"))


def test_repository_holds_no_vendored_source(vendor):
    """No tracked file has the content of any file in the vendor archives."""
    import hashlib

    archived = {}
    for a in build.ARCHIVES:
        with tarfile.open(vendor / a) as tar:
            for m in tar.getmembers():
                if m.isfile() and m.size > 200:   # tiny files (a one-line .gitignore) may coincide by chance
                    archived[hashlib.sha256(tar.extractfile(m).read()).hexdigest()] = f"{a}:{m.name}"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    hits = []
    for name in tracked.decode().split("\0"):
        p = ROOT / name
        if name and p.is_file() and p.stat().st_size < 4 << 20:
            h = hashlib.sha256(p.read_bytes()).hexdigest()
            if h in archived:
                hits.append(f"{name} = {archived[h]}")
    assert not hits


def test_make_target_runs_the_build_script():
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    r = subprocess.run(["make", "--no-print-directory", "-n", "-o", ".venv/.installed", "mlc-engine"], cwd=ROOT,
                       capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ".venv/bin/python clients/mlc_engine/build.py"


# ------------------------------------------------------------------------------------------------------------
# the client's summaries of engine errors (pure Python)
# ------------------------------------------------------------------------------------------------------------

_METADATA_WARNING = ("[12:02:40] cpp/metadata/model.cc:149: Warning: Failed to parse metadata:\n"
                     + json.dumps({"model_type": "llama", "params": [{"name": f"p{i}"} for i in range(40)]})
                     + "\nerror: Check failed: (json.count(key) != 0) is false: key `preprocs` not found in "
                       "the JSON object")


def test_one_line_drops_timestamps_and_json_dumps():
    line = client.one_line(_METADATA_WARNING)
    assert "\n" not in line and "{" not in line
    assert line.startswith("cpp/metadata/model.cc:149: Warning: Failed to parse metadata:")
    assert line.endswith("key `preprocs` not found in the JSON object")


def test_bare_std_exception_takes_the_logged_reason():
    err = client._engine_error(RuntimeError("std::exception"), [{"seq": 1, "text": _METADATA_WARNING}],
                               "loading x failed")
    assert str(err).startswith("loading x failed: cpp/metadata/model.cc:149")
    assert "`preprocs` not found" in str(err) and "\n" not in str(err)
    assert '"params"' in err.detail                                       # the full text is kept
    # an exception with its own text keeps it; info lines in the log are not reasons
    err = client._engine_error(ValueError("Invalid engine mode string: fast"),
                               [{"seq": 2, "text": "[12:00:00] cpp/serve/config.cc:890: Estimated memory"}],
                               "loading x failed")
    assert str(err) == "loading x failed: Invalid engine mode string: fast"


def test_model_lib_and_device_arguments(tmp_path):
    (tmp_path / "mlc-chat-config.json").write_text(json.dumps({"model_lib": "lib/m.so"}))
    assert client.resolve_model_lib(tmp_path, None) == tmp_path / "lib" / "m.so"
    assert client.resolve_model_lib(tmp_path, "/abs/x.so") == Path("/abs/x.so")
    with pytest.raises(client.EngineError, match="no model_lib given"):
        client.resolve_model_lib(tmp_path / "missing", None)
    assert client.parse_device("cpu") == (1, 0) and client.parse_device("cuda:1") == (2, 1)
    with pytest.raises(client.EngineError, match="unknown device 'tpu'"):
        client.parse_device("tpu")


# ------------------------------------------------------------------------------------------------------------
# the built library (default suite when `make mlc-engine` has built it for this checkout)
# ------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_lib() -> Path:
    lib = build.cached_library()
    if lib is None:
        pytest.skip("libmlc_llm_client.so is not built for this checkout's inputs (`make mlc-engine`, a few "
                    "minutes on 2 cores; `make test-slow` builds it from scratch)")
    return lib


@pytest.fixture(scope="module")
def smollm2_tokenizer(tmp_path_factory) -> Path:
    from pipeline.frontend.checkpoint import open_checkpoint, smollm2_gguf_path

    dest = tmp_path_factory.mktemp("smollm2-tokenizer")
    open_checkpoint(smollm2_gguf_path()).write_tokenizer(dest)
    return dest


_REGISTRY = """
import ctypes, json, sys, tvm, tvm_ffi
ctypes.CDLL(sys.argv[1], ctypes.RTLD_GLOBAL)
names = set(tvm_ffi.registry.list_global_func_names())
json_ffi = tvm_ffi.get_global_func("mlc.json_ffi.CreateJSONFFIEngine")()
serve = tvm_ffi.get_global_func("mlc.serve.create_threaded_engine")()
print(json.dumps({
    "globals": sorted(n for n in names if n.startswith(("mlc.", "mlc_client."))),
    "json_ffi": [json_ffi.kind, {m: json_ffi.implements_function(m) for m in sys.argv[2].split(",")}],
    "serve": [serve.kind, {m: serve.implements_function(m) for m in sys.argv[3].split(",")}],
}))
"""


def check_registry(lib: Path) -> dict:
    r = _run_py(_REGISTRY, str(lib), ",".join(JSON_FFI_METHODS), ",".join(SERVE_METHODS))
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    assert set(GLOBALS) <= set(got["globals"]), set(GLOBALS) - set(got["globals"])
    assert got["json_ffi"] == ["mlc.json_ffi", dict.fromkeys(JSON_FFI_METHODS, True)]
    assert got["serve"] == ["mlc.serve.async_threaded_engine", dict.fromkeys(SERVE_METHODS, True)]
    return got


def check_tokenizer(lib: Path, tokenizer_dir: Path) -> None:
    """MLC's C++ Tokenizer (tokenizers-cpp's HFTokenizer over our C API) against the `tokenizers` package."""
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    r = subprocess.run([sys.executable, "-m", "clients.mlc_engine.client", "--lib", str(lib), "tokenize",
                        str(tokenizer_dir), *TEXTS], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    want = [ref.encode(t, add_special_tokens=False).ids for t in TEXTS]
    assert got["ids"] == want
    assert got["batch"] == want
    assert got["decoded"] == [ref.decode(ids, skip_special_tokens=False) for ids in want] == TEXTS
    assert want[5][0] == ref.token_to_id("<|im_start|>")                 # special tokens are one id each


def test_engine_library_registers_mlc_functions(engine_lib):
    check_registry(engine_lib)


def test_mlc_tokenizer_matches_python_tokenizers(engine_lib, smollm2_tokenizer):
    check_tokenizer(engine_lib, smollm2_tokenizer)


_C_API = """
import ctypes, json, sys, tvm
lib = ctypes.CDLL(sys.argv[1], ctypes.RTLD_GLOBAL)
class Result(ctypes.Structure):
    _fields_ = [("token_ids", ctypes.POINTER(ctypes.c_int)), ("len", ctypes.c_size_t)]
lib.tokenizers_new_from_str.restype = ctypes.c_void_p
lib.tokenizers_new_from_str.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
blob = open(sys.argv[2], "rb").read()
h = ctypes.c_void_p(lib.tokenizers_new_from_str(blob, len(blob)))
def encode(text, special):
    data = text.encode(); res = Result()
    lib.tokenizers_encode(h, data, ctypes.c_size_t(len(data)), special, ctypes.byref(res))
    ids = [res.token_ids[i] for i in range(res.len)]
    lib.tokenizers_free_encode_results(ctypes.byref(res), ctypes.c_size_t(1))
    return ids
def decode(ids, skip):
    arr = (ctypes.c_uint32 * len(ids))(*ids)
    lib.tokenizers_decode(h, arr, ctypes.c_size_t(len(ids)), skip)
    p, n = ctypes.c_char_p(), ctypes.c_size_t()
    lib.tokenizers_get_decode_str(h, ctypes.byref(p), ctypes.byref(n))
    return ctypes.string_at(p, n.value).decode()
def id_to_token(i):
    p, n = ctypes.c_char_p(), ctypes.c_size_t()
    lib.tokenizers_id_to_token(h, ctypes.c_uint32(i), ctypes.byref(p), ctypes.byref(n))
    return ctypes.string_at(p, n.value).decode()
def token_to_id(t):
    out = ctypes.c_int32(); data = t.encode()
    lib.tokenizers_token_to_id(h, data, ctypes.c_size_t(len(data)), ctypes.byref(out))
    return out.value
size = ctypes.c_size_t(); lib.tokenizers_get_vocab_size(h, ctypes.byref(size))
text = sys.argv[3]
ids = encode(text, 0)
print(json.dumps({"ids": ids, "ids_special": encode(text, 1), "decoded": decode(ids, 0),
                  "vocab": size.value, "tok0": id_to_token(ids[0]), "past_end": id_to_token(10**6),
                  "im_end": token_to_id("<|im_end|>"), "unknown": token_to_id("no such token, surely"),
                  "skip": decode([1] + ids + [2], 1), "keep": decode([1] + ids + [2], 0)}))
lib.tokenizers_free(h)
"""


def test_tokenizers_c_api_matches_python_tokenizers(engine_lib, smollm2_tokenizer):
    """Our implementation of include/tokenizers_c.h, called as tokenizers-cpp calls it."""
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(str(smollm2_tokenizer / "tokenizer.json"))
    text = "Ünïcödé 🚀 and <|im_end|> inside"
    r = _run_py(_C_API, str(engine_lib), str(smollm2_tokenizer / "tokenizer.json"), text)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    ids = ref.encode(text, add_special_tokens=False).ids
    assert got["ids"] == ids
    assert got["ids_special"] == ref.encode(text, add_special_tokens=True).ids
    assert got["decoded"] == text
    assert got["vocab"] == ref.get_vocab_size(with_added_tokens=True) == 49152
    assert got["tok0"] == ref.id_to_token(ids[0])
    assert got["past_end"] == ""                                          # as the Rust backend: empty
    assert got["im_end"] == 2 and got["unknown"] == -1
    assert got["skip"] == ref.decode([1, *ids, 2], skip_special_tokens=True)
    assert got["keep"] == ref.decode([1, *ids, 2], skip_special_tokens=False) != got["skip"]


def test_byte_level_bpe_folder_goes_through_python_backend(engine_lib, smollm2_tokenizer, tmp_path):
    """Tokenizer::FromPath on vocab.json + merges.txt + added_tokens.json (no tokenizer.json):
    tokenizers-cpp's FromBlobByteLevelBPE -> byte_level_bpe_tokenizers_new_from_str (ours)."""
    from tokenizers import Tokenizer

    spec = json.loads((smollm2_tokenizer / "tokenizer.json").read_text())
    (tmp_path / "vocab.json").write_text(json.dumps(spec["model"]["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    (tmp_path / "added_tokens.json").write_text(json.dumps({t["content"]: t["id"] for t in spec["added_tokens"]}))
    ref = Tokenizer.from_file(str(smollm2_tokenizer / "tokenizer.json"))
    words = ["Hello", "Paris", "café", "東京"]           # single words: the byte-level BPE here has no regex split
    r = subprocess.run([sys.executable, "-m", "clients.mlc_engine.client", "--lib", str(engine_lib), "tokenize",
                        str(tmp_path), *words], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    assert got["ids"] == [ref.encode(w, add_special_tokens=False).ids for w in words]
    assert got["decoded"] == words


def test_bad_tokenizer_json_is_an_error_not_a_crash(engine_lib, tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"decoder": {"type": "ByteLevel"}, "model": 5}')
    r = subprocess.run([sys.executable, "-m", "clients.mlc_engine.client", "--lib", str(engine_lib), "tokenize",
                        str(tmp_path), "hi"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    line = _one_line_error(r.stderr)
    assert line.startswith("error: loading the tokenizer in") and "python `tokenizers` backend" in line
    assert "Traceback" not in r.stderr
    # SentencePiece is not in this build: a tokenizer.model alone is refused with the stub's message
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer.model").write_bytes(b"\x00")
    r = subprocess.run([sys.executable, "-m", "clients.mlc_engine.client", "--lib", str(engine_lib), "tokenize",
                        str(tmp_path), "hi"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    assert "SentencePiece tokenizer.model not supported by this client build; use a tokenizer.json" in \
        _one_line_error(r.stderr)


_STANDALONE = r"""
#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/string.h>

#include <iostream>
#include <string>
#include <thread>
#include <vector>

// A C++ program without Python: the tokenizer backend starts an interpreter itself. Four threads encode at once.
int main(int argc, char** argv) {
  using tvm::ffi::Function;
  Function make = Function::GetGlobalRequired("mlc.tokenizers.Tokenizer");
  Function encode = Function::GetGlobalRequired("mlc.tokenizers.TokenizerEncode");
  Function decode = Function::GetGlobalRequired("mlc.tokenizers.TokenizerDecode");
  tvm::ffi::Any tok = make(tvm::ffi::String(argv[1]));
  std::vector<std::string> out(argc - 2);
  std::vector<std::thread> threads;
  for (int i = 2; i < argc; ++i) {
    threads.emplace_back([&, i] {
      for (int rep = 0; rep < 10; ++rep) {
        auto ids = encode(tok, tvm::ffi::String(argv[i])).cast<tvm::ffi::Shape>();
        std::string line;
        for (int64_t id : ids) line += std::to_string(id) + " ";
        out[i - 2] = line + "|" + std::string(decode(tok, ids).cast<tvm::ffi::String>());
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& line : out) std::cout << line << "\n";
  return 0;
}
"""


def test_tokenizer_in_a_program_without_python(engine_lib, smollm2_tokenizer, tmp_path):
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        pytest.skip("no g++ here")
    tc = build.toolchain()
    (tmp_path / "main.cc").write_text(_STANDALONE)
    libdirs = [str(engine_lib.parent), *tc.libdirs]
    subprocess.run([cxx, "-std=c++17", "-O1", "main.cc", *(f"-I{p}" for p in tc.includes[1:]),
                    f"-L{tc.libdirs[1]}", "-ltvm_ffi", "-Wl,--no-as-needed", f"-L{engine_lib.parent}",
                    "-lmlc_llm_client", f"-Wl,-rpath,{':'.join(libdirs)}", "-o", "prog"],
                   cwd=tmp_path, check=True, capture_output=True, timeout=300)
    texts = [t for t in TEXTS if t and "\n" not in t][:4]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    r = subprocess.run([str(tmp_path / "prog"), str(smollm2_tokenizer), *texts], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(str(smollm2_tokenizer / "tokenizer.json"))
    lines = r.stdout.splitlines()
    assert lines == [" ".join(map(str, ref.encode(t, add_special_tokens=False).ids)) + " |" + t for t in texts]


_NO_MODEL = """
import json, sys, threading, time
from clients.mlc_engine.client import EngineError, MLCEngine
out = {}
engine = MLCEngine(sys.argv[1], sys.argv[2], model_lib="none.so", load=False)   # loops running, no model
try:
    engine.chat([{"role": "user", "content": "hi"}])
except EngineError as e:
    out["unloaded"] = str(e)
# The engine's own request validation (ChatCompletionRequest::FromJSON) runs before anything reads the model, so
# a malformed request shows the rejection path without one. (A well-formed request on an engine with no model
# makes MLC dereference a null default generation config: the client refuses it, above.)
engine._loaded = True
try:
    engine.chat("not a list of messages")
except EngineError as e:
    out["rejected"] = str(e)
t0 = time.monotonic()
engine.close()
out["close_s"] = time.monotonic() - t0
out["threads"] = [t.name for t in threading.enumerate() if t.name.startswith("mlc-")]
print(json.dumps(out))
"""


def test_json_ffi_engine_rejects_a_request_with_its_own_message(engine_lib, tmp_path):
    r = _run_py(_NO_MODEL, str(engine_lib), str(tmp_path), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["unloaded"] == "no model loaded (call reload() first)"
    assert out["rejected"] == 'request rejected: ValueError: key "messages" has unexpected value type.'
    assert out["close_s"] < 10 and out["threads"] == []                 # both loops stopped and joined


# MLC's ModelMetadata::FromJSON (cpp/metadata/model.cc) reads these without a default
_REQUIRED_METADATA = ["model_type", "quantization", "context_window_size", "prefill_chunk_size", "max_batch_size",
                      "tensor_parallel_shards", "params", "memory_usage"]
_REQUIRED_PARAM = ["name", "dtype", "shape", "preprocs"]


def _missing_metadata(bundle: Path) -> list[str]:
    import tvm
    from tvm.runtime.vm import VirtualMachine

    config = json.loads((bundle / "mlc-chat-config.json").read_text())
    vm = VirtualMachine(tvm.runtime.load_module(str(bundle / config["model_lib"])), tvm.cpu())
    meta = json.loads(vm["_metadata"]())
    missing = [k for k in _REQUIRED_METADATA if k not in meta]
    missing += sorted({f"params[].{k}" for p in meta.get("params", []) for k in _REQUIRED_PARAM if k not in p})
    if meta.get("kv_state_kind", "kv_cache") not in ("none", "rnn_state"):
        missing += [f"kv_cache.{k}" for k in ("num_hidden_layers", "head_dim", "num_attention_heads",
                                              "num_key_value_heads") if k not in meta.get("kv_cache", {})]
    return missing


def test_engine_serves_our_host_cpu_bundle(engine_lib, build_bundle):
    """The serve engine loads our host-cpu bundle and generates (the command line's path; the ids themselves are
    compared with our runner in tests/test_mlc_conformance.py)."""
    bundle = build_bundle("smollm2-135m", "host-cpu", "q4f16")
    assert not _missing_metadata(bundle)
    r = subprocess.run([sys.executable, "-m", "clients.mlc_engine.client", "--lib", str(engine_lib), "generate",
                        str(bundle), "1", "504", "3575", "282", "--max-tokens", "4"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "Traceback" not in r.stderr, _one_line_error(r.stderr)
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) >= 1 and out["usage"]["completion_tokens"] == len(out["token_ids"])


def test_engine_refuses_a_bundle_with_its_own_reason(engine_lib, build_bundle, tmp_path):
    """A bundle the engine cannot load (here: a chat config naming its template instead of carrying MLC's
    Conversation object) is one line with the engine's reason, never a crash, hang or traceback."""
    import shutil

    bundle = tmp_path / "bundle"
    shutil.copytree(build_bundle("smollm2-135m", "host-cpu", "q4f16"), bundle)
    cfg = json.loads((bundle / "mlc-chat-config.json").read_text())
    cfg["conv_template"] = "chatml"
    (bundle / "mlc-chat-config.json").write_text(json.dumps(cfg))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "clients.mlc_engine.client", "--lib", str(engine_lib), "chat",
                        str(bundle), "--prompt", "Hi", "--max-tokens", "4"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    line = _one_line_error(r.stderr)
    assert line.startswith("error: ") and "conv_template" in line and len(line) < 700, line
    assert time.monotonic() - t0 < 120


# ------------------------------------------------------------------------------------------------------------
# from scratch (make test-slow)
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_build_from_scratch_then_reuse(vendor, tmp_path, smollm2_tokenizer):
    env = {**os.environ, "MLC_ENGINE_CACHE_DIR": str(tmp_path / "cache")}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(BUILD)], capture_output=True, text=True, env=env, timeout=1800)
    seconds = time.monotonic() - t0
    assert r.returncode == 0, r.stderr[-5000:]
    total = 53 + len(build.GLUE)
    assert f"[{total}/{total}]" in r.stderr and "[1/" in r.stderr           # progress, N/M
    [entry] = [p for p in (tmp_path / "cache").iterdir() if p.name != "objects"]   # temp folders are gone
    lib = build.complete(entry)
    assert lib is not None and lib.name == "libmlc_llm_client.so"
    manifest = json.loads((entry / "manifest.json").read_text())
    assert len(manifest["sources"]) == total and manifest["build_seconds"] <= seconds
    assert seconds < 15 * 60
    # the same inputs: reused, nothing compiled
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(BUILD), "--print-path"], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == str(lib)
    assert "[1/" not in r.stderr and time.monotonic() - t0 < 60
    check_registry(lib)
    check_tokenizer(lib, smollm2_tokenizer)
