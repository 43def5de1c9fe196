"""An interrupted weight conversion resumes where it stopped and gives byte-identical output."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from pipeline.progress import Reporter
from pipeline.quant.convert import hf_sources
from pipeline.quant.resumable import (
    FAIL_ENV,
    FAIL_EXIT_CODE,
    JOURNAL,
    convert_weights,
    param_nbytes,
    partial_dir,
)

ROOT = Path(__file__).resolve().parent.parent
CAP = 8192          # small shards: the tiny model spreads over many of them, big and packed ones alike


class Recorder(Reporter):
    """A quiet reporter that keeps the info lines and what the byte bar was told."""

    def __init__(self):
        super().__init__(quiet=True)
        self.lines: list[str] = []
        self.bar: dict = {}

    def info(self, text: str) -> None:
        self.lines.append(text)

    @contextmanager
    def bytes_bar(self, title, total, completed=0):
        self.bar = {"total": total, "completed": completed, "advanced": 0}

        def advance(n):
            self.bar["advanced"] += n
        yield advance


class Interrupted(KeyboardInterrupt):
    pass


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from pipeline.config import load_model, load_quant, load_target
    from pipeline.stages import define, load

    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=128,
                      tie_word_embeddings=False)
    folder = tmp_path_factory.mktemp("tiny-qwen3-resume")
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    loaded = load(load_model(str(folder)))
    return loaded, define(loaded, load_quant("q4f16_0"), load_target("host-cpu"))


def _convert(model, final: Path, report: Reporter | None = None, **kw) -> Path:
    loaded, defined = model
    return convert_weights(loaded.checkpoint, defined.params, defined.layout, final, report=report or Recorder(),
                           tied=loaded.decoder.tie_word_embeddings, metadata={"ParamSize": len(defined.params)},
                           shard_cap_bytes=CAP, **kw)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _stop_at(n: int):
    def hook(finished: int) -> None:
        if finished == n:
            raise Interrupted
    return hook


def _reads_while(ckpt, fn) -> list[str]:
    """Names of the tensors `fn()` reads from `ckpt`."""
    reads: list[str] = []
    real = ckpt.get_rows
    ckpt.get_rows = lambda name, a, b: reads.append(name) or real(name, a, b)
    try:
        fn()
    finally:
        del ckpt.get_rows
    return reads


@pytest.fixture(scope="module")
def clean(model, tmp_path_factory) -> dict[str, bytes]:
    return _files(_convert(model, tmp_path_factory.mktemp("clean") / "key"))


def test_resume_after_any_shard_is_byte_identical(model, clean, tmp_path):
    loaded, defined = model
    shards = len(json.loads(clean["tensor-cache.json"])["records"])
    assert shards >= 6
    sizes = param_nbytes(defined.params)
    for n in range(1, shards):
        final = tmp_path / f"stop{n}" / "key"
        with pytest.raises(Interrupted):
            _convert(model, final, after_shard=_stop_at(n))
        assert not final.exists() and (partial_dir(final) / JOURNAL).is_file()
        report = Recorder()
        reads = _reads_while(loaded.checkpoint, lambda f=final, r=report: _convert(model, f, r))
        assert any(f"skipped {n} finished shards" in line for line in report.lines), report.lines
        assert _files(final) == clean, n
        assert not partial_dir(final).exists() and not final.with_name("key.lock").exists()
        # The bar starts at the bytes already converted; the rest is advanced as it is produced.
        done = report.bar["completed"]
        start = next(i for i in range(len(sizes) + 1) if sum(sizes[:i]) == done)
        assert start > 0 and done + report.bar["advanced"] == report.bar["total"] == sum(sizes)
        # Tensors in finished shards are not read again (a q_scale may need its q_weight's source).
        needed = {src for name, _ in defined.params[max(0, start - 1):] for src in hf_sources(name)[0]}
        assert set(reads) <= needed and reads


@pytest.mark.parametrize("damage", ["garbage journal", "other shard cap", "corrupt finished shard",
                                    "truncated open shard", "missing finished shard"])
def test_bad_journal_or_shards_start_over(model, clean, tmp_path, damage):
    final = tmp_path / "key"
    with pytest.raises(Interrupted):
        _convert(model, final, after_shard=_stop_at(4))
    partial = partial_dir(final)
    journal = json.loads((partial / JOURNAL).read_text())
    finished = journal["writer"]["shards"][0]["dataPath"]
    if damage == "garbage journal":
        (partial / JOURNAL).write_text("{not json")
    elif damage == "other shard cap":
        (partial / JOURNAL).write_text(json.dumps({**journal, "shard_cap_bytes": 123}))
    elif damage == "corrupt finished shard":
        data = bytearray((partial / finished).read_bytes())
        data[0] ^= 0xFF
        (partial / finished).write_bytes(bytes(data))
    elif damage == "truncated open shard":
        open_shard = journal["writer"]["open"]
        assert open_shard and open_shard["nbytes"] > 0
        with open(partial / f"params_shard_{open_shard['index']}.bin", "r+b") as f:
            f.truncate(open_shard["nbytes"] - 1)
    else:
        (partial / finished).unlink()
    report = Recorder()
    _convert(model, final, report)
    notes = [line for line in report.lines if "cannot resume" in line]
    assert len(notes) == 1 and "starting over" in notes[0] and "\n" not in notes[0]
    assert not any("resuming" in line for line in report.lines)
    assert _files(final) == clean


def test_leftover_partial_without_journal_is_ignored(model, clean, tmp_path):
    final = tmp_path / "key"
    partial_dir(final).mkdir()
    (partial_dir(final) / "params_shard_0.bin").write_bytes(b"junk from a run killed before its first shard")
    report = Recorder()
    _convert(model, final, report)
    assert _files(final) == clean and report.lines == []


# ------------------------------------------------------------------------------------------- CLI, killed
def _write_checkpoint(folder: Path) -> None:
    """A Llama whose q4 embedding and lm_head (16 MiB each) get shards of their own: 3 shards in all."""
    from safetensors.numpy import save_file

    hidden, inter, vocab, layers, heads, kv, head_dim = 1024, 2048, 32768, 2, 8, 2, 128
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv, "head_dim": head_dim, "vocab_size": vocab, "max_position_embeddings": 256,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
           "torch_dtype": "bfloat16"}
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(0)

    def w(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)

    tensors = {"model.embed_tokens.weight": w(vocab, hidden), "lm_head.weight": w(vocab, hidden),
               "model.norm.weight": np.ones(hidden, ml_dtypes.bfloat16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({p + "input_layernorm.weight": np.ones(hidden, ml_dtypes.bfloat16),
                        p + "post_attention_layernorm.weight": np.ones(hidden, ml_dtypes.bfloat16),
                        p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
                        p + "self_attn.k_proj.weight": w(kv * head_dim, hidden),
                        p + "self_attn.v_proj.weight": w(kv * head_dim, hidden),
                        p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
                        p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
                        p + "mlp.down_proj.weight": w(hidden, inter)})
    save_file(tensors, str(folder / "model.safetensors"))


def _cli_build(model: Path, out: Path, cache: Path, fail_after: int | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "MLP_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    env.pop(FAIL_ENV, None)
    if fail_after is not None:
        env[FAIL_ENV] = str(fail_after)
    cmd = [sys.executable, "-m", "pipeline", "build", "--model", str(model), "--target", "host-cpu",
           "--quant", "q4f16", "--out", str(out)]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow     # two CLI builds + one in-process (~95 s): `make test-slow`; the resume logic itself is
# pinned by the tests above
def test_killed_cli_build_resumes_to_identical_bundle(tmp_path, monkeypatch):
    from pipeline.stages import run_pipeline

    folder = tmp_path / "llama-3-shards"
    _write_checkpoint(folder)
    cache, out = tmp_path / "cache", tmp_path / "dist"

    killed = _cli_build(folder, out, cache, fail_after=2)
    assert killed.returncode == FAIL_EXIT_CODE, killed.stderr[-2000:]
    assert not out.exists() or not any(out.iterdir())
    partials = list((cache / "weights").glob("*.partial"))
    assert len(partials) == 1 and (partials[0] / JOURNAL).is_file()

    resumed = _cli_build(folder, out, cache)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "skipped 2 finished shards" in resumed.stderr, resumed.stderr[-2000:]
    assert not list((cache / "weights").glob("*.partial"))

    # The reference: an uninterrupted build into another cache and out dir. The compiled library is
    # taken from the first cache: it does not depend on the weights, and TVM 0.27's LLVM build is not
    # bit-reproducible across processes (the VM shape functions' instruction order varies), so a second
    # compile would give a different .so and manifest for reasons unrelated to the conversion.
    ref_cache, ref_out = tmp_path / "ref-cache", tmp_path / "ref-dist"
    shutil.copytree(cache / "lib", ref_cache / "lib")
    monkeypatch.setenv("MLP_CACHE_DIR", str(ref_cache))
    monkeypatch.delenv(FAIL_ENV, raising=False)
    ref = run_pipeline(str(folder), "host-cpu", "q4f16", out=str(ref_out), report=Reporter(quiet=True)).bundle

    bundle = out / ref.name
    index = json.loads((ref / "tensor-cache.json").read_text())
    assert len(index["records"]) == 3
    names = ["tensor-cache.json", "manifest.json"] + [s["dataPath"] for s in index["records"]]
    for name in names:
        assert (bundle / name).read_bytes() == (ref / name).read_bytes(), name


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    """A tiny Qwen3-MoE saved as transformers writes it (one tensor per expert and projection, as the released
    checkpoints are), defined for q4f16_0 on host-cpu: its experts are stacked [E, rows, K] parameters."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from pipeline.config import load_model, load_quant, load_target
    from pipeline.stages import define, load

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                         num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, vocab_size=96, max_position_embeddings=128, tie_word_embeddings=False)
    hf = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():   # transformers leaves the stacked experts uninitialised
        for name, p in hf.named_parameters():
            if ".experts." in name:
                p.normal_(0.0, 0.02)
    folder = tmp_path_factory.mktemp("tiny-qwen3-moe-resume")
    hf.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    loaded = load(load_model(str(folder)))
    return loaded, define(loaded, load_quant("q4f16_0"), load_target("host-cpu"))


def test_moe_resume_after_any_shard_is_byte_identical(moe_model, tmp_path):
    """Stacked expert parameters converted from per-expert tensors resume like any other: stopped after any
    finished shard, the resumed conversion skips the finished shards and ends byte-identical to a clean one."""
    loaded, defined = moe_model
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in loaded.checkpoint.names()
    assert any(n.endswith("experts.gate_up_proj.q_weight") for n, _ in defined.params)
    clean = _files(_convert(moe_model, tmp_path / "clean" / "key"))
    shards = len(json.loads(clean["tensor-cache.json"])["records"])
    assert shards >= 6
    for n in range(1, shards):
        final = tmp_path / f"stop{n}" / "key"
        with pytest.raises(Interrupted):
            _convert(moe_model, final, after_shard=_stop_at(n))
        report = Recorder()
        _convert(moe_model, final, report)
        assert any(f"skipped {n} finished shards" in line for line in report.lines), report.lines
        assert _files(final) == clean, n
