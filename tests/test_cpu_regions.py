"""Merged CPU regions (pipeline/kernels/cpu/regions.py): a decode step's runs of kernels as one parallel launch each.

The merge only moves the kernels' own statements into one launch (serial parts on task 0, a barrier after
each part), so the reference is the same library built without it: logits bit-identical (tolerance 0),
for a q4f16 model whose GEMVs have serial prologues, parallel loops and split-K sums, at the build's
thread count and at 1 and 3 threads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tvm
from tvm.script import tirx as T

from pipeline.kernels.cpu.regions import _barriered, split_kernel
from pipeline.runtime.runner import Bundle

STEPS = 6


def tiny_qwen3(folder):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(1)
    cfg = Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=512,
                      tie_word_embeddings=False)
    Qwen3ForCausalLM(cfg).eval().save_pretrained(folder, safe_serialization=True)
    return folder


def unmerged_library(model: str, out_dir, quant: str = "q4f16") -> str:
    """The same model's host-cpu library without the merge: the stages up to compile, by hand."""
    from pipeline.compiler.compile import attach_metadata, build_library
    from pipeline.config import load_model, load_quant, load_target
    from pipeline.stages import define, fuse, load, tune

    target, quant = load_target("host-cpu"), load_quant(quant)
    loaded = load(load_model(model))
    defined = define(loaded, quant, target)
    mod, _ = tune(fuse(defined, target), target)
    meta = defined.module.metadata(quant.name, defined.params)
    meta.update(activation_dtype=defined.activation_dtype, weight_layout=defined.layout)
    return str(build_library(attach_metadata(mod, meta), target.tvm(), library="so", system_lib=False,
                             prefix="unmerged_", out_dir=out_dir))


def decode_logits(engine, prompt, steps=STEPS) -> np.ndarray:
    engine.reset()
    out = [engine.prefill(list(prompt))]
    for _ in range(steps):
        out.append(engine.decode(int(np.argmax(out[-1]))))
    return np.stack(out)


def merged_library_bytes(bundle) -> bytes:
    config = json.loads((bundle / "mlc-chat-config.json").read_text())
    return (bundle / config["model_lib"]).read_bytes()


@pytest.fixture(scope="module")
def merged_bundle(tmp_path_factory, build_bundle):
    folder = tiny_qwen3(tmp_path_factory.mktemp("regions") / "qwen3-regions")
    return folder, build_bundle(folder, "host-cpu", "q4f16")


def test_merged_decode_is_bit_identical(merged_bundle, tmp_path):
    from pipeline.artifacts.tensor_cache import iter_tensor_cache
    from pipeline.runtime.engine import Engine

    folder, bundle = merged_bundle
    coverage = json.loads((bundle / "reports" / "coverage.json").read_text())
    regions = coverage["cpu_regions"]
    # 2 layers: norm + QKV, the 11 kernels between the two attentions, the last layer's to the lm_head
    for fn in ("decode", "decode_greedy"):
        calls = regions["calls_per_step"][fn]
        assert calls["kernels"] >= 20 and calls["calls"] * 3 <= calls["kernels"]
    assert any("dequant" in k and "matmul" in k for r in regions["regions"].values() for k in r["kernels"])
    for fn in ("decode", "decode_greedy"):       # the region calls and the kernels left make up the step
        made = sum(r["calls"].get(fn, 0) for r in regions["regions"].values())
        assert 0 < made <= regions["calls_per_step"][fn]["calls"]

    merged = Bundle(bundle).engine()
    plain = Engine(unmerged_library(str(folder), tmp_path), iter_tensor_cache(bundle))
    assert b"cpu_region1" in merged_library_bytes(bundle)     # the regions are what the library runs
    assert "Kernel calls per step: decode" in (bundle / "reports" / "coverage.md").read_text()
    prompt = np.random.default_rng(0).integers(0, 512, 24)
    ours, reference = decode_logits(merged, prompt), decode_logits(plain, prompt)
    assert np.abs(reference).max() > 0
    np.testing.assert_array_equal(ours, reference)

    ids = [int(np.argmax(reference[0]))]
    merged.reset()
    merged.prefill(list(prompt))
    while len(ids) <= STEPS:
        ids.append(merged.decode_greedy(ids[-1]))
    assert ids == [int(np.argmax(r)) for r in reference]


@pytest.mark.parametrize("threads", [1, 3])
def test_merged_decode_at_other_thread_counts(merged_bundle, threads):
    """Serial parts run on the first task of any pool; GEMVs split for the build's 2 threads still cover
    every column with 1 or 3."""
    _, bundle = merged_bundle
    prompt = np.random.default_rng(0).integers(0, 512, 24)
    expected = decode_logits(Bundle(bundle).engine(), prompt)
    script = ("import sys, numpy as np; sys.path.insert(0, sys.argv[2]);"
              "from test_cpu_regions import decode_logits; from pipeline.runtime.runner import Bundle;"
              "prompt = np.random.default_rng(0).integers(0, 512, 24);"
              "np.save(sys.argv[3], decode_logits(Bundle(sys.argv[1]).engine(), prompt))")
    out = bundle.parent / f"logits-{threads}.npy"
    env = dict(os.environ, TVM_NUM_THREADS=str(threads))
    subprocess.run([sys.executable, "-c", script, str(bundle), os.path.dirname(__file__), str(out)],
                   check=True, env=env, cwd=os.path.dirname(os.path.dirname(__file__)))
    np.testing.assert_array_equal(np.load(out), expected)


# ------------------------------------------------------------------------------------- TIR structure
@T.prim_func(private=True)
def _serial_then_parallel(a: T.Buffer((64,), "float32"), b: T.Buffer((64,), "float32")):
    tmp = T.alloc_buffer((64,), "float32")
    for i in range(64):
        tmp[i] = a[i] * T.float32(2)
    for t in T.parallel(2):
        for i in range(32):
            b[t * 32 + i] = tmp[t * 32 + i] + T.float32(1)


@T.prim_func(private=True)
def _nested_parallel(a: T.Buffer((64,), "float32"), b: T.Buffer((64,), "float32")):
    for o in range(2):
        for t in T.parallel(32):
            b[o * 32 + t] = a[o * 32 + t]


def test_split_kernel_takes_top_level_parts_only():
    allocs, stmts = split_kernel(_serial_then_parallel)
    assert [b.name for b in allocs] == ["tmp"]
    assert [type(s).__name__ for s in stmts] == ["For", "For"]
    assert split_kernel(_nested_parallel) is None     # a parallel loop inside a serial one cannot join


def test_barriered_puts_serial_work_on_task_zero():
    _, stmts = split_kernel(_serial_then_parallel)
    parts = _barriered(stmts)
    assert len(parts) == 2 and all(p.attr_key == "pragma_parallel_barrier_when_finish" for p in parts)
    serial = parts[0].body
    assert serial.kind == tvm.tirx.ForKind.PARALLEL and "serial_task == 0" in serial.script()
    assert parts[1].body.same_as(stmts[1])
