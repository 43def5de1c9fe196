"""A corpus of bad inputs, as a careless or hostile user would give them.

Each case is made here (never shipped) from a tiny Llama checkpoint, its GGUF twin, or a built bundle, and
run through the command line in a fresh process with its own cache. Every one must end in exit code 2 with
one `error:` line (no traceback, no "internal error"), within its time limit, leave no bundle behind and
no cache debris (no stale lock, no `.partial` folder). The fast cases run in the default suite, the rest in
`make test-slow`; `python tests/test_bad_inputs.py` prints the outcome table.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 180


# ------------------------------------------------------------------------------------------ inputs
def _tiny_llama(folder: Path, layers: int = 2) -> None:
    """A 2-layer Llama with a 128-word word-level tokenizer (so that `pipeline run` can chat with it)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, bos_token_id=0,
                      eos_token_id=1)
    LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True, max_shard_size="100KB")
    vocab = {"<unk>": 2, "<s>": 0, "</s>": 1, **{f"w{i}": i for i in range(3, 127)}, "word": 127}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>"}))


@dataclass
class Inputs:
    """The good inputs a case damages a copy of."""

    hf: Path          # a tiny Llama safetensors folder (sharded, with an index)
    gguf: Path        # the same model as a GGUF file
    bundle: Path      # a host-cpu bundle built from it


def _config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is _DELETE:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))


_DELETE = object()


def _shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def _header(shard: Path) -> tuple[int, dict]:
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8:8 + n])


def _rewrite_header(shard: Path, header: dict) -> None:
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    shard.write_bytes(raw[:8] + text.ljust(n, b" ") + raw[8 + n:])


def _poke_weight(folder: Path, value: float) -> None:
    """Set one float32 weight of the first 2-D tensor to `value` (NaN, inf, 1e30)."""
    for shard in _shards(folder):
        n, header = _header(shard)
        for name, entry in header.items():
            if name != "__metadata__" and len(entry["shape"]) == 2 and entry["dtype"] == "F32":
                data = bytearray(shard.read_bytes())
                start = 8 + n + entry["data_offsets"][0] + 4 * 7
                data[start:start + 4] = np.float32(value).tobytes()
                shard.write_bytes(bytes(data))
                return
    raise AssertionError("no float32 matrix found")


