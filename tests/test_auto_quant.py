"""QUANT=auto: per-role formats chosen to fit a phone's budget (pipeline/quant/auto_plan.py).

qwen27b (real config) at 8K context: fits a 24 GB Android phone with some roles upgraded to q8; fits a 16 GB
Android phone only with a role ternarised (q4 everywhere is 15.9 GB), with a warning; fits a 12 GB iPhone
only with a role binarised (even ternary everywhere is 6.55 GB > 6), with a warning, and is refused in one
line on an 8 GB one (binary everywhere 4.53 GB > 4). The plan's accounting is checked against the sizes of
the tensors a real build emits.
"""

from __future__ import annotations

import json

import pytest

from pipeline.config import load_model, load_phone
from pipeline.errors import ConfigError
from pipeline.quant.auto_plan import auto_markdown, plan_auto


@pytest.fixture(scope="module")
def qwen27b():
    return load_model("qwen27b").hf_config


def test_qwen27b_fits_a_24gb_phone_with_upgrades(qwen27b):
    phone = load_phone("android-24gb")
    result = plan_auto(qwen27b, phone=phone, context=8192, model_name="qwen27b")
    assert result["total_bytes"] <= phone["app_budget_gb"] * 1e9
    assert "q8" in result["formats"].values() or "float" in result["formats"].values()
    assert result["weighted_error"] < result["weighted_error_all_q4"]
    # every step added bytes and stayed in budget; the last plan is the one reported
    totals = [s["total_bytes"] for s in result["steps"]]
    assert totals == sorted(totals) and totals[-1] == result["total_bytes"]


def test_qwen27b_on_a_16gb_phone_needs_a_ternary_role(qwen27b):
    """q4 everywhere (15.9 GB) is over the 12 GB budget: roles go to t3, cheapest first, until it fits."""
    phone = load_phone("android-16gb")
    result = plan_auto(qwen27b, phone=phone, context=8192, model_name="qwen27b")
    assert result["total_bytes"] <= phone["app_budget_gb"] * 1e9
    assert result["ternary_roles"] and set(result["formats"].values()) <= {"t3", "q4", "q8", "float"}
    assert result["steps"][0]["format"] == "t3"
    assert result["weighted_error"] > result["weighted_error_all_q4"]
    assert "Warning:** post-training ternary (t3) / binary (b1) for " in auto_markdown(result)
    # the downgrades were needed: undoing any one of them breaks the budget
    from pipeline.quant.memory_plan import memory_plan, modes_for_scheme

    for role in result["ternary_roles"]:
        mode, groups = modes_for_scheme("q4", "float16", {**result["formats"], role: "q4"})
        plan = memory_plan(qwen27b, quant=mode, group_modes=groups, compute_dtype="float16", contexts=(8192,),
                           prefill_chunk=512, phone=phone)
        assert plan["contexts"][0]["total_bytes"] > phone["app_budget_gb"] * 1e9
    with pytest.raises(ConfigError, match=r"smallest plan, q4 everywhere, needs 15\.\d\d GB at 8192"):
        plan_auto(qwen27b, phone=phone, context=8192, model_name="qwen27b", min_format="q4")


def test_qwen27b_fits_a_12gb_iphone_only_with_a_binary_role(qwen27b):
    """Ternary t3 everywhere is 6.55 GB of the ~6 GB an iOS app gets at 8K: the planner goes one rung lower,
    binary b1 (1.125 bits/weight), for the role that buys the most bytes per unit of error; stopping at t3
    (auto_min_format) refuses in one line."""
    phone = load_phone("iphone-12gb")
    result = plan_auto(qwen27b, phone=phone, context=8192, model_name="qwen27b")
    assert result["total_bytes"] <= phone["app_budget_gb"] * 1e9
    binary = sorted(r for r, f in result["formats"].items() if f == "b1")
    assert binary and set(binary) <= set(result["ternary_roles"])
    assert [s["format"] for s in result["steps"]].index("b1") > 0          # t3 rungs first, then b1
    text = auto_markdown(result)
    assert "| b1 | 1.125 |" in text and f"{binary[0]} (b1)" in text and "Warning:**" in text
    # the plan's weights are what memory_plan counts for those formats (b1 rows: ceil(K/32) words + scales)
    from pipeline.quant.memory_plan import memory_plan, modes_for_scheme

    mode, groups = modes_for_scheme("q4", "float16", result["formats"])
    plan = memory_plan(qwen27b, quant=mode, group_modes=groups, compute_dtype="float16", contexts=(8192,),
                       prefill_chunk=512, phone=phone)
    assert plan["contexts"][0]["total_bytes"] == result["total_bytes"]
    up = plan["weights"]["mlp_up"]
    assert "binary b1" in up["precision"] and 8 * up["bytes"] / up["params"] == pytest.approx(1.125)
    with pytest.raises(ConfigError, match=r"qwen27b does not fit .*smallest plan, ternary t3 everywhere .*needs "
                                          r"6\.\d\d GB at 8192 .* no context length fits, or allow lower formats"):
        plan_auto(qwen27b, phone=phone, context=8192, model_name="qwen27b", min_format="t3")


