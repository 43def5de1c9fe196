"""Ternary (1.58-bit) weights end to end: packing, detection, import, PTQ, rotation, compiled numerics, sizes.

Acceptance: a tiny Llama whose linear weights are made ternary g128 here (fp16-representable scales) is
imported losslessly into the 2-bit (t2) and base-3 (t3) packings, built for host-cpu and run; its logits
equal the unpacked ternary model's in torch within max |Δ| ≤ 2e-2 x logit scale (the q8 embedding / lm_head
of the preset are applied to the torch model too; the rest is float32 arithmetic order), and the emitted
tensor cache holds exactly 2.125 (t2) and 1.75 (t3) bits per ternary weight including scales.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import ternary as tern
from pipeline.errors import WeightsError
from pipeline.quantize import dequantize_q8, quantize_q8
from pipeline.runner import Bundle

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ------------------------------------------------------------------------------------- packing
@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5), k=st.integers(1, 400), fmt=st.sampled_from(tern.PACKINGS),
       layout=st.sampled_from(["NK", "KN"]), seed=st.integers(0, 2**31))
def test_pack_unpack_round_trip(n, k, fmt, layout, seed):
    rng = np.random.default_rng(seed)
    trits = rng.integers(-1, 2, (n, k)).astype(np.int8)
    packed = tern.pack(trits, fmt, k)
    assert packed.shape == (n, tern.packed_len(fmt, k)) and packed.dtype == np.dtype(tern.code_dtype(fmt))
    np.testing.assert_array_equal(tern.unpack(packed, fmt, k), trits)
    scale = rng.uniform(0.001, 2, (n, tern.n_groups(k))).astype(np.float16)
    w = trits * np.repeat(scale.astype(np.float32), tern.GROUP, axis=1)[:, :k]
    codes, s = tern.quantize_ternary(w, fmt, layout)
    np.testing.assert_array_equal(tern.dequantize_ternary(codes, s, fmt, k, layout), w)   # lossless


def test_formats_by_hand():
    """t2: code = trit + 1 at bits 2(k % 16) of word k // 16; t3: byte = sum code_j 3^j, 26 bytes per group."""
    trits = np.zeros((1, 130), np.int8)
    trits[0, :6] = [1, -1, 0, 1, 1, -1]
    trits[0, 128:130] = [1, -1]
    t2 = tern.pack(trits, "t2", 130)
    assert t2.shape == (1, 9) and t2[0, 0] == (2 | 0 << 2 | 1 << 4 | 2 << 6 | 2 << 8 | 0 << 10
                                               | sum(1 << 2 * i for i in range(6, 16)))
    t3 = tern.pack(trits, "t3", 130)
    assert t3.shape == (1, 27)                       # 26 for the whole group + ceil(2 / 5) for the last
    assert t3[0, 0] == 2 + 0 * 3 + 1 * 9 + 2 * 27 + 2 * 81
    assert t3[0, 1] == 0 + 1 * 3 + 1 * 9 + 1 * 27 + 1 * 81
    assert t3[0, 25] == 1 + 1 * 3 + 1 * 9 + 1 * 27 + 1 * 81        # codes 125..127 + 2 zero-weight pads
    assert t3[0, 26] == 2 + 0 * 3 + 1 * 9 + 1 * 27 + 1 * 81
    assert tern.row_bytes("t2", 1024) * 8 / 1024 == 2.125 and tern.row_bytes("t3", 1024) * 8 / 1024 == 1.75


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
def _ternary(rng, n: int, k: int) -> np.ndarray:
    trits = rng.integers(-1, 2, (n, k)).astype(np.float32)
    scale = rng.uniform(0.01, 0.2, (n, tern.n_groups(k))).astype(np.float16).astype(np.float32)
    return trits * np.repeat(scale, tern.GROUP, axis=1)[:, :k]


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


def test_hadamard_is_orthogonal_and_self_inverse():
    x = np.random.default_rng(1).standard_normal((3, 320)).astype(np.float32)
    b = tern.rotation_block(320, 1024)
    assert b == 64
    y = tern.hadamard_rows(x, b)
    np.testing.assert_allclose(np.linalg.norm(y, axis=1), np.linalg.norm(x, axis=1), rtol=1e-6)
    np.testing.assert_allclose(tern.hadamard_rows(y, b), x, atol=1e-6)


# -------------------------------------------------------------------------------- tiny models
def tiny_llama(tmp_path, *, ternary: bool):
    """A random tiny Llama (hidden 128, so every K is a multiple of 128); with `ternary`, every linear weight
    is {-s, 0, +s} per group of 128 with fp16-representable s."""
    from test_model_numerics import tiny_hf_model

    folder, model = tiny_hf_model(tmp_path, "llama")
    if ternary:
        rng = np.random.default_rng(7)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if any(k in name for k in LINEARS):
                    p.copy_(torch.from_numpy(_ternary(rng, *p.shape) * 1.5))
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
def ordinary_model(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("ordinary"), ternary=False)


IDS = np.random.default_rng(2).integers(0, 512, 40)


def _cache_bytes(bundle) -> dict[str, int]:
    index = json.loads((bundle / "tensor-cache.json").read_text())
    return {r["name"]: r["nbytes"] for shard in index["records"] for r in shard["records"]}


@pytest.mark.parametrize("scheme,bits", [("ternary", 2.125), ("ternary_t3", 1.75)])
def test_ternary_import_build_run(ternary_model, build_bundle, scheme, bits):
    folder, model = ternary_model
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
    assert measured <= {"ternary": 2.13, "ternary_t3": 1.75}[scheme]
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


def _ptq(name: str, w: np.ndarray, rotation: int = 0) -> np.ndarray:
    """What ternary_ptq(_rot) stores, mapped back to the unrotated basis: (T(W H)) H."""
    if not any(k in name for k in LINEARS):
        return q8_outside_linears(name, w)
    rotate = tern.rotation_block(w.shape[1], rotation) if rotation else 1
    r = tern.hadamard_rows(w, rotate)
    t = tern.dequantize_ternary(*tern.quantize_ternary(r, "t2"), "t2", w.shape[1])
    return tern.hadamard_rows(t, rotate)


@pytest.mark.parametrize("scheme,rotation", [("ternary_ptq", 0), ("ternary_ptq_rot", 1024)])
def test_ptq_matches_its_ternarised_reference(ordinary_model, build_bundle, scheme, rotation):
    """PTQ (and PTQ after the Hadamard rotation) compiled vs torch on the same ternarised weights."""
    folder, model = ordinary_model
    engine = Bundle(build_bundle(folder, "host-cpu", scheme)).engine()
    ours = engine.prefill(list(IDS), all_logits=True)
    with torch.no_grad():
        ref = with_weights(model, lambda n, w: _ptq(n, w, rotation))(torch.tensor([IDS.tolist()])).logits[0].numpy()
        full = model(torch.tensor([IDS.tolist()])).logits[0].numpy()
    assert_close(ours, ref)
    agree = float(np.mean(ours.argmax(-1) == full.argmax(-1)))
    print(f"\n{scheme}: top-1 agreement with the float model {agree:.0%} (random weights: a lower bound)")


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
