"""The quality benchmark's pure parts (benchmarks/quality.py): perplexity / KL / top-1 against torch on
made-up logits, llama-perplexity's window scoring, the bits-per-weight formula on a real (tiny) tensor
cache, the scheme list, and reading llama.cpp's outputs. The llama.cpp build itself is not run here.

Tolerances: the float64 numpy math vs torch float64 to 1e-9 relative.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from benchmarks import quality as q

V = 97


def _logits(rng, n, scale=3.0):
    return (rng.standard_normal((n, V)) * scale).astype(np.float32)


def test_score_window_matches_torch_reference():
    rng = np.random.default_rng(0)
    ctx = 16
    window = rng.integers(0, V, ctx).tolist()
    base, other = _logits(rng, ctx), _logits(rng, ctx)
    other[10] = base[10] + 0.01        # one position whose top-1 surely agrees
    s = q.score_window(other, q.base_logprobs(base, ctx), window)

    lo, hi = ctx // 2, ctx - 1          # positions 8..14 predict tokens 9..15
    lp = torch.log_softmax(torch.tensor(other[lo:hi], dtype=torch.float64), -1)
    lb = torch.log_softmax(torch.tensor(base[lo:hi], dtype=torch.float64), -1)
    targets = torch.tensor(window[lo + 1:hi + 1])
    nll = torch.nn.functional.nll_loss(lp, targets, reduction="sum").item()
    kl = torch.nn.functional.kl_div(lp, lb, log_target=True, reduction="sum").item()   # KL(base || other)
    same = int((lp.argmax(-1) == lb.argmax(-1)).sum())

    assert s.count == hi - lo == 7
    assert s.nll == pytest.approx(nll, rel=1e-9)
    assert s.kl == pytest.approx(kl, rel=1e-9)
    assert s.same_top == same and 1 <= same < 7
    assert s.ppl == pytest.approx(float(np.exp(nll / 7)), rel=1e-9)


def test_base_against_itself_is_kl_zero_top1_full():
    rng = np.random.default_rng(1)
    ctx = 12
    base = _logits(rng, ctx)
    window = rng.integers(0, V, ctx).tolist()
    s = q.score_window(base, q.base_logprobs(base, ctx), window)
    assert abs(s.kl) < 1e-12 and s.top1 == 1.0


def test_scores_merge_over_windows_like_one_long_sum():
    rng = np.random.default_rng(2)
    ctx = 8
    tokens = rng.integers(0, V, 3 * ctx + 5).tolist()
    wins = q.windows(tokens, ctx, 3)
    assert [w for w in wins] == [tokens[0:8], tokens[8:16], tokens[16:24]]
    total, nlls = q.Score(), []
    for w in wins:
        base, other = _logits(rng, ctx), _logits(rng, ctx)
        s = q.score_window(other, q.base_logprobs(base, ctx), w)
        lp = torch.log_softmax(torch.tensor(other[4:7], dtype=torch.float64), -1)
        nlls += (-lp[torch.arange(3), torch.tensor(w[5:8])]).tolist()
        total = total + s
    assert total.count == 9
    assert total.ppl == pytest.approx(float(np.exp(np.mean(nlls))), rel=1e-9)


def test_windows_bos_and_short_input():
    assert q.windows(list(range(10)), 4, 2, bos=99) == [[99, 1, 2, 3], [99, 5, 6, 7]]
    with pytest.raises(ValueError, match="fewer than 3 windows"):
        q.windows(list(range(10)), 4, 3)
    assert q.scored_span(512) == (256, 511)       # 255 scored tokens, as llama-perplexity


def test_delta_and_bpw_formula():
    assert q.delta_pct(11.0, 10.0) == pytest.approx(10.0)
    assert q.bits_per_weight(9 * 4, 64) == 4.5


def test_bpw_of_a_tiny_tensor_cache(tmp_path_factory):
    """The quantize stage's real tensor cache for q4f16_1 / q8f16 / q0f32: bpw from its records equals the
    arithmetic (group 32 with fp16 scales: 4.5 / 8.5 bits; K not a multiple of 32 stays fp16)."""
    from test_model_numerics import tiny_hf_model

    from pipeline.config import load_model, load_quant, load_target
    from pipeline.progress import Reporter
    from pipeline.stages import define, load, quantize

    folder, model = tiny_hf_model(tmp_path_factory.mktemp("bpw"), "llama", intermediate_size=200,
                                  num_hidden_layers=1)
    mats = [p.shape for p in model.state_dict().values() if p.dim() == 2]
    params = sum(n * k for n, k in mats)
    target = load_target("host-cpu")
    loaded = load(load_model(str(folder)))
    caches = {}
    for scheme, bits in (("q0f32", 32), ("q4f16_1", 4)):
        quant = load_quant(scheme)
        caches[scheme] = quantize(loaded, define(loaded, quant, target), quant, Reporter(quiet=True))
        if scheme == "q0f32":
            want = 4 * params
        else:   # down_proj has K = 200: not a multiple of 32, stored as fp16
            want = sum(n * k * bits // 8 + n * k // 32 * 2 if k % 32 == 0 else 2 * n * k for n, k in mats)
        got = q.bundle_matrix_bytes(caches[scheme])
        assert got == want, scheme
    assert q.bundle_matrix_params(caches["q0f32"]) == params
    bpw = q.bits_per_weight(q.bundle_matrix_bytes(caches["q4f16_1"]), params)
    assert 4.5 < bpw < 16      # the fp16 down_proj pulls it above 4.5


def test_scheme_list_is_data_driven(tmp_path):
    for name in ("q8f16", "mixed", "ternary_a", "ternary_b"):
        (tmp_path / f"{name}.yaml").write_text("name: x\n")
    entries = [{"name": "q8f16"}, {"name": "q4f16", "quant": "q4f16_1"}, {"glob": "ternary*"},
               {"glob": "int2*"}]
    rows = q.expand_ours(entries, tmp_path)
    assert [(r["name"], bool(r.get("missing"))) for r in rows] == [
        ("q8f16", False), ("q4f16", True), ("ternary_a", False), ("ternary_b", False), ("int2*", True)]


def test_shipped_config_names_existing_presets_and_goals():
    import yaml

    cfg = yaml.safe_load(q.CONFIG.read_text())
    rows = q.expand_ours(cfg["ours"], q.ROOT / "configs" / "quant")
    for r in rows:
        if not r["name"].startswith("ternary"):
            assert not r.get("missing"), r
    names = {r["name"] for r in rows}
    for g in cfg["goals"]:
        assert g["ours"] in names and g["theirs"] in cfg["llamacpp"]
    budgets = [r["phone"]["app_budget_gb"] for r in rows if r["quant"] == "auto"]
    assert len(budgets) >= 2 and len(set(budgets)) == len(budgets)   # issue #4: auto at two budgets at least


@pytest.mark.slow     # calibration + sensitivity pass on the real model (~2.5 min): `make test-slow`
def test_auto_budgets_give_different_plans():
    """The auto rows must fit and give different plans on the default model, as the build plans them
    (host-cpu compute dtype, the model's prefill chunk, cost = predicted KL from the calibration)."""
    import yaml

    from pipeline.config import load_model, load_quant, load_target
    from pipeline.quant.auto_plan import plan_auto
    from pipeline.quant.calibrate import Calibration
    from pipeline.stages import load

    cfg = yaml.safe_load(q.CONFIG.read_text())
    loaded = load(load_model(cfg["model"]))
    auto = load_quant("auto")
    with Calibration(loaded.checkpoint, loaded.hf_config, auto.calibration_spec) as calibration:
        kw = dict(context=int(auto.auto_context), compute_dtype=auto.activation_dtype(load_target("host-cpu")),
                  prefill_chunk=loaded.decoder.prefill_chunk_size, ckpt=loaded.checkpoint, calibration=calibration)
        plans = [plan_auto(loaded.hf_config, phone=r["phone"], **kw)
                 for r in cfg["ours"] if r.get("quant") == "auto"]
    assert len({json.dumps(p["formats"], sort_keys=True) for p in plans}) == len(plans)
    assert all(p["error_model"] == "predicted-kl" for p in plans)
    assert plans[0]["eps_measured_as"]["qkv_proj"] == "output"


def test_parse_llamacpp_outputs(tmp_path):
    log = ("perplexity: calculating perplexity over 4 chunks, n_ctx=512\n[1]9.1,[2]9.3,\n"
           "Final estimate: PPL = 9.5213 +/- 0.31210\n")
    assert q.parse_final_ppl(log) == pytest.approx(9.5213)
    kld = ("Mean PPL(Q)                   :  11.130000 ±   0.400000\n"
           "Mean PPL(base)                :   9.521300 ±   0.300000\n"
           "Mean    KLD:   0.214000 ±   0.003000\n"
           "Same top p: 78.125 ±  0.500 %\n")
    assert q.parse_kld(kld) == {"ppl": 11.13, "ppl_base": 9.5213, "kl": 0.214, "top1_pct": 78.125}
    with pytest.raises(ValueError, match="Final estimate"):
        q.parse_final_ppl("nothing")
    path = tmp_path / "base.kld"
    toks = np.arange(2 * 8, dtype="<i4")
    path.write_bytes(b"_logits_" + np.array([8, 97, 2], dtype="<i4").tobytes() + toks.tobytes() + b"\0" * 64)
    assert q.read_kld_tokens(path) == (8, 97, toks.tolist())