def test_qwen27b_refused_on_an_8gb_iphone(qwen27b):
    phone = {"name": "iPhone 15 Pro", "ram_gb": 8, "app_budget_gb": 4, "bandwidth_gbs": 51.2}
    with pytest.raises(ConfigError, match=r"qwen27b does not fit iPhone 15 Pro: the smallest plan, binary b1 "
                                          r"everywhere \(1\.125 bits/weight\), needs 4\.\d\d GB at 8192 .*"
                                          r"or a shorter context$"):
        plan_auto(qwen27b, phone=phone, context=8192, model_name="qwen27b")


def test_gqa_weighting_counts_kv_rows_per_query_head(qwen27b):
    from pipeline.quant.auto_plan import role_weights

    w = role_weights(qwen27b)
    t = qwen27b["text_config"]
    q_rows, kv_rows = 2 * 24 * 256, 4 * 256
    assert w["qkv_proj"] == pytest.approx(16 * t["hidden_size"] * (q_rows + 2 * kv_rows * 6))


def test_unknown_phone_is_one_line():
    with pytest.raises(ConfigError, match="unknown phone 'nokia'"):
        load_phone("nokia")


@pytest.mark.parametrize("room", ["some upgrades", pytest.param("some ternary", marks=pytest.mark.slow)])   # ~13 s
def test_auto_build_accounting_matches_emitted_tensors(tmp_path_factory, room):
    """A tiny Qwen3 built with --quant auto for a phone whose budget allows only some upgrades (or needs some
    roles below q4): the bundle's tensor cache holds exactly the weight bytes the plan counted, in the
    formats it chose."""
    from test_model_numerics import tiny_hf_model

    from pipeline.progress import Reporter
    from pipeline.stages import run_pipeline

    folder, _ = tiny_hf_model(tmp_path_factory.mktemp("auto"), "qwen3")
    hf = json.loads((folder / "config.json").read_text())
    host = {"context": 8192, "compute_dtype": "float32"}     # host-cpu computes (and keeps KV) in fp32
    unlimited = plan_auto(hf, phone={"name": "big", "app_budget_gb": 1000, "bandwidth_gbs": 50}, **host)
    if room == "some upgrades":   # between the first upgrade and everything upgraded: q8/float and q4 roles
        budget = (unlimited["steps"][0]["total_bytes"] + unlimited["steps"][-1]["total_bytes"]) / 2 / 1e9
    else:                         # halfway between t3 and q4 everywhere: some roles t3
        from pipeline.quant.memory_plan import memory_plan, modes_for_scheme

        def everywhere(fmt):
            mode, groups = modes_for_scheme("q4", "float16", {r: fmt for r in unlimited["formats"]})
            plan = memory_plan(hf, quant=mode, group_modes=groups, compute_dtype="float32", contexts=(8192,))
            return plan["contexts"][0]["total_bytes"]

        budget = (everywhere("t3") + everywhere("q4")) / 2 / 1e9
    phone = {"name": "tiny phone", "app_budget_gb": budget, "bandwidth_gbs": 50, "ram_gb": 1}
    chosen = plan_auto(hf, phone=phone, **host)
    assert chosen["steps"] and chosen["formats"] != unlimited["formats"]
    assert len(set(chosen["formats"].values())) >= 2     # a real mix, not one format everywhere
    assert bool(chosen["ternary_roles"]) == (room == "some ternary")

    bundle = run_pipeline(str(folder), "host-cpu", "auto", out=str(tmp_path_factory.mktemp("out")),
                          report=Reporter(quiet=True), phone=phone).bundle
    saved = json.loads((bundle / "reports" / "quant_auto.json").read_text())
    assert (bundle / "reports" / "quant_auto.md").is_file()
    index = json.loads((bundle / "tensor-cache.json").read_text())
    emitted = sum(r["nbytes"] for shard in index["records"] for r in shard["records"])
    assert emitted == saved["weights_bytes"]
    assert saved["total_bytes"] <= budget * 1e9
    dtypes = {r["name"]: r["dtype"] for shard in index["records"] for r in shard["records"]}
    for role, fmt in saved["formats"].items():
        weights = [d for n, d in dtypes.items() if n.endswith(f"{role}.q_weight") or n.endswith(f"{role}.weight")]
        want = {"q4": "uint32", "q8": "int8", "t3": "uint32"}.get(fmt)
        assert weights and all(d == want if want else d.startswith("float") for d in weights), (role, weights)


