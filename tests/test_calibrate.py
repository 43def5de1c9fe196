"""Calibrated quantization: layer-input statistics (calibrate.py) and error feedback (gptq.py).

References: transformers' own forward pass (hooks on every nn.Linear of the whole model) for the streamed
statistics; a direct, slow implementation of the error-feedback definition (re-inverting the remaining
block of H after every column) for the fast blocked one; round-to-nearest for the output error.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.frontend.checkpoint import open_checkpoint
from pipeline.quant import gptq
from pipeline.quant.calibrate import Calibration, CalibrationSpec, module_for_param, token_windows
from pipeline.quant.quantize import dequantize_q4, quantize_q4


def correlated_inputs(k: int, n: int = 4096, seed: int = 0) -> np.ndarray:
    """Inputs with uneven channel scales and correlations, like a transformer's hidden states."""
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((k, k)).astype(np.float32) / np.sqrt(k)
    return (rng.standard_normal((n, k)).astype(np.float32) @ (np.eye(k, dtype=np.float32) + mix)) \
        * rng.gamma(1.0, 1.0, k).astype(np.float32)


def reference_error_feedback(w: np.ndarray, h: np.ndarray, fmt: str) -> np.ndarray:
    """The definition, unblocked: quantize the columns in order of decreasing H diagonal with the static group
    scales; after each, move the remaining columns by the least-squares correction -e * H_rr^-1 H_rc (the
    remaining block re-inverted every step)."""
    k = w.shape[1]
    damp = gptq.DAMP * float(np.diag(h).mean())
    hd = np.asarray(h, np.float64) + np.eye(k) * damp
    order = list(np.argsort(-np.diag(h), kind="stable"))
    scale = np.repeat(gptq.group_scales(w.astype(np.float32), fmt, np.diag(hd).astype(np.float32)), 32, axis=1)
    lo, hi = gptq.LEVELS[fmt]
    work = w.astype(np.float64).copy()
    levels = np.zeros_like(work)
    for step, c in enumerate(order):
        q = np.clip(np.rint(work[:, c] / np.where(scale[:, c] == 0, 1, scale[:, c])), lo, hi)
        levels[:, c] = q
        rest = order[step + 1:]
        if rest:
            e = work[:, c] - q * scale[:, c]
            # minimise (d)^T H (d) over the remaining columns given column c's error e: d_rest = -e H_rr^-1 H_rc
            corr = np.linalg.solve(hd[np.ix_(rest, rest)], hd[rest, c])
            work[:, rest] += e[:, None] * corr[None, :]
    return levels


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_error_feedback_matches_its_definition(fmt):
    x = correlated_inputs(64, 512)
    h = x.T.astype(np.float64) @ x / len(x)
    w = np.random.default_rng(1).standard_normal((6, 64)).astype(np.float32)
    levels, scale = gptq.quantize_rows(w, gptq.prepare(h), fmt)
    ref = reference_error_feedback(w, h, fmt)
    # float32 (fast) vs float64 (reference) arithmetic may flip a rounding tie now and then
    assert np.mean(levels == ref) >= 0.98, f"{np.mean(levels == ref):.3f} of the levels agree"
    lo, hi = gptq.LEVELS[fmt]
    assert levels.min() >= lo and levels.max() <= hi and np.all(levels == np.rint(levels))
    assert scale.dtype == np.float16 and scale.shape == (6, 2)


def test_error_feedback_halves_the_output_error_of_rounding():
    """On correlated inputs the layer's output error tr(D H D^T) is well below round-to-nearest's (which is
    the smallest error per weight): the error is moved into directions the inputs do not excite."""
    k = 256
    x = correlated_inputs(k)
    h = x.T.astype(np.float64) @ x / len(x)
    w = np.random.default_rng(2).standard_normal((128, k)).astype(np.float32) * 0.05
    levels, scale = gptq.quantize_rows(w, gptq.prepare(h), "q4")
    deq = levels * np.repeat(scale.astype(np.float32), 32, axis=1)
    ours = gptq.output_error(w, deq, h)
    rtn = gptq.output_error(w, dequantize_q4(*quantize_q4(w)), h)
    direct = float((((w - deq) @ x.T) ** 2).sum()) / len(x)     # the same error, from the inputs themselves
    assert abs(ours - direct) <= 1e-3 * direct
    print(f"output error: error feedback {ours:.4g} vs round-to-nearest {rtn:.4g} ({ours / rtn:.2f}x)")
    assert ours <= 0.6 * rtn