def _relabel_int32(folder: Path) -> None:
    shard = _shards(folder)[0]
    _, header = _header(shard)
    name = next(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32")
    header[name]["dtype"] = "I32"
    _rewrite_header(shard, header)


def _gguf_block_count(path: Path, count: int) -> None:
    data = bytearray(path.read_bytes())
    key = b"llama.block_count"
    at = data.index(key) + len(key)
    (kind,) = struct.unpack("<I", data[at:at + 4])
    assert kind == 4    # GGUF uint32
    data[at + 4:at + 8] = struct.pack("<I", count)
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------------------------------- cases
@dataclass
class Case:
    name: str
    make: Callable[[Inputs, Path], list[str]]   # damages copies under the case's folder, returns the argv
    expect: str                                  # a substring of the one error line
    slow: bool = False


def _hf(inputs: Inputs, work: Path, **config) -> Path:
    folder = work / "model"
    shutil.copytree(inputs.hf, folder)
    if config:
        _config(folder, **config)
    return folder


def _build(model: Path | str, work: Path, *extra: str, quant: str = "q0f32", target: str = "host-cpu") -> list[str]:
    return ["build", "--model", str(model), "--target", target, "--quant", quant, "--out", str(work / "dist"),
            *extra]


def _config_case(name: str, expect: str, slow: bool = False, **config) -> Case:
    return Case(name, lambda i, w: _build(_hf(i, w, **config), w), expect, slow)


def _with(change: Callable[[Path], object], expect: str, name: str, *extra: str, slow: bool = False,
          quant: str = "q0f32") -> Case:
    def make(inputs: Inputs, work: Path) -> list[str]:
        folder = _hf(inputs, work)
        change(folder)
        return _build(folder, work, *extra, quant=quant)
    return Case(name, make, expect, slow)


def _symlink_tokenizer(folder: Path) -> None:
    (folder / "tokenizer.json").unlink(missing_ok=True)
    (folder / "tokenizer.json").symlink_to("/etc/passwd")


def _index_escape(folder: Path) -> None:
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = "../../../../etc/passwd"
    index.write_text(json.dumps(data))


def _symlink_shard(folder: Path) -> None:
    shard = _shards(folder)[0]
    outside = folder.parent / "elsewhere.safetensors"
    shutil.move(shard, outside)
    shard.symlink_to(outside)


def _out_is_file(inputs: Inputs, work: Path) -> list[str]:
    (work / "dist").write_text("not a folder")
    return _build(inputs.hf, work)


def _out_under_a_file(inputs: Inputs, work: Path) -> list[str]:
    (work / "plain").write_text("a file")
    return ["build", "--model", str(inputs.hf), "--target", "host-cpu", "--quant", "q0f32",
            "--out", str(work / "plain" / "dist")]


def _gguf_blocks(inputs: Inputs, work: Path) -> list[str]:
    path = work / "model.gguf"
    shutil.copyfile(inputs.gguf, path)
    _gguf_block_count(path, 100000)
    return _build(path, work)


def _config_list(folder: Path) -> Path:
    (folder / "config.json").write_text("[1, 2, 3]")
    return folder


def _flipped_shard(inputs: Inputs, work: Path) -> list[str]:
    bundle = work / "bundle"
    shutil.copytree(inputs.bundle, bundle)
    shard = sorted(bundle.glob("params_shard_*.bin"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x01
    shard.write_bytes(bytes(data))
    return ["run", str(bundle), "--prompt", "hi"]


def _run(extra: list[str]) -> Callable[[Inputs, Path], list[str]]:
    return lambda inputs, work: ["run", str(inputs.bundle), "--max-new-tokens", "2", *extra]


CASES = [
    # the config against the tensors
    _config_case("zero attention heads", "num_attention_heads", num_attention_heads=0),
    _config_case("kv heads do not divide heads", "num_key_value_heads", num_key_value_heads=3),
    _config_case("zero layers", "num_hidden_layers", num_hidden_layers=0),
    _config_case("fewer layers than the checkpoint", "num_hidden_layers", num_hidden_layers=1),
    _config_case("negative layers", "num_hidden_layers", num_hidden_layers=-1),
    _config_case("more layers than the checkpoint", "num_hidden_layers", slow=True, num_hidden_layers=3),
    _config_case("huge vocab", "vocab_size", vocab_size=10**9),
    _config_case("vocab differs from the embedding", "vocab_size", vocab_size=100),
    _config_case("hidden size not a multiple of the heads", "hidden_size", hidden_size=62),
    _config_case("head_dim times heads differs from q_proj", "head_dim", head_dim=32),
    _config_case("zero rms_norm_eps", "rms_norm_eps", rms_norm_eps=0.0),
    _config_case("negative rope_theta", "rope_theta", slow=True, rope_theta=-1.0,
                 rope_parameters={"rope_type": "default", "rope_theta": -1.0}),
    _config_case("unknown rope_scaling type", "rope", rope_scaling={"rope_type": "nonsense", "factor": 2.0},
                 rope_parameters={"rope_type": "nonsense", "factor": 2.0, "rope_theta": 10000.0}),
    _config_case("unknown architecture", "architecture", slow=True, architectures=["GPT2LMHeadModel"],
                 model_type="gpt2"),
    _config_case("hidden_size missing", "hidden_size", slow=True, hidden_size=_DELETE),
    _config_case("zero KV heads", "num_key_value_heads", num_key_value_heads=0),
    _config_case("zero intermediate size", "intermediate_size", intermediate_size=0),
    _config_case("llama3 RoPE without its factors", "factor", slow=True,
                 rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0}),
    _config_case("partial rotary factor 2", "partial_rotary_factor", slow=True, partial_rotary_factor=2.0),
    _config_case("rms_norm_eps not a number", "rms_norm_eps", slow=True, rms_norm_eps="tiny"),
    Case("config.json holds a list", lambda i, w: _build(_config_list(_hf(i, w)), w), "JSON object"),
    # the tensors themselves
    _with(lambda f: _poke_weight(f, float("nan")), "not finite", "a NaN weight, calibrated scheme", quant="q4f16",
          slow=True),
    _with(lambda f: _poke_weight(f, float("nan")), "not finite", "a NaN weight", "--calibration", "none",
          quant="q4f16"),
    _with(lambda f: _poke_weight(f, float("inf")), "not finite", "an infinite weight", slow=True),
    _with(lambda f: _poke_weight(f, 1e30), "float16", "a weight beyond fp16 (q4 scale)", "--calibration", "none",
          quant="q4f16", slow=True),
    _with(_relabel_int32, "int32", "float weights labelled int32"),
    # the model folder as a boundary
    _with(_symlink_tokenizer, "outside", "tokenizer symlinked to a system file"),
    _with(_index_escape, "outside", "shard index naming ../../etc/passwd"),
    _with(_symlink_shard, "outside", "shard symlinked out of the folder", slow=True),
    # the command line
    Case("--out is a file", _out_is_file, "--out"),
    Case("--out under a file", _out_under_a_file, "--out", slow=True),
    Case("GGUF block count 100000", _gguf_blocks, "block_count"),
    Case("--temperature nan", _run(["--prompt", "hi", "--temperature", "nan"]), "--temperature"),
    Case("--max-new-tokens -1", _run(["--prompt", "hi", "--max-new-tokens", "-1"]), "--max-new-tokens", slow=True),
    Case("a 100k-character prompt", _run(["--prompt", "word " * 20000]), "context", slow=True),
    Case("--top-p 0", _run(["--prompt", "hi", "--top-p", "0", "--temperature", "1"]), "--top-p", slow=True),
    Case("unknown --phone", lambda i, w: _build(i.hf, w, "--phone", "nokia-3310"), "phone", slow=True),
    Case("unknown --kv-cache", lambda i, w: _build(i.hf, w, "--kv-cache", "int3"), "--kv-cache", slow=True),
    Case("--calibration names no file", lambda i, w: _build(i.hf, w, "--calibration", str(w / "nope.txt"),
                                                             quant="q4f16"), "calibration", slow=True),
    Case("run on a folder that is no bundle", lambda i, w: ["run", str(i.hf), "--prompt", "hi"], "not a bundle"),
    Case("run on a bundle with a flipped shard byte", _flipped_shard, "sha256"),
    Case("report on a folder that is no bundle", lambda i, w: ["report", str(i.hf)], "coverage", slow=True),
    Case("release file that does not exist", lambda i, w: ["release", str(w / "none.yaml")], "none.yaml",
         slow=True),
]


# ------------------------------------------------------------------------------------------ running
def run_case(case: Case, inputs: Inputs, work: Path) -> tuple[str, subprocess.CompletedProcess | None]:
    """Outcome: "clear error", "silent success", "internal error", "hang" or "unclear error"."""
    work.mkdir(parents=True, exist_ok=True)
    argv = case.make(inputs, work)
    env = {**os.environ, "MLP_CACHE_DIR": str(work / "cache")}
    env.pop("MLP_DEBUG", None)
    try:
        proc = subprocess.run([sys.executable, "-m", "pipeline", *argv], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return "hang", None
    if proc.returncode == 0:
        return "silent success", proc
    if "internal error" in proc.stderr or "Traceback" in proc.stderr:
        return "internal error", proc
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    ok = proc.returncode == 2 and len(errors) == 1 and errors[0] == proc.stderr.strip().splitlines()[-1]
    return ("clear error" if ok and case.expect in errors[0] else "unclear error"), proc


def debris(work: Path) -> list[str]:
    """What a failed build left: a bundle, a .partial folder or a lock file."""
    left = []
    dist = work / "dist"
    if dist.is_dir() and any(dist.iterdir()):
        left.append(f"dist: {sorted(p.name for p in dist.iterdir())}")
    cache = work / "cache"
    if cache.is_dir():
        left += [str(p.relative_to(work)) for p in cache.rglob("*") if ".partial" in p.name or p.suffix == ".lock"]
    return left


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Inputs:
    from test_load import write_gguf
    from transformers import LlamaForCausalLM

    from pipeline.progress import Reporter
    from pipeline.stages import run_pipeline

    root = tmp_path_factory.mktemp("good")
    hf = root / "hf"
    _tiny_llama(hf)
    gguf_path = root / "tiny.gguf"
    write_gguf(LlamaForCausalLM.from_pretrained(hf), gguf_path, "llama")
    bundle = run_pipeline(str(hf), "host-cpu", "q0f32", out=str(root / "dist"), report=Reporter(quiet=True)).bundle
    return Inputs(hf, gguf_path, bundle)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.slow else [])
                                  for c in CASES])