def test_calibrated_eps_is_output_error(tmp_path_factory):
    """With a calibration, each linear role's eps is its layers' relative output error on the calibration
    inputs (what the build's calibrated rounding leaves); the untied embedding, a gather, keeps the
    weight-space error. q8 is far below q4 either way."""
    from test_model_numerics import tiny_hf_model

    from pipeline.frontend.checkpoint import open_checkpoint
    from pipeline.quant.auto_plan import measured_eps
    from pipeline.quant.calibrate import Calibration, CalibrationSpec

    folder, _ = tiny_hf_model(tmp_path_factory.mktemp("eps"), "qwen3")
    ckpt = open_checkpoint(folder)
    roles = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head", "embed_tokens"]
    plain, plain_how = measured_eps(ckpt, roles)
    with Calibration(ckpt, ckpt.config, CalibrationSpec(tokens=256, window=64)) as cal:
        eps, how = measured_eps(ckpt, roles, calibration=cal)
    assert set(plain_how.values()) == {"weights"}
    assert how == {**{r: "output" for r in roles}, "embed_tokens": "weights"}
    assert eps["embed_tokens"] == plain["embed_tokens"]
    for r in roles:
        assert 0 < eps[r]["q8"] < eps[r]["q4"] < 0.1, (r, eps[r])
        if r != "embed_tokens":
            assert eps[r]["q4"] != plain[r]["q4"]
        assert eps[r]["q4"] < eps[r]["rtn_q4"] or r == "embed_tokens", (r, eps[r])   # error feedback helps