def test_row_blocks_do_not_change_the_result():
    x = correlated_inputs(96, 1024)
    prep = gptq.prepare(x.T.astype(np.float64) @ x / len(x))
    w = np.random.default_rng(3).standard_normal((40, 96)).astype(np.float32)
    whole = gptq.quantize_rows(w, prep, "q4")
    parts = [gptq.quantize_rows(w[a:b], prep, "q4") for a, b in ((0, 1), (1, 9), (9, 40))]
    assert np.array_equal(whole[0], np.concatenate([p[0] for p in parts]))
    assert np.array_equal(whole[1], np.concatenate([p[1] for p in parts]))


def test_calibration_spec_errors(tmp_path):
    assert CalibrationSpec.parse(None) is None and CalibrationSpec.parse("none") is None
    assert CalibrationSpec.parse({"tokens": 1024}).tokens == 1024
    with pytest.raises(ConfigError, match="bad calibration entry"):
        CalibrationSpec.parse({"tokenz": 5}, tmp_path / "s.yaml")
    with pytest.raises(ConfigError, match="is not a file"):
        CalibrationSpec.parse({"text": str(tmp_path / "missing.txt")})
    from pipeline.config import QuantSpec

    with pytest.raises(ConfigError, match="calibration"):
        QuantSpec(name="x", weight_format="q4", calibration={"window": 1}, path=tmp_path / "x.yaml")
    assert QuantSpec(name="f", weight_format="float", calibration={"tokens": 8}).calibration_spec is None


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from test_model_numerics import tiny_hf_model

    return tiny_hf_model(tmp_path_factory.mktemp("calib"), "llama", num_hidden_layers=2)


def _reference_moments(model, ids: np.ndarray) -> dict[str, np.ndarray]:
    """H of every nn.Linear input from hooks on transformers' whole model (float64)."""
    moments = {}

    def hook(name):
        def f(mod, inp, out):
            x = inp[0].reshape(-1, inp[0].shape[-1]).double()
            moments[name] = (x.T @ x / x.shape[0]).numpy()
        return f

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        model(torch.from_numpy(ids))
    for h in handles:
        h.remove()
    return moments


@pytest.mark.parametrize("keep_all", [True, False])
def test_streamed_statistics_match_transformers(tiny_llama, keep_all, monkeypatch):
    """Pass 1 alone (small models) and pass 1 + per-layer reruns (big ones) give transformers' numbers."""
    import pipeline.quant.calibrate as calibrate

    folder, model = tiny_llama
    if not keep_all:
        monkeypatch.setattr(calibrate, "KEEP_ALL_BYTES", 0)
    ckpt = open_checkpoint(folder)
    spec = CalibrationSpec(tokens=256, window=64)
    ids, how = token_windows(ckpt, spec, 512)
    assert ids.shape == (4, 64) and "random" in how            # a test model has no tokenizer
    ref = _reference_moments(model, ids)
    with Calibration(ckpt, json.loads((folder / "config.json").read_text()), spec) as cal:
        for name, h in ref.items():
            ours = cal.hessian(name)
            assert ours is not None, name
            assert np.abs(ours - h).max() <= 1e-5 * np.abs(h).max(), name
        assert cal._all is not None if keep_all else cal._all is None


def test_hybrid_statistics_match_transformers(tmp_path):
    """Qwen3.5 (Gated-DeltaNet + gated attention layers): the streamed pass runs transformers' own layers."""
    from test_qwen3_5 import tiny_qwen35

    model = tiny_qwen35(tmp_path)
    model.save_pretrained(tmp_path, safe_serialization=True)
    ckpt = open_checkpoint(tmp_path)
    spec = CalibrationSpec(tokens=96, window=48)
    ids, _ = token_windows(ckpt, spec, model.config.vocab_size)
    ref = _reference_moments(model, ids)
    assert any("linear_attn.in_proj_qkv" in n for n in ref) and any("self_attn.q_proj" in n for n in ref)
    with Calibration(ckpt, json.loads((tmp_path / "config.json").read_text()), spec) as cal:
        for name, h in ref.items():
            assert np.abs(cal.hessian(name) - h).max() <= 1e-5 * np.abs(h).max(), name


def test_parameters_map_to_their_input_module():
    assert module_for_param("model.layers.2.self_attn.qkv_proj", False) == "model.layers.2.self_attn.q_proj"
    assert module_for_param("model.layers.2.mlp.gate_up_proj", False) == "model.layers.2.mlp.gate_proj"
    assert module_for_param("model.layers.0.linear_attn.in_proj", False) == "model.layers.0.linear_attn.in_proj_qkv"
    assert module_for_param("model.layers.2.mlp.down_proj", False) == "model.layers.2.mlp.down_proj"
    assert module_for_param("model.embed_tokens", True) == "lm_head"      # a tied table is also the lm_head
    assert module_for_param("model.embed_tokens", False) is None           # a gather: nothing to weight by
    assert module_for_param("lm_head", False) == "lm_head"


