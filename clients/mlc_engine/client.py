"""Drive MLC-LLM's C++ serving engine (libmlc_llm_client.so, built by build.py) from Python.

Loading the library into this process (after `import tvm`, so that it binds to the same libtvm_runtime /
libtvm_ffi) registers MLC's global functions in tvm-ffi's registry. Two front ends of the same engine:

* `MLCEngine`: the JSON FFI that MLC's iOS / Android apps use (cpp/json_ffi/json_ffi_engine.cc,
  `mlc.json_ffi.CreateJSONFFIEngine`): OpenAI-style chat requests in, streamed chat-completion chunks out.
  Its stream carries text and the final usage, never token ids (GetResponseFromStreamOutput turns the ids
  into text and drops logprobs), so `chat()` returns `token_ids=None`.
* `MLCServeEngine`: the threaded engine beneath it (cpp/serve/threaded_engine.cc,
  `mlc.serve.create_threaded_engine`), which MLC's own Python package drives: token ids in
  (`mlc.serve.TokenData`), the ids the engine sampled out (`mlc.serve.RequestStreamOutputUnpack`). This is the
  faithful way to compare the engine's generation with our own runner, token for token.

Both run the engine's two blocking loops (`run_background_loop`, `run_background_stream_back_loop`) in their
own Python threads (tvm-ffi releases the GIL during the calls) and stop them in `close()`. An error from the
engine — a request it rejects, a model it cannot load — raises `EngineError`, whose text is the engine's own
message on one line (its JSON dumps left out; `.detail` keeps everything).

    python -m clients.mlc_engine.client chat dist/<bundle> --prompt "Hello"
    python -m clients.mlc_engine.client tokenize dist/<bundle> "some text"

docs/mlc-engine.md has the details.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import json
import queue
import re
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

# DLPack device type codes (dlpack.h: kDLCPU = 1, kDLCUDA = 2, kDLOpenCL = 4, kDLVulkan = 7, kDLMetal = 8, ...)
DEVICE_TYPES = {"cpu": 1, "cuda": 2, "opencl": 4, "vulkan": 7, "metal": 8, "rocm": 10, "webgpu": 15}

_LOADED: dict[str, ctypes.CDLL] = {}
_LOAD_LOCK = threading.Lock()
_LIVE: weakref.WeakSet = weakref.WeakSet()


class EngineError(RuntimeError):
    """An error reported by the engine: `str()` is one line, `.detail` the full text (log records included)."""

    def __init__(self, message: str, detail: str | None = None):
        super().__init__(message)
        self.detail = detail if detail is not None else message


class ChatResult(NamedTuple):
    text: str
    usage: dict
    token_ids: list[int] | None      # None from the JSON FFI (its stream has no ids); see MLCServeEngine
    finish_reason: str | None


class StreamChunk(NamedTuple):
    delta: str                       # new text ("" in the final usage chunk)
    finish_reason: str | None
    usage: dict | None               # set in the last chunk only


class GenerateResult(NamedTuple):
    token_ids: list[int]
    finish_reason: str | None
    usage: dict


# ----------------------------------------------------------------------------------------------------------
# the library and its messages

def load_library(lib_path: str | Path) -> Path:
    """Load libmlc_llm_client.so once per process (RTLD_GLOBAL, after the wheel's runtime)."""
    import tvm  # noqa: F401  (loads libtvm_runtime / libtvm_ffi: the library must bind to these copies)

    path = Path(lib_path).resolve()
    if not path.is_file():
        raise EngineError(f"MLC engine library not found: {path} (build it with `make mlc-engine`)")
    with _LOAD_LOCK:
        if str(path) not in _LOADED:
            if _LOADED:
                # a second copy would register the same global functions again
                raise EngineError(f"another MLC engine library is loaded in this process already "
                                  f"({next(iter(_LOADED))}); one per process")
            _LOADED[str(path)] = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    return path


def _func(name: str):
    import tvm_ffi

    f = tvm_ffi.get_global_func(name, allow_missing=True)
    if f is None:
        raise EngineError(f"global function {name} is not registered (is libmlc_llm_client.so loaded?)")
    return f


_TIMESTAMP = re.compile(r"^\[\d\d:\d\d:\d\d\] ")
_GENERIC = ("", "std::exception")


def one_line(text: str, limit: int = 600) -> str:
    """An engine message on one line: log timestamps and long JSON dumps (e.g. the whole _metadata) left out."""
    parts = []
    for line in str(text).splitlines():
        line = line.strip()
        if not line:
            continue
        if _TIMESTAMP.match(line):
            line = _TIMESTAMP.sub("", line)
        elif line[0] in "{[" and len(line) > 160:
            parts.append(f"<{len(line)} characters of JSON>")
            continue
        parts.append(line)
    out = " ".join(parts) or "unknown engine error"
    return out if len(out) <= limit else out[: limit - 1] + "…"


def _exception_text(exc: BaseException) -> str:
    return str(exc.args[0]) if getattr(exc, "args", None) else str(exc)


def _engine_error(exc: BaseException | None, log_records: list[dict], context: str) -> EngineError:
    """The engine's own message: the exception's text, or, where MLC threw a bare std::exception after logging
    the reason (cpp/metadata/model.cc), the last warning / error it logged."""
    text = _exception_text(exc) if exc is not None else ""
    kind = type(exc).__name__ if exc is not None else "error"
    logged = [r["text"] for r in log_records if re.search(r": (Warning|Error): ", r["text"].split("\n", 1)[0])]
    detail = "\n".join([f"{kind}: {text}", *logged])
    if text.strip() in _GENERIC and logged:
        message = one_line(logged[-1])
    else:
        message = one_line(text) if text.strip() else f"{kind} (no message)"
    return EngineError(f"{context}: {message}", detail)


class _Log:
    """The engine's recent log records (engine_log.cc tees std::cerr into a ring)."""

    def __init__(self):
        self.seq = int(_func("mlc_client.log_capture_start")())

    def records(self) -> list[dict]:
        return json.loads(str(_func("mlc_client.log_records_since")(self.seq)))


# ----------------------------------------------------------------------------------------------------------
# the two engines

def parse_device(device: str) -> tuple[int, int]:
    name, _, index = device.partition(":")
    if name not in DEVICE_TYPES:
        raise EngineError(f"unknown device {device!r}; one of {', '.join(DEVICE_TYPES)} (optionally ':<id>')")
    return DEVICE_TYPES[name], int(index or 0)


def resolve_model_lib(model_dir: Path, model_lib: str | Path | None) -> Path:
    """model_lib as given (relative: to model_dir), else the bundle's mlc-chat-config.json "model_lib"."""
    if model_lib is None:
        try:
            model_lib = json.loads((model_dir / "mlc-chat-config.json").read_text())["model_lib"]
        except (OSError, ValueError, KeyError) as e:
            raise EngineError(f"no model_lib given and none in {model_dir / 'mlc-chat-config.json'} ({e})") from None
    lib = Path(model_lib)
    return lib if lib.is_absolute() else model_dir / lib


class _Engine:
    """The loop threads, reload with failure detection, close / context manager; subclasses make the module."""

    _LOOPS = ("run_background_loop", "run_background_stream_back_loop")

    def __init__(self, lib_path: str | Path, model_dir: str | Path, model_lib: str | Path | None = None,
                 device: str = "cpu", mode: str = "local", reload_timeout: float | None = 900.0,
                 load: bool = True, **engine_config: Any):
        """engine_config: further EngineConfig fields (max_num_sequence, max_total_sequence_length,
        prefill_chunk_size, kv_cache_page_size, prefix_cache_mode, verbose, ...; cpp/serve/config.cc).
        load=False starts the engine and its loops without a model (`reload()` loads it later)."""
        self.lib_path = load_library(lib_path)
        self.model_dir = Path(model_dir).resolve()
        self.model_lib = resolve_model_lib(self.model_dir, model_lib).resolve()
        self.device = parse_device(device)
        self.engine_config = {"model": str(self.model_dir), "model_lib": str(self.model_lib), "mode": mode,
                              **engine_config}
        self._queues: dict[str, queue.Queue] = {}
        self._queues_lock = threading.Lock()
        self._loop_errors: dict[str, BaseException] = {}
        self._loop_failed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._broken: EngineError | None = None
        self._loaded = False
        self._log = _Log()
        self._module = self._create()
        _LIVE.add(self)
        try:
            self._init_module()
            for name in self._LOOPS:
                t = threading.Thread(target=self._run_loop, args=(name,), name=f"mlc-{name}", daemon=True)
                t.start()
                self._threads.append(t)
            if load:
                self.reload(reload_timeout)
        except BaseException:
            self.close()
            raise

    # -- subclass hooks
    def _create(self):
        raise NotImplementedError

    def _init_module(self) -> None:
        raise NotImplementedError

    # -- loops
    def _run_loop(self, name: str) -> None:
        try:
            self._module[name]()
        except BaseException as e:  # the engine threw inside its loop: the engine is unusable from here on
            self._loop_errors[name] = e
            self._loop_failed.set()
            with self._queues_lock:
                for q in self._queues.values():
                    q.put(None)  # wake the waiting requests

    def _loop_error(self, context: str) -> EngineError:
        name, exc = next(iter(self._loop_errors.items()))
        err = _engine_error(exc, self._log.records(), f"{context} ({name} stopped)")
        self._broken = err
        return err

    def reload(self, timeout: float | None = 900.0) -> None:
        """Load the model (self.engine_config). MLC's reload() waits inside C++ until the background loop has
        loaded the model; when loading throws, the exception ends the loop thread and reload() would wait
        forever, so it runs in a thread of its own while this one watches both."""
        if self._closed or self._broken is not None or self._loop_failed.is_set():
            self._check_usable()
        self._log = _Log()   # the reasons for this load: records from here on
        box: dict[str, BaseException] = {}
        done = threading.Event()
        config = json.dumps(self.engine_config)

        def run():
            try:
                self._module["reload"](config)
            except BaseException as e:
                box["error"] = e
            finally:
                done.set()

        threading.Thread(target=run, name="mlc-reload", daemon=True).start()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done.wait(0.05):
            if self._loop_failed.is_set():
                # the reload thread stays blocked in the engine (a daemon thread; see docs/mlc-engine.md)
                raise self._loop_error(f"loading {self.model_dir.name} failed")
            if deadline is not None and time.monotonic() > deadline:
                raise EngineError(f"loading {self.model_dir.name} did not finish within {timeout:.0f} s")
        if "error" in box:
            raise _engine_error(box["error"], self._log.records(), f"loading {self.model_dir.name} failed")
        self._loaded = True

    def _check_usable(self) -> None:
        if self._closed:
            raise EngineError("engine is closed")
        if self._broken is not None:
            raise EngineError(f"engine is not usable: {self._broken}", self._broken.detail)
        if self._loop_failed.is_set():
            raise self._loop_error("engine stopped")
        if not self._loaded:
            # MLC's AddRequest reads the loaded model's default generation config: without one it crashes
            raise EngineError("no model loaded (call reload() first)")

    def _next(self, q: queue.Queue, timeout: float | None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                item = q.get(timeout=0.1)
            except queue.Empty:
                item = None
            if item is not None:
                return item
            if self._loop_failed.is_set():
                raise self._loop_error("generation failed")
            if deadline is not None and time.monotonic() > deadline:
                raise EngineError(f"no output from the engine within {timeout:.0f} s")

    def close(self) -> None:
        """Stop the loops and join their threads (idempotent)."""
        if self._closed:
            return
        self._closed = True
        module = getattr(self, "_module", None)
        if module is not None:
            try:
                module["exit_background_loop"]()
            except Exception:  # noqa: S110 - closing must not raise; the loops are told to stop either way
                pass
        for t in self._threads:
            t.join(timeout=30)
        with self._queues_lock:
            for q in self._queues.values():
                q.put(None)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: S110
            pass


class MLCEngine(_Engine):
    """MLC's JSON FFI engine (OpenAI-style chat completions) over one model.

        with MLCEngine(lib, "dist/<bundle>") as engine:
            text, usage, _, _ = engine.chat([{"role": "user", "content": "Hi"}], max_tokens=32, temperature=0)
    """

    def _create(self):
        return _func("mlc.json_ffi.CreateJSONFFIEngine")()

    def _init_module(self) -> None:
        self._module["init_background_engine"](self.device[0], self.device[1], self._on_stream)

    def _on_stream(self, responses_json: str) -> None:
        # called by the engine's stream-back loop (our thread) with a JSON array of chunks; must not raise
        try:
            responses = json.loads(str(responses_json))
        except ValueError:
            return
        with self._queues_lock:
            for resp in responses:
                q = self._queues.get(resp.get("id"))
                if q is not None:
                    q.put(resp)

    def stream(self, messages: list[dict], timeout: float | None = None, **fields: Any) -> Iterator[StreamChunk]:
        """Yield the reply as it is generated; the last chunk carries the usage. Any OpenAI chat field (max_tokens,
        temperature, top_p, seed, stop, n, logprobs, response_format, ...) passes through to the engine."""
        self._check_usable()
        request_id = f"chat-{uuid.uuid4().hex}"
        q: queue.Queue = queue.Queue()
        with self._queues_lock:
            self._queues[request_id] = q
        finished = False
        try:
            try:
                ok = self._module["chat_completion"](json.dumps({"messages": messages, **fields}), request_id)
            except Exception as e:
                finished = True
                raise _engine_error(e, self._log.records(), "request rejected") from None
            if not ok:  # rejected before it reached the engine (bad request, prompt too long, ...)
                finished = True
                raise EngineError(f"request rejected: {one_line(str(self._module['get_last_error']()))}")
            while True:
                resp = self._next(q, timeout)
                choices = resp.get("choices") or []
                if not choices and resp.get("usage") is not None:
                    finished = True
                    yield StreamChunk("", None, resp["usage"])
                    return
                for choice in choices:
                    if choice.get("index", 0) != 0:
                        continue
                    delta = (choice.get("delta") or {}).get("content") or ""
                    if isinstance(delta, list):  # content parts
                        delta = "".join(p.get("text", "") for p in delta if isinstance(p, dict))
                    reason = choice.get("finish_reason")
                    if reason == "error":
                        finished = True
                        raise EngineError(f"request failed: {one_line(delta)}")
                    yield StreamChunk(delta, reason, None)
        finally:
            with self._queues_lock:
                self._queues.pop(request_id, None)
            if not finished and not self._closed and not self._loop_failed.is_set():
                self._module["abort"](request_id)

    def chat(self, messages: list[dict], timeout: float | None = None, **fields: Any) -> ChatResult:
        """The whole reply: (text, usage, token_ids=None, finish_reason)."""
        parts, reason, usage = [], None, {}
        for chunk in self.stream(messages, timeout=timeout, **fields):
            parts.append(chunk.delta)
            reason = chunk.finish_reason or reason
            if chunk.usage is not None:
                usage = chunk.usage
        return ChatResult("".join(parts), usage, None, reason)

    def reset(self) -> None:
        self._check_usable()
        self._module["reset"]()


class MLCServeEngine(_Engine):
    """MLC's threaded serving engine: prompt token ids in, sampled token ids out (no chat template).

        with MLCServeEngine(lib, "dist/<bundle>") as engine:
            ids = engine.generate([1, 504, 3575], max_tokens=16).token_ids   # greedy: temperature 0
    """

    def _create(self):
        return _func("mlc.serve.create_threaded_engine")()

    def _init_module(self) -> None:
        import tvm_ffi

        names = {v: k for k, v in DEVICE_TYPES.items()}
        device = tvm_ffi.device(names[self.device[0]], self.device[1])
        self._unpack = _func("mlc.serve.RequestStreamOutputUnpack")
        self._token_data = _func("mlc.serve.TokenData")
        self._module["init_threaded_engine"](device, self._on_stream, None)

    def _on_stream(self, outputs) -> None:
        # Array<RequestStreamOutput> from the stream-back loop; each unpacks once into
        # [request_id, group_delta_token_ids, group_delta_logprob_json_strs, group_finish_reason,
        #  request_final_usage_json_str, group_extra_prefix_string]
        try:
            for out in outputs:
                rid, delta_ids, _logprobs, reasons, usage_json, _prefix = self._unpack(out)
                item = {"ids": [list(map(int, s)) for s in delta_ids],
                        "reasons": [None if r is None else str(r) for r in reasons],
                        "usage": None if usage_json is None else json.loads(str(usage_json))}
                with self._queues_lock:
                    q = self._queues.get(str(rid))
                if q is not None:
                    q.put(item)
        except Exception as e:  # never raise into the engine's loop
            print(f"mlc-engine client: stream callback failed: {e}", file=sys.stderr)

    def generate(self, prompt_ids: list[int], max_tokens: int, temperature: float = 0.0,
                 timeout: float | None = None, **generation_config: Any) -> GenerateResult:
        """Generate from prompt token ids; temperature 0 is greedy (the CPU sampler takes top_p = 0 below 1e-5).
        generation_config passes through (stop_token_ids, ignore_eos via debug_config, seed, ...)."""
        self._check_usable()
        request_id = f"gen-{uuid.uuid4().hex}"
        config = {"max_tokens": max_tokens, "temperature": temperature, **generation_config}
        q: queue.Queue = queue.Queue()
        with self._queues_lock:
            self._queues[request_id] = q
        finished = False
        try:
            try:
                request = self._module["create_request"](
                    request_id, [self._token_data(*map(int, prompt_ids))], json.dumps(config))
                self._module["add_request"](request)
            except Exception as e:
                finished = True
                raise _engine_error(e, self._log.records(), "request rejected") from None
            ids: list[int] = []
            reason = None
            while True:
                item = self._next(q, timeout)
                if item["usage"] is not None:
                    finished = True
                    if reason == "error":
                        raise EngineError(f"request failed: the engine ended it with finish_reason=error after "
                                          f"{len(ids)} token(s)")
                    return GenerateResult(ids, reason, item["usage"])
                if item["ids"]:
                    ids.extend(item["ids"][0])
                if item["reasons"] and item["reasons"][0] is not None:
                    reason = item["reasons"][0]
        finally:
            with self._queues_lock:
                self._queues.pop(request_id, None)
            if not finished and not self._closed and not self._loop_failed.is_set():
                self._module["abort_request"](request_id)

    def complete_engine_config(self) -> dict:
        self._check_usable()
        return json.loads(str(self._module["get_complete_engine_config"]()))


class MLCTokenizer:
    """MLC's own C++ Tokenizer (cpp/tokenizers/tokenizers.cc, Tokenizer::FromPath) over a bundle's tokenizer."""

    def __init__(self, lib_path: str | Path, path: str | Path):
        load_library(lib_path)
        try:
            self._tok = _func("mlc.tokenizers.Tokenizer")(str(path))
        except EngineError:
            raise
        except Exception as e:
            raise _engine_error(e, [], f"loading the tokenizer in {path} failed") from None

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in _func("mlc.tokenizers.TokenizerEncode")(self._tok, text)]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [[int(i) for i in s] for s in _func("mlc.tokenizers.TokenizerEncodeBatch")(self._tok, texts)]

    def decode(self, ids: list[int]) -> str:
        import tvm_ffi

        return str(_func("mlc.tokenizers.TokenizerDecode")(self._tok, tvm_ffi.Shape([int(i) for i in ids])))


@atexit.register
def _close_all() -> None:
    for engine in list(_LIVE):
        try:
            engine.close()
        except Exception:  # noqa: S110
            pass


# ----------------------------------------------------------------------------------------------------------
# command line

def _default_lib() -> Path:
    from . import build

    lib = build.cached_library()
    if lib is None:
        raise EngineError("the MLC engine is not built yet for this checkout; run `make mlc-engine`")
    return lib


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clients.mlc_engine.client", description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", help="libmlc_llm_client.so (default: the one `make mlc-engine` built)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("chat", help="one chat turn through the JSON FFI")
    c.add_argument("bundle")
    c.add_argument("--prompt", required=True)
    c.add_argument("--max-tokens", type=int, default=64)
    c.add_argument("--temperature", type=float, default=0.0)
    c.add_argument("--device", default="cpu")
    g = sub.add_parser("generate", help="greedy token ids from prompt token ids (the serve engine)")
    g.add_argument("bundle")
    g.add_argument("ids", type=int, nargs="+")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--device", default="cpu")
    t = sub.add_parser("tokenize", help="encode / decode with MLC's C++ tokenizer (JSON out)")
    t.add_argument("path", help="a folder with tokenizer.json (or the file)")
    t.add_argument("texts", nargs="+")
    args = ap.parse_args(argv)
    try:
        lib = Path(args.lib) if args.lib else _default_lib()
        if args.cmd == "tokenize":
            tok = MLCTokenizer(lib, args.path)
            ids = [tok.encode(s) for s in args.texts]
            print(json.dumps({"ids": ids, "batch": tok.encode_batch(args.texts),
                              "decoded": [tok.decode(i) for i in ids]}, ensure_ascii=False))
        elif args.cmd == "chat":
            with MLCEngine(lib, args.bundle, device=args.device) as engine:
                for chunk in engine.stream([{"role": "user", "content": args.prompt}],
                                           max_tokens=args.max_tokens, temperature=args.temperature):
                    print(chunk.delta, end="", flush=True)
                    if chunk.usage is not None:
                        print(f"\n[usage] {json.dumps(chunk.usage)}", file=sys.stderr)
                print()
        else:
            with MLCServeEngine(lib, args.bundle, device=args.device) as engine:
                r = engine.generate(args.ids, max_tokens=args.max_tokens)
                print(json.dumps({"token_ids": r.token_ids, "finish_reason": r.finish_reason, "usage": r.usage}))
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
