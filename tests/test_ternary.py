"""Ternary (1.58-bit) and binary (1-bit) weights end to end: packing, detection, import, PTQ, rotation,
compiled numerics, sizes.

Acceptance: a tiny Llama whose linear weights are made ternary g128 here (fp16-representable scales) is
imported losslessly into the 2-bit (t2) and base-3 (t3) packings, built for host-cpu and run; its logits
equal the unpacked ternary model's in torch within max |Δ| ≤ 2e-2 x logit scale (the q8 embedding / lm_head
of the preset are applied to the torch model too; the rest is float32 arithmetic order), and the emitted
tensor cache holds exactly 2.125 (t2) and 1.75 (t3) bits per ternary weight including scales. The same
for a tiny Llama made binary ({-s, +s} per group of 128) in the b1 packing: 1.125 bits per weight.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.errors import WeightsError
from pipeline.quant import ternary as tern
from pipeline.quant.quantize import dequantize_q8, quantize_q8
from pipeline.runtime.runner import Bundle

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ------------------------------------------------------------------------------------- packing
@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5), k=st.integers(1, 400), fmt=st.sampled_from(tern.PACKINGS),
       layout=st.sampled_from(["NK", "KN"]), seed=st.integers(0, 2**31))
def test_pack_unpack_round_trip(n, k, fmt, layout, seed):
    rng = np.random.default_rng(seed)
    trits = (rng.choice(np.array([-1, 1], np.int8), (n, k)) if fmt in tern.BINARY else
             rng.integers(-1, 2, (n, k)).astype(np.int8))
    packed = tern.pack(trits, fmt, k)
    assert packed.shape == (n, tern.packed_len(fmt, k)) and packed.dtype == np.dtype(tern.code_dtype(fmt))
    np.testing.assert_array_equal(tern.unpack(packed, fmt, k), trits)
    scale = rng.uniform(0.001, 2, (n, tern.n_groups(k))).astype(np.float16)
    w = trits * np.repeat(scale.astype(np.float32), tern.GROUP, axis=1)[:, :k]
    codes, s = tern.quantize_ternary(w, fmt, layout)
    np.testing.assert_array_equal(tern.dequantize_ternary(codes, s, fmt, k, layout), w)   # lossless


def test_formats_by_hand():
    """t2: code = trit + 1 at bits 2(k % 16) of word k // 16; t3: byte k // 5 = sum_j code_(5b+j) 3^j."""
    trits = np.zeros((1, 130), np.int8)
    trits[0, :6] = [1, -1, 0, 1, 1, -1]
    trits[0, 128:130] = [1, -1]
    t2 = tern.pack(trits, "t2", 130)
    assert t2.shape == (1, 9) and t2[0, 0] == (2 | 0 << 2 | 1 << 4 | 2 << 6 | 2 << 8 | 0 << 10
                                               | sum(1 << 2 * i for i in range(6, 16)))
    assert t2[0, 8] == (2 | 0 << 2 | sum(1 << 2 * i for i in range(2, 16)))    # padded with zero weights
    t3 = tern.pack(trits, "t3", 130)
    assert t3.shape == (1, 7) and t3.dtype == np.uint32                 # ceil(130 / 20) words
    stream = t3.view(np.uint8)[0]                                         # little-endian: byte b at bits 8b
    assert stream[0] == 2 + 0 * 3 + 1 * 9 + 2 * 27 + 2 * 81
    assert stream[1] == 0 + 1 * 3 + 1 * 9 + 1 * 27 + 1 * 81
    assert t3[0, 0] == sum(int(b) << 8 * i for i, b in enumerate(stream[:4]))
    assert stream[25] == 1 + 1 * 3 + 1 * 9 + 2 * 27 + 0 * 81               # codes 125..129
    assert stream[26] == stream[27] == 121                                # zero-weight padding to 140 codes
    assert tern.row_bytes("t2", 1024) * 8 / 1024 == 2.125 and tern.row_bytes("t3", 1280) * 8 / 1280 == 1.725
    assert tern.row_bytes("t3", 17408) * 8 / 17408 < 1.727
    # b1: bit k % 32 of word k // 32 is 1 for +s, 0 for -s; the short last word is padded with 1s
    signs = np.where(trits == 0, 1, trits).astype(np.int8)
    b1 = tern.pack(signs, "b1", 130)
    assert b1.shape == (1, 5) and b1.dtype == np.uint32
    assert b1[0, 0] == 0xFFFFFFFF & ~(1 << 1) & ~(1 << 5) and b1[0, 4] == 0xFFFFFFFF & ~(1 << 1)
    assert tern.row_bytes("b1", 5120) * 8 / 5120 == 1.125 and tern.row_bytes("b1", 17408) * 8 / 17408 == 1.125