def test_calibrated_conversion_is_block_size_independent(tiny_llama):
    """Calibrated conversion streams like round-to-nearest: a few rows at a time give the same bytes."""
    from pipeline.config import load_model, load_quant, load_target
    from pipeline.quant.convert import iter_converted
    from pipeline.stages import define, load

    folder, _ = tiny_llama
    loaded = load(load_model(str(folder)))
    defined = define(loaded, load_quant("q4f16_1"), load_target("host-cpu"))
    spec = CalibrationSpec(tokens=128, window=64)
    with Calibration(loaded.checkpoint, loaded.hf_config, spec) as cal:
        runs = [dict(iter_converted(loaded.checkpoint, defined.params, "NK", calibration=cal, block_bytes=b))
                for b in (None, 4096)]
        plain = dict(iter_converted(loaded.checkpoint, defined.params, "NK"))
    assert runs[0].keys() == runs[1].keys() == plain.keys()
    for name in runs[0]:
        assert np.array_equal(runs[0][name], runs[1][name]), name
    quantized = {n for n in plain if n.endswith(".q_weight")}
    changed = {n for n in quantized if not np.array_equal(plain[n], runs[0][n])}
    # every q4 matrix but the (untied) embedding, a gather with no input to weight by, is calibrated
    assert changed == quantized - {"model.embed_tokens.q_weight"}


def test_large_inputs_factorise_in_float32(monkeypatch):
    """Above BIG_K (a 27B's 17408-wide down_proj input) H is factorised in float32 to halve the memory:
    U^T U still inverts the damped, reordered H, and the rounding matches the float64 path."""
    x = correlated_inputs(128, 2048)
    h = x.T.astype(np.float64) @ x / len(x)
    w = np.random.default_rng(4).standard_normal((16, 128)).astype(np.float32)
    exact = gptq.prepare(h)
    monkeypatch.setattr(gptq, "BIG_K", 64)
    small = gptq.prepare(h)
    hp = h[np.ix_(small.order, small.order)] + np.eye(128) * gptq.DAMP * np.diag(h).mean()
    u = small.inv_chol.astype(np.float64)
    inv = np.linalg.inv(hp)
    assert np.abs(u.T @ u - inv).max() <= 1e-4 * np.abs(inv).max()
    a, _ = gptq.quantize_rows(w, exact, "q4")
    b, _ = gptq.quantize_rows(w, small, "q4")
    assert np.mean(a == b) >= 0.99


def _rounded_copy(model, suffixes: tuple[str, ...]):
    """A deep copy of the HF model with the matrices named by `suffixes` rounded to q4 (round to nearest)."""
    import copy

    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in out.named_parameters():
            if name.endswith(suffixes):
                p.copy_(torch.from_numpy(dequantize_q4(*quantize_q4(p.detach().numpy()))))
    return out


def _kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    ref = torch.log_softmax(ref_logits.double(), -1)
    return float((ref.exp() * (ref - torch.log_softmax(logits.double(), -1))).sum(-1).mean())


@pytest.mark.parametrize("tied", [False, True])
def test_role_sensitivity_matches_transformers(tmp_path, tied):
    """KL of 'only this role rounded to q4' from the streamed pass equals the KL of transformers' whole model
    with those matrices rounded (float64 KL of float32 logits; tolerance 1e-3 relative + 1e-7)."""
    from test_model_numerics import tiny_hf_model

    folder, model = tiny_hf_model(tmp_path, "llama", num_hidden_layers=2, tie_word_embeddings=tied)
    ckpt = open_checkpoint(folder)
    spec = CalibrationSpec(tokens=192, window=64)
    ids, _ = token_windows(ckpt, spec, model.config.vocab_size)
    roles = {"qkv_proj": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
             "down_proj": ("mlp.down_proj.weight",), "embed_tokens": ("embed_tokens.weight",)}
    if not tied:
        roles["lm_head"] = ("lm_head.weight",)
    with Calibration(ckpt, json.loads((folder / "config.json").read_text()), spec) as cal:
        ours = cal.role_sensitivity(roles, tied=tied)
    with torch.no_grad():
        base = model(torch.from_numpy(ids)).logits
        for role, suffixes in roles.items():
            if role == "embed_tokens" and tied:
                suffixes = ("embed_tokens.weight", "lm_head.weight")   # one shared table
            want = _kl(base, _rounded_copy(model, suffixes)(torch.from_numpy(ids)).logits)
            assert want > 0, role
            assert abs(ours[role] - want) <= 1e-3 * want + 1e-7, (role, ours[role], want)
