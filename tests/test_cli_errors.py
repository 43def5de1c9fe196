"""User mistakes end in one clear line (exit 2) and leave no bundle directory behind."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def good_folder(tmp_path_factory) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
    folder = tmp_path_factory.mktemp("good")
    LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True, max_shard_size="100KB")
    return folder


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def truncated(folder: Path) -> str:
    shard = _shards(folder)[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    return shard.name


def lying_header(folder: Path) -> str:
    shard = _shards(folder)[0]
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [max(1, x // 2) for x in header[name]["shape"]]
    assert header[name]["shape"] != json.loads(raw[8:8 + n])[name]["shape"]
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    shard.write_bytes(raw[:8] + text.ljust(n, b" ") + raw[8 + n:])
    return shard.name


def missing_shard(folder: Path) -> str:
    shard = _shards(folder)[-1]
    shard.unlink()
    return shard.name


def pickle_bin(folder: Path) -> str:
    for s in _shards(folder):
        s.unlink()
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    return "pytorch_model.bin"


def run_build(model: str, out: Path, target: str = "host-cpu") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", "build", "--model", model, "--target", target,
                           "--quant", "q0f32", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def config_not_json(folder: Path) -> str:
    (folder / "config.json").write_text("{ this is not json")
    return "config.json"


def config_disagrees_with_weights(folder: Path) -> str:
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(cfg))
    return "intermediate_size is 96"


def tensor_the_config_never_reads(folder: Path) -> str:
    """A Qwen3-style q-norm weight in a Llama checkpoint: a Llama build would drop it and compute another model."""
    import numpy as np
    from safetensors.numpy import save_file

    name = "model.layers.0.self_attn.q_norm.weight"
    save_file({name: np.ones(16, np.float32)}, str(folder / "extra.safetensors"))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"][name] = "extra.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return name


@pytest.mark.parametrize("breaker", [truncated, lying_header, missing_shard, pickle_bin, config_not_json,
                                     config_disagrees_with_weights, tensor_the_config_never_reads])
def test_bad_weights_one_line_no_bundle(tmp_path, good_folder, breaker):
    folder = _copy(good_folder, tmp_path / "model")
    culprit = breaker(folder)
    out = tmp_path / "dist"
    proc = run_build(str(folder), out)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], proc.stderr   # progress lines may precede it
    assert culprit in errors[0]
    assert "Traceback" not in proc.stderr
    assert not out.exists() or not any(out.iterdir())


def test_unknown_target(tmp_path):
    out = tmp_path / "dist"
    proc = run_build("smollm2-135m", out, target="nokia-3310")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown target 'nokia-3310'" in lines[0] and "host-cpu" in lines[0]
    assert not out.exists()


def test_unknown_model_and_quant(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pipeline", "build", "--model", "gpt-17", "--quant", "q3z"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "error:" in proc.stderr


def test_vulkan_target_says_what_is_missing(tmp_path):
    out = tmp_path / "dist"
    proc = run_build("smollm2-135m", out, target="android-vulkan")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "target.build.vulkan" in lines[0] and "USE_VULKAN" in lines[0]
    assert not out.exists()


@pytest.fixture(scope="module")
def built_bundle(tmp_path_factory, good_folder) -> Path:
    from pipeline.progress import Reporter
    from pipeline.stages import run_pipeline

    out = tmp_path_factory.mktemp("dist")
    return run_pipeline(str(good_folder), "host-cpu", "q0f32", out=str(out), report=Reporter(quiet=True)).bundle


def _run(bundle: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", "run", str(bundle), "--prompt", "hi",
                           "--max-new-tokens", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_run_refuses_a_modified_library(tmp_path, built_bundle):
    """`pipeline run` checks every file against the manifest's sha256 before it loads anything."""
    bundle = _copy(built_bundle, tmp_path / "b")
    lib = next((bundle / "lib").glob("*.so"))
    data = bytearray(lib.read_bytes())
    data[len(data) // 2] ^= 0xFF
    lib.write_bytes(bytes(data))
    result = _run(bundle)
    assert result.returncode == 2, result.stderr
    assert "sha256 differs from manifest.json" in result.stderr and lib.name in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_run_refuses_a_model_lib_outside_the_bundle(tmp_path, built_bundle):
    bundle = _copy(built_bundle, tmp_path / "b")
    cfg = json.loads((bundle / "mlc-chat-config.json").read_text())
    (tmp_path / "evil.so").write_bytes((bundle / cfg["model_lib"]).read_bytes())
    cfg["model_lib"] = "../evil.so"
    (bundle / "mlc-chat-config.json").write_text(json.dumps(cfg))
    result = subprocess.run([sys.executable, "-m", "pipeline", "run", str(bundle), "--prompt", "hi",
                             "--skip-verify"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert "model_lib '../evil.so' is not a file inside the bundle" in result.stderr


@pytest.mark.parametrize("flag", ["--oclgrind", "--no-oclgrind"])
def test_oclgrind_choice_without_the_pocl_run_is_refused(tmp_path, flag):
    """--oclgrind / --no-oclgrind choose what runs after the PoCL run: with --no-verify there is none."""
    out = tmp_path / "dist"
    proc = subprocess.run([sys.executable, "-m", "pipeline", "build", "--model", "smollm2-135m", "--target",
                           "android-adreno", "--no-verify", flag, "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "--no-verify turns off" in lines[0], proc.stderr
    assert not out.exists()