def test_binarize_is_mse_optimal_and_exact_on_binary_groups():
    """Per group: sign(w) with s = mean |w| over the real weights (a short last group too) — for those signs
    no other scale has a smaller error, and no sign flip helps; a {-s, +s} group comes back exactly."""
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((6, 300)) * rng.uniform(0.01, 2, (6, 1))).astype(np.float32)
    signs, s = tern.binarize_exact(w)
    assert set(np.unique(signs)) <= {-1, 1}
    deq = signs[:, :300] * np.repeat(s, 128, axis=1)[:, :300]
    for row in range(6):
        for g0 in range(0, 300, 128):
            seg, got = w[row, g0:g0 + 128].astype(np.float64), deq[row, g0:g0 + 128]
            assert s[row, g0 // 128] == pytest.approx(np.abs(seg).mean(), rel=1e-12)
            err = ((got - seg) ** 2).sum()
            for scale in np.linspace(0.5, 1.5, 11) * s[row, g0 // 128]:
                assert err <= ((np.sign(seg) * scale - seg) ** 2).sum() + 1e-12
    binary = np.sign(rng.standard_normal((3, 300))).astype(np.float32) * np.float32(0.0625)
    codes, sc = tern.quantize_ternary(binary, "b1")
    np.testing.assert_array_equal(tern.dequantize_ternary(codes, sc, "b1", 300), binary)
    assert tern.binary_groups(binary, "float16").all() and tern.native_groups(binary, "b1").all()


def test_ternarize_is_mse_optimal():
    """Against brute force over every threshold: no support / mean-scale choice has a smaller error."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((20, 128)) * rng.uniform(0.01, 2, (20, 1))).astype(np.float32)
    trits, s = tern.ternarize_exact(w)
    err = ((trits * s.repeat(128, axis=1) - w) ** 2).sum(axis=1)
    for row in range(20):
        mags = np.sort(np.abs(w[row]))[::-1].astype(np.float64)
        best = min((mags ** 2).sum() - mags[:m].sum() ** 2 / m for m in range(1, 129))
        assert err[row] <= best * (1 + 1e-9) + 1e-12


# ----------------------------------------------------------------------------------- detection
def _ternary(rng, n: int, k: int, top: float = 0.2) -> np.ndarray:
    trits = rng.integers(-1, 2, (n, k)).astype(np.float32)
    scale = rng.uniform(0.01, top, (n, tern.n_groups(k))).astype(np.float16).astype(np.float32)
    return trits * np.repeat(scale, tern.GROUP, axis=1)[:, :k]


def _binary(rng, n: int, k: int, top: float = 0.2) -> np.ndarray:
    signs = rng.choice(np.array([-1, 1], np.float32), (n, k))
    scale = rng.uniform(0.01, top, (n, tern.n_groups(k))).astype(np.float16).astype(np.float32)
    return signs * np.repeat(scale, tern.GROUP, axis=1)[:, :k]


def test_detection():
    rng = np.random.default_rng(0)
    w = _ternary(rng, 8, 384)
    assert tern.ternary_groups(w).all()
    bf16 = torch.from_numpy(w * 1.37).to(torch.bfloat16).float().numpy()   # scales rounded to bfloat16
    assert tern.ternary_groups(bf16, "bfloat16").all()
    w[2, 130] = w[2, 129] * 1.5 if w[2, 129] else 0.05                  # one group with a second magnitude
    ok = tern.ternary_groups(w)
    assert not ok[2, 1] and ok.sum() == ok.size - 1
    assert not tern.ternary_groups(rng.standard_normal((4, 256)).astype(np.float32)).any()
    off_by_one_ulp = np.float32(0.1) * np.array([1, -1, 1 + 2**-20] + [0] * 125, np.float32)
    assert not tern.ternary_groups(off_by_one_ulp[None], "float32").any()
    assert tern.ternary_groups(off_by_one_ulp[None], "float16").all()   # within fp16 rounding
    assert tern.ternary_groups(np.zeros((1, 128), np.float32)).all()
    # binary: one magnitude and no zeros (a ternary group with a zero is not binary); all-zero counts
    sign = np.sign(rng.standard_normal((2, 300))).astype(np.float32) * np.float32(0.3)
    assert tern.binary_groups(sign).all() and tern.binary_groups(np.zeros((1, 128), np.float32)).all()
    sign[1, 140] = 0
    assert tern.binary_groups(sign).tolist() == [[True, True, True], [True, False, True]]
    assert not tern.native_groups(w[:1], "b1").any()                    # ternary (with zeros): not binary
    near = np.float32(0.1) * np.array([1, -1, 1 + 2**-20] * 43, np.float32)[None, :128]
    assert not tern.binary_groups(near, "float32").any() and tern.binary_groups(near, "float16").all()


def test_hadamard_is_orthogonal_and_self_inverse():
    x = np.random.default_rng(1).standard_normal((3, 320)).astype(np.float32)
    b = tern.rotation_block(320, 1024)
    assert b == 64
    y = tern.hadamard_rows(x, b)
    np.testing.assert_allclose(np.linalg.norm(y, axis=1), np.linalg.norm(x, axis=1), rtol=1e-6)
    np.testing.assert_allclose(tern.hadamard_rows(y, b), x, atol=1e-6)


# -------------------------------------------------------------------------------- tiny models
def tiny_llama(tmp_path, *, ternary: bool, binary: bool = False):
    """A random tiny Llama (hidden 640, ffn 1280: every K a multiple of 128 and of t3's 20 codes per word, as
    in qwen27b's 5120); with `ternary`, every linear weight is {-s, 0, +s} per group of 128 with
    fp16-representable s; with `binary`, {-s, +s}."""
    from test_model_numerics import tiny_hf_model

    folder, model = tiny_hf_model(tmp_path, "llama", hidden_size=640, intermediate_size=1280, num_hidden_layers=2,
                                  num_attention_heads=10, num_key_value_heads=2, head_dim=64)
    if ternary or binary:
        rng = np.random.default_rng(7)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if any(k in name for k in LINEARS):
                    p.copy_(torch.from_numpy(_binary(rng, *p.shape, top=0.2) if binary else
                                             _ternary(rng, *p.shape, top=0.3)))
        model.save_pretrained(folder, safe_serialization=True)
    return folder, model


def with_weights(model, fn):
    """A copy of the torch model whose linear weights are fn(name, float32 weight)."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.from_numpy(fn(name, p.float().numpy())))
    return ref


def q8_outside_linears(name: str, w: np.ndarray) -> np.ndarray:
    """The presets keep the embedding and lm_head in q8."""
    if any(k in name for k in LINEARS):
        return w
    return dequantize_q8(*quantize_q8(w, "NK"), "NK")


def assert_close(ours, ref, rel=2e-2):
    diff, scale = float(np.abs(ours - ref).max()), float(np.abs(ref).max())
    print(f"\nmax |Δ| {diff:.3g}, logit scale {scale:.3g}")
    assert diff <= rel * scale, f"max |Δ| {diff:.3g} > {rel} x logit scale {scale:.3g}"


@pytest.fixture(scope="module")
def ternary_model(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("ternary"), ternary=True)


@pytest.fixture(scope="module")
def binary_model(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("binary"), ternary=False, binary=True)


@pytest.fixture(scope="module")
def ordinary_model(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("ordinary"), ternary=False)


IDS = np.random.default_rng(2).integers(0, 512, 40)


def _cache_bytes(bundle) -> dict[str, int]:
    index = json.loads((bundle / "tensor-cache.json").read_text())
    return {r["name"]: r["nbytes"] for shard in index["records"] for r in shard["records"]}


@pytest.mark.parametrize("scheme,bits,source", [  # t3 / b1: their kernels also run in the PoCL / phone tests below
    ("ternary", 2.125, "ternary_model"),
    pytest.param("ternary_t3", 1.725, "ternary_model", marks=pytest.mark.slow),
    pytest.param("binary", 1.125, "binary_model", marks=pytest.mark.slow)])
def test_ternary_import_build_run(request, build_bundle, scheme, bits, source):
    folder, model = request.getfixturevalue(source)
    bundle = Bundle(build_bundle(folder, "host-cpu", scheme))
    engine = bundle.engine()
    ours = engine.prefill(list(IDS), all_logits=True)
    with torch.no_grad():
        ref = with_weights(model, q8_outside_linears)(torch.tensor([IDS.tolist()])).logits[0].numpy()
    assert_close(ours, ref)
    # greedy decode agrees with the prefill logits of the same positions (the GEMV path)
    engine2 = bundle.engine()
    engine2.prefill(list(IDS[:-1]))
    assert_close(engine2.decode(int(IDS[-1]))[None], ours[-1:])
    # sizes from the emitted tensor cache: packed codes + fp16 scales per ternary weight
    nbytes = _cache_bytes(bundle.path)
    tern_bytes = sum(b for n, b in nbytes.items() if any(r in n for r in ("qkv_proj", "o_proj", "_up_proj", "down_proj")))
    tern_params = sum(p.numel() for n, p in model.named_parameters() if any(k in n for k in LINEARS))
    measured = 8 * tern_bytes / tern_params
    print(f"\n{scheme}: {measured:.4f} bits/weight incl. scales ({tern_bytes} B for {tern_params} weights)")
    assert measured == bits
    assert measured <= {"ternary": 2.13, "ternary_t3": 1.75, "binary": 1.13}[scheme]
    coverage = json.loads((bundle.path / "reports" / "coverage.json").read_text())
    assert {"dequant-gemv-ternary", "dequant-matmul-ternary"} <= set(coverage["summary"]["op_classes"])


def test_native_import_refuses_ordinary_weights(ordinary_model, dist_dir):
    from pipeline.progress import Reporter
    from pipeline.stages import run_pipeline

    folder, _ = ordinary_model
    with pytest.raises(WeightsError) as err:
        run_pipeline(str(folder), "host-cpu", "ternary", out=str(dist_dir), report=Reporter(quiet=True))
    msg = str(err.value)
    assert "q_proj.weight" in msg and "is not ternary" in msg and "ternary_ptq" in msg and "\n" not in msg


def test_binary_import_refuses_ternary_weights(ternary_model, dist_dir):
    """A ternary checkpoint (zeros in its groups) is not binary: refused in one line, naming the tensor,
    the group and the presets that apply."""
    from pipeline.progress import Reporter
    from pipeline.stages import run_pipeline

    folder, _ = ternary_model
    before = sorted(dist_dir.iterdir()) if dist_dir.exists() else []
    with pytest.raises(WeightsError) as err:
        run_pipeline(str(folder), "host-cpu", "binary", out=str(dist_dir), report=Reporter(quiet=True))
    msg = str(err.value)
    assert "q_proj.weight" in msg and "is not binary" in msg and "zeros" in msg and "binary_ptq" in msg
    assert "\n" not in msg and sorted(dist_dir.iterdir()) == before          # nothing half-written


def _ptq(name: str, w: np.ndarray, rotation: int = 0) -> np.ndarray:
    """What ternary_ptq(_rot) stores, mapped back to the unrotated basis: (T(W H)) H."""
    if not any(k in name for k in LINEARS):
        return q8_outside_linears(name, w)
    rotate = tern.rotation_block(w.shape[1], rotation) if rotation else 1
    r = tern.hadamard_rows(w, rotate)
    t = tern.dequantize_ternary(*tern.quantize_ternary(r, "t2"), "t2", w.shape[1])
    return tern.hadamard_rows(t, rotate)


@pytest.mark.parametrize("scheme,rotation", [  # the rotation itself: test_rotation_is_exact_in_fp32
    ("ternary_ptq", 0), pytest.param("ternary_ptq_rot", 1024, marks=pytest.mark.slow)])
def test_ptq_matches_its_ternarised_reference(ordinary_model, build_bundle, scheme, rotation):
    """PTQ (and PTQ after the Hadamard rotation) compiled vs torch on the same ternarised weights."""
    folder, model = ordinary_model
    engine = Bundle(build_bundle(folder, "host-cpu", scheme)).engine()
    ours = engine.prefill(list(IDS), all_logits=True)
    with torch.no_grad():
        ref = with_weights(model, lambda n, w: _ptq(n, w, rotation))(torch.tensor([IDS.tolist()])).logits[0].numpy()
    assert_close(ours, ref)


def test_rotation_is_exact_in_fp32(ordinary_model, build_bundle, tmp_path):
    """Weights W H and inputs H x, in float32 (before any ternarisation): the logits of the unrotated float32
    model within 1e-4 x logit scale (fp32 rounding of the reordered sums)."""
    folder, model = ordinary_model
    scheme = tmp_path / "q0f32_rot.yaml"
    scheme.write_text("name: q0f32_rot\nweight_format: float\nweight_dtype: float32\nrotation: 128\n")
    bundle = Bundle(build_bundle(folder, "host-cpu", str(scheme)))
    assert "hadamard_rotate" in json.dumps(json.loads((bundle.path / "reports" / "coverage.json").read_text()))
    ours = bundle.engine().prefill(list(IDS), all_logits=True)
    with torch.no_grad():
        ref = model(torch.tensor([IDS.tolist()])).logits[0].numpy()
    assert_close(ours, ref, rel=1e-4)


# -------------------------------------------------------------------- adreno kernels on PoCL
# Llama-shaped, K = 320 (not a multiple of 128: a short last group) and 640; fp32 activations and scales
# because PoCL has no fp16. t2 with the Hadamard rotation (its kernel runs too), t3 without.
POCL_SHAPE = dict(architectures=["LlamaForCausalLM"], hidden_size=320, intermediate_size=640,
                  num_hidden_layers=1, num_attention_heads=5, num_key_value_heads=1, vocab_size=1024,
                  tie_word_embeddings=False, rms_norm_eps=1e-5)


def _adreno_fused(fmt: str, rotation: int):
    import dataclasses

    from pipeline.config import load_target
    from pipeline.models.layers import LayerFactory
    from pipeline.models.llama import DecoderConfig, DecoderLM
    from pipeline.stages import Defined, fuse

    target = dataclasses.replace(load_target("android-adreno"), compute_dtype="float32")
    target = dataclasses.replace(target, tvm_target={**target.tvm_target, "host": {"kind": "llvm"}})
    factory = LayerFactory("float32", fmt, "float32", "KN", scale_dtype="float32", rotation=rotation,
                           ternary_source="ptq")
    module = DecoderLM(DecoderConfig.from_hf(POCL_SHAPE), factory, target.tvm())
    mod, params = module.export_tvm(spec=module.export_spec())
    return fuse(Defined(module, params, mod, "KN", "float32"), target), target


def _kernel_args(func, rng, sizes: dict[str, int], fmt: str) -> list[np.ndarray]:
    from tvm import tirx

    from pipeline.verify.opencl_plan import param_spec

    args = []
    for p in func.params:
        spec = param_spec(p)
        shape = tuple(int(d) if isinstance(d, (int, tirx.IntImm)) else sizes[str(d)] for d in spec.shape)
        if spec.dtype == "uint32" and fmt == "t2":    # every 2-bit code 0..2 (3 is never written)
            codes = rng.integers(0, 3, (*shape, 16)).astype(np.uint64)
            args.append((codes << (2 * np.arange(16, dtype=np.uint64))).sum(-1).astype(np.uint32))
        elif spec.dtype == "uint32" and fmt == "b1":  # every bit pattern is 32 signs
            args.append(rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32))
        elif spec.dtype == "uint32":                   # t3: four bytes of five trits, each 0..242
            args.append(rng.integers(0, 243, (*shape, 4)).astype(np.uint8).view("<u4")[..., 0].astype(np.uint32))
        else:
            args.append(rng.standard_normal(shape).astype(spec.dtype))
    return args


@pytest.mark.parametrize("fmt,rotation", [("t2", 1024), ("t3", 0), ("b1", 0)])
def test_adreno_ternary_kernels_on_pocl(fmt, rotation):
    """Every ternary dequantize-GEMV (decode) and dequantize-matmul (prefill, seq_len 5) of the adreno build,
    and the rotation kernels, scheduled by the target's rules, run on PoCL and match LLVM within 1e-4 of
    the output scale. The decode kernels are GEMVs that read the packed codes: dlight's GEMV rule inlined
    the dequantize (no [K, N] weight is materialised) and their weight argument is the packed buffer."""
    import tvm
    from tvm import tirx

    from pipeline.compiler.schedule import schedule_module
    from pipeline.verify.opencl import find_opencl_device, run_on_llvm, run_on_pocl
    from pipeline.verify.opencl_plan import opencl_kernels, param_spec

    if find_opencl_device() is None:
        pytest.skip("no OpenCL platform (install pocl-opencl-icd)")
    mod, target = _adreno_fused(fmt, rotation)
    ran, gemv = [], []
    for gv, func in mod.functions_items():
        name = gv.name_hint
        if not isinstance(func, tirx.PrimFunc) or not (f"dequantize_{fmt}" in name or "hadamard" in name):
            continue
        func = func.with_attr("global_symbol", name)
        scheduled, records = schedule_module(tvm.IRModule({name: func}), target.tvm(), target.schedule_rules, "gpu")
        if f"dequantize_{fmt}" in name and "seq_len" not in func.script():     # decode: static shapes
            text = scheduled[name].script()
            assert records[0].rule == ("gemv" if fmt == "t3" else "dequant_gemv"), (name, records)
            assert f'sblock("dequantize_{fmt}' not in text, f"{name}: the dequantized weight is materialised"
            assert tern.code_dtype(fmt) in {str(param_spec(p).dtype) for p in func.params}
            gemv.append(name)
        args = _kernel_args(func, np.random.default_rng(0), {"seq_len": 5}, fmt)
        expected = run_on_llvm(func, [a.copy() for a in args])[-1]
        got = run_on_pocl(opencl_kernels(scheduled, target.tvm()), name, [a.copy() for a in args])[-1]
        scale = max(float(np.abs(expected).max()), 1e-30)
        assert float(np.abs(got - expected).max()) <= 1e-4 * scale, name
        ran.append(name)
    print(f"\n{fmt}: {len(ran)} kernels matched on PoCL ({len(gemv)} decode GEMVs): {', '.join(sorted(ran))}")
    assert len(gemv) >= 4 and len(ran) >= 8      # qkv, o, gate_up, down: decode + prefill
    if rotation:
        assert any("hadamard" in n for n in ran)


def test_memory_plan_ternary_bits():
    """The plan's arithmetic for qwen27b (K = 5120 / 6144 / 17408): t2 2.125, t3 1.725-1.73, b1 1.125
    bits/weight."""
    from pathlib import Path

    from pipeline.quant.memory_plan import memory_plan

    cfg = json.loads((Path(__file__).resolve().parent.parent / "configs" / "models" / "hf" /
                      "qwen3.5-27b.config.json").read_text())
    for mode, lo, hi in (("t2f16", 2.125, 2.125), ("t3f16", 1.725, 1.73), ("b1f16", 1.125, 1.125)):
        plan = memory_plan(cfg, quant=mode)
        for group in ("mlp_up", "mlp_down", "gdn_out_proj", "attn_o"):
            g = plan["weights"][group]
            assert lo <= 8 * g["bytes"] / g["params"] <= hi, (mode, group)
        assert plan["weights"]["mlp_down"]["precision"].startswith("binary" if mode == "b1f16" else "ternary")
    t3 = memory_plan(cfg, quant="t3f16")["weights_total"]["bytes"]
    print(f"\nqwen27b all-t3 weights: {t3 / 1e9:.2f} GB")
    assert t3 < 6.5e9


def _aarch64_objects(bundle) -> list[bytes]:
    import tarfile

    cfg = json.loads((bundle / "mlc-chat-config.json").read_text())
    with tarfile.open(bundle / cfg["model_lib"]) as tar:
        return [tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()]


@pytest.mark.parametrize("target,scheme", [
    pytest.param("android-cpu", "ternary_t3", marks=pytest.mark.slow),   # ~160 s on a Zen 3 VM; the t3 sdot kernel
    # itself runs under qemu in the default suite (test_arm_t3.py) and its selection in test_cpu_kernel_selection.py
    pytest.param("android-adreno", "ternary", marks=pytest.mark.slow),
    pytest.param("android-adreno", "ternary_t3", marks=pytest.mark.slow),
    pytest.param("android-adreno", "binary", marks=pytest.mark.slow),
])
def test_phone_targets_compile_ternary(request, build_bundle, target, scheme):
    """The phone libraries build with ternary weights: aarch64 objects (+ OpenCL kernels on adreno, where
    every ternary decode GEMV is scheduled by the GEMV rule), bundle with the packed tensor cache."""
    folder, _ = request.getfixturevalue("binary_model" if scheme == "binary" else "ternary_model")
    bundle = build_bundle(folder, target, scheme)
    objs = _aarch64_objects(bundle)
    assert objs and all(o[:4] == b"\x7fELF" and int.from_bytes(o[18:20], "little") == 183 for o in objs)
    kernels = json.loads((bundle / "reports" / "kernels.json").read_text())["kernels"]
    fmt = {"ternary": "t2", "ternary_t3": "t3", "binary": "b1"}[scheme]
    assert any(f"dequantize_{fmt}" in k["name"] for k in kernels)
    if target == "android-adreno":
        assert any(b"__kernel" in o for o in objs)
        rules = {k["name"]: k["rule"] for k in kernels if f"dequantize_{fmt}" in k["name"]}
        gemv_rules, matmul_rules = ("gemv", "dequant_gemv"), ("matmul", "matmul_f32")
        assert set(gemv_rules) & set(rules.values()) and all(r in gemv_rules + matmul_rules for r in rules.values()), rules


def test_scheme_options_are_checked(tmp_path):
    from pipeline.config import QuantSpec, load_quant
    from pipeline.errors import ConfigError

    path = tmp_path / "s.yaml"
    with pytest.raises(ConfigError, match="rotation makes natively ternary weights non-ternary"):
        QuantSpec(name="s", weight_format="t2", rotation=128, path=path)
    with pytest.raises(ConfigError, match="unknown ternary_source"):
        QuantSpec(name="s", weight_format="t3", ternary_source="maybe", path=path)
    with pytest.raises(ConfigError, match="not 0 or a power of two"):
        QuantSpec(name="s", weight_format="float", rotation=100, path=path)
    rot = load_quant("ternary_ptq_rot")
    assert rot.ternary and rot.rotation == 1024 and rot.ternary_source == "ptq"
    assert load_quant("ternary_t3").formats == {"embed_tokens": "q8", "lm_head": "q8"}
    assert not load_quant("q4f16").ternary