def test_calibrated_plan_predicts_kl_and_keeps_the_measurement(tmp_path_factory, monkeypatch):
    """With a calibration (and a model under SENSITIVITY_MAX_PARAMS) each role's cost is a predicted KL: the
    measured KL of 'only this role rounded to q4' scaled by the calibrated / rounded output error, so q4
    costs less than that KL and q8 far less. The measurement is kept in the store: a second plan (another
    budget) does not run the model again."""
    from test_model_numerics import tiny_hf_model

    import pipeline.quant.calibrate as calibrate
    from pipeline.frontend.checkpoint import open_checkpoint
    from pipeline.quant.calibrate import Calibration, CalibrationSpec

    folder, _ = tiny_hf_model(tmp_path_factory.mktemp("kl"), "llama", num_hidden_layers=2)
    ckpt = open_checkpoint(folder)
    store = tmp_path_factory.mktemp("store")
    host = dict(context=1024, compute_dtype="float32", prefill_chunk=128, ckpt=ckpt)
    with Calibration(ckpt, ckpt.config, CalibrationSpec(tokens=256, window=64), store=store) as cal:
        first = plan_auto(ckpt.config, phone={"name": "big", "app_budget_gb": 1000, "bandwidth_gbs": 50},
                          calibration=cal, speed_keep=None, **host)   # memory the only limit
    assert first["error_model"] == "predicted-kl"
    kl = first["role_kl_q4_rtn"]
    assert set(kl) == set(first["formats"]) and all(v > 0 for v in kl.values())
    for r, cost in first["cost"].items():
        assert cost["float"] == 0 < cost["q8"] < 0.05 * cost["q4"], (r, cost)
        assert cost["q4"] < kl[r] or r == "embed_tokens", (r, cost, kl[r])
    assert first["weighted_error"] == 0   # an unlimited budget: float everywhere

    def no_second_run(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(calibrate.Calibration, "_measure_role_sensitivity", no_second_run)
    with Calibration(ckpt, ckpt.config, CalibrationSpec(tokens=256, window=64), store=store) as cal:
        again = plan_auto(ckpt.config, phone={"name": "small", "app_budget_gb": 0.01, "bandwidth_gbs": 50},
                          calibration=cal, **host)
    assert again["role_kl_q4_rtn"] == kl


@pytest.mark.slow
@pytest.mark.parametrize("target,phone", [("ios-metal", "iphone-12gb"), ("android-adreno", "android-16gb")])
def test_qwen27b_auto_bundle_saves_the_plan(tmp_path, target, phone):
    """The one-command build (config only, ~35 s): the plan is printed and saved in the bundle, and the
    sub-q4 roles' GEMVs are GPU kernels (the b1 / t3 dequantize fused into dlight's GEMV)."""
    from pipeline.progress import Reporter
    from pipeline.stages import run_pipeline

    result = run_pipeline("qwen27b", target, "auto", out=str(tmp_path), phone=phone, report=Reporter(quiet=True))
    bundle = result.bundle
    saved = json.loads((bundle / "reports" / "quant_auto.json").read_text())
    assert saved["total_bytes"] <= saved["budget_bytes"] and saved["ternary_roles"]
    assert "Warning:**" in (bundle / "reports" / "quant_auto.md").read_text()
    low = set(saved["formats"].values()) & {"b1", "t3"}
    assert low == ({"b1", "t3"} if phone == "iphone-12gb" else {"t3"})
    kernels = json.loads((bundle / "reports" / "kernels.json").read_text())["kernels"]
    for fmt in low:
        rules = [k["rule"] for k in kernels if f"dequantize_{fmt}" in k["name"]]
        assert {"gemv", "dequant_gemv"} & set(rules), (fmt, rules)


@pytest.fixture(scope="module")
def moe35b():
    return load_model("qwen3.5-35b-a3b").hf_config


def test_35b_a3b_fits_a_24gb_phone_with_q4_experts(moe35b):
    """The 35B MoE at q4 (19.8 GB at 8K) fits the 24 GB phone's 20 GB: experts stay q4 (q8 experts would add
    ~16 GB), the small roles take what is left; routed experts weigh their active parameters (8 of 256)."""
    phone = {"id": "android-24gb", **load_phone("android-24gb")}
    result = plan_auto(moe35b, phone=phone, context=8192, model_name="qwen3.5-35b-a3b")
    assert result["total_bytes"] <= 20e9 and result["formats"]["experts"] == "q4"
    assert result["role_weights"]["experts"] == 40 * 8 * 3 * 512 * 2048   # active, not 40 x 256 x ...
    assert "shared_expert" in result["formats"] and "gate_up_proj" not in result["formats"]   # no dense MLP
    assert not result["ternary_roles"]
    md = auto_markdown(result)
    assert "PREDICTION: decode" in md and "Mixture of experts" in md
    # decode reads the active bytes: ~1.7 GB of ~19.7 GB stored
    assert result["plan"]["weights_read_per_token"]["bytes"] < result["weights_bytes"] / 10


def test_35b_a3b_experts_stay_q4_while_a_plan_fits_with_them(moe35b):
    """Between "experts q4, the rest b1" (18.8 GB) and q4 everywhere (19.8 GB) the plan fits by downgrading the
    other roles; the experts stay q4 (their floor drops only when nothing fits above it)."""
    phone = {"name": "a 19.5 GB budget", "ram_gb": 24, "app_budget_gb": 19.5, "bandwidth_gbs": 84.8}
    result = plan_auto(moe35b, phone=phone, context=8192, model_name="qwen3.5-35b-a3b")
    assert result["total_bytes"] <= 19.5e9 and result["formats"]["experts"] == "q4"
    assert result["ternary_roles"] and "experts" not in result["ternary_roles"]
    assert result["role_floor"] == {"experts": "q4"}


def test_35b_a3b_fits_a_16gb_phone_only_with_ternary_experts(moe35b):
    """The 16 GB phone's 12 GB: experts q4 with everything else b1 needs 18.77 GB (refused before ternary experts
    were stored), so the experts' floor drops to t3 — not b1: t3 experts fit — and the plan says what that cost
    on the toy (the measured top-1 of auto_plan.TOY_EXPERT_TOP1)."""
    phone = {"id": "android-16gb", **load_phone("android-16gb")}
    result = plan_auto(moe35b, phone=phone, context=8192, model_name="qwen3.5-35b-a3b")
    assert result["formats"]["experts"] == "t3" and result["role_floor"] == {"experts": "t3"}
    assert result["total_bytes"] <= 12e9 and "experts" in result["ternary_roles"]
    # 40 layers x 256 experts x (1024 rows of 103 words + 16 scales, 2048 rows of 26 words + 4 scales)
    assert result["plan"]["moe"]["routed_bytes"] == 40 * 256 * (1024 * 444 + 2048 * 112)
    md = auto_markdown(result)
    assert "Experts t3 (post-training): no plan with the experts above t3 fits" in md
    assert "85.5% top-1" in md and "PREDICTION: decode" in md
    from pipeline.quant.memory_plan import memory_plan, modes_for_scheme

    mode, groups = modes_for_scheme("b1", "float16", {"experts": "q4"})   # why the floor dropped: 18.77 GB > 12
    smallest = memory_plan(moe35b, quant=mode, group_modes=groups, contexts=(8192,), phone=phone)
    assert round(smallest["contexts"][0]["total_bytes"] / 1e9, 2) == 18.77


def test_35b_a3b_upgrades_keep_the_decode_speed_on_a_16gb_phone(moe35b):
    """With t3 experts on the 16 GB phone ~3 GB are left over; spending them on float GDN / attention / shared
    expert (memory the only limit) predicts 11.1 tok/s against 28.1 for the plan before upgrades. Upgrades may
    cost at most 1 - SPEED_KEEP of that speed: same experts, the plan within 10% of 28.1, the unlimited one
    still available (speed_keep=None) and slower; on the 24 GB phone the cap changes nothing (its q8 upgrades
    cost 9%)."""
    from pipeline.quant.auto_plan import SPEED_KEEP

    phone = {"id": "android-16gb", **load_phone("android-16gb")}
    capped = plan_auto(moe35b, phone=phone, context=8192, model_name="qwen3.5-35b-a3b")
    unlimited = plan_auto(moe35b, phone=phone, context=8192, model_name="qwen3.5-35b-a3b", speed_keep=None)
    speed = {name: r["plan"]["contexts"][0]["predicted_decode_tok_s"] for name, r in
             (("capped", capped), ("unlimited", unlimited))}
    before = capped["decode_tok_s_before_upgrades"]
    assert round(before, 1) == 28.1 and round(speed["unlimited"], 1) == 11.1
    assert SPEED_KEEP * before <= speed["capped"] < before and capped["steps"]
    assert "kept at least 90% of its predicted decode speed (28.12 tok/s)" in auto_markdown(capped)
    assert capped["formats"]["experts"] == unlimited["formats"]["experts"] == "t3"
    assert "float" in unlimited["formats"].values()
    phone24 = {"id": "android-24gb", **load_phone("android-24gb")}
    assert plan_auto(moe35b, phone=phone24, context=8192)["formats"] == plan_auto(
        moe35b, phone=phone24, context=8192, speed_keep=None)["formats"]


def test_35b_a3b_b1_experts_only_below_t3s_fit_and_refused_in_one_line(moe35b):
    """The 6 GB an iPhone app gets: t3 experts do not fit even with the rest b1, so the experts go b1; below what
    b1 everywhere needs, a one-line refusal."""
    phone = {"id": "iphone-12gb", **load_phone("iphone-12gb")}
    result = plan_auto(moe35b, phone=phone, context=8192, model_name="qwen3.5-35b-a3b")
    assert result["formats"]["experts"] == "b1" and result["role_floor"] == {"experts": "b1"}
    assert result["total_bytes"] <= 6e9
    tiny = {"name": "a 4 GB budget", "ram_gb": 6, "app_budget_gb": 4, "bandwidth_gbs": 50.0}
    with pytest.raises(ConfigError) as err:
        plan_auto(moe35b, phone=tiny, context=8192, model_name="qwen3.5-35b-a3b")
    text = str(err.value)
    assert "\n" not in text and "qwen3.5-35b-a3b does not fit a 4 GB budget" in text
    assert "the smallest plan, binary b1 everywhere (1.125 bits/weight), needs" in text