def test_bad_input_is_one_clear_line(case, inputs, tmp_path):
    outcome, proc = run_case(case, inputs, tmp_path)
    assert outcome == "clear error", f"{case.name}: {outcome}\n{proc.stderr if proc else ''}"
    assert not debris(tmp_path), debris(tmp_path)


if __name__ == "__main__":   # the outcome table over the whole corpus
    import tempfile
    from collections import Counter

    sys.path.insert(0, str(Path(__file__).parent))
    with tempfile.TemporaryDirectory() as tmp:
        from test_load import write_gguf
        from transformers import LlamaForCausalLM

        from pipeline.progress import Reporter
        from pipeline.stages import run_pipeline

        root = Path(tmp)
        _tiny_llama(root / "hf")
        write_gguf(LlamaForCausalLM.from_pretrained(root / "hf"), root / "tiny.gguf", "llama")
        built = run_pipeline(str(root / "hf"), "host-cpu", "q0f32", out=str(root / "dist"),
                             report=Reporter(quiet=True)).bundle
        good = Inputs(root / "hf", root / "tiny.gguf", built)
        counts: Counter = Counter()
        for i, case in enumerate(CASES):
            outcome, proc = run_case(case, good, root / f"case{i}")
            left = debris(root / f"case{i}")
            counts[outcome] += 1
            last = proc.stderr.strip().splitlines()[-1][:150] if proc and proc.stderr.strip() else ""
            print(f"| {case.name} | {outcome}{' + debris' if left else ''} | {last} |", flush=True)
        print(dict(counts))
