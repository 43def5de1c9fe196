"""QUANT=auto: a weight format per layer role that fits a phone's app budget at a context length.

Accounting is the memory plan's (`memory_plan.py`: weights per precision + KV cache at the context +
recurrent state + activations), so the plan printed here is the same arithmetic the bundle's memory report
uses — and that arithmetic is tested byte-exact against the model's real parameters.

Error model (what "minimise the weighted error" means here). A role r (qkv_proj, o_proj, gate_up_proj,
down_proj, in_proj, out_proj, lm_head, embed_tokens) stored in format f contributes

    E_r(f) = eps_r(f) * W_r,      W_r = sum over its rows of (number of heads that read the row)

* eps_r(f): the relative error format f gives role r, **measured** on a sample of the role's real weights
  when a checkpoint is given (16-row blocks spread over up to 4 tensors per role), as the build will store
  them. With calibration (the scheme's `calibration`, see calibrate.py) it is the layer's relative output
  error on the calibration text, tr(D H D^T) / tr(W H W^T) with D = W - deq(W), H = E[x x^T] of the
  layer's input and W rounded by the same error feedback as the build (gptq.py) — the sensitivity of the
  layer's output, not of its weights. Without calibration, or for a role with no measured input (an untied
  embedding: a gather), it is the weight-space mean((w - deq(w))^2) / mean(w^2) of round-to-nearest
  (quantize.py). With no checkpoint: the value for Gaussian weights (q4 ~ 7.1e-3, q8 ~ 2.9e-5, measured
  once with numpy and fixed below; t3 / b1 = the MSE-optimal ternary / binary per group of 128, never
  calibrated).
* W_r: GQA-aware parameter weight. Each k/v row of a full-attention layer serves num_heads / num_kv_heads
  query heads (6 in qwen27b), so its error counts that many times; in Gated-DeltaNet, each q/k row of the
  fused input projection serves value_heads / key_heads heads (3). Every other row counts once.

End to end (a checkpoint with a calibration, up to SENSITIVITY_MAX_PARAMS values). A role's output error
does not say how much it moves the next-token distribution: an error in down_proj or v lands on the
residual stream as is, one in gate_up_proj is damped by the gating, and the embedding / lm_head touch every
token. So the calibration also measures, per role, KL_r = mean KL(float || model with only role r rounded
to q4) on the calibration text (calibrate.Calibration.role_sensitivity: one streamed pass, one hidden-state
stream per role), and the cost of role r in format f becomes the predicted KL

    C_r(f) = KL_r * eps_r(f) / eps_r(q4 rounded to nearest)

(KL grows with the energy of the error a role injects, eps is that energy relative to the output's; roles
add, to first order). GQA sharing is then inside the measurement (a shared k/v row's error reaches all
the heads that read it). Bigger models keep the GQA-weighted eps above (the pass costs roles + 1 forwards).

Search: start with q4 everywhere. If that does not fit, move roles down the ladder below q4 — ternary t3
(post-training, 1.725 bits/weight), then binary b1 (1.125) — one rung at a time: a single downgrade that
makes the plan fit, the cheapest such, else the one adding the least cost per byte saved; refuse if even the
scheme's `auto_min_format` (b1 by default; t3 or q4 to stop higher) everywhere does not fit. Then
repeatedly apply the upgrade (b1 -> t3 -> q4 -> q8 -> float) with the largest error reduction per added
byte that still fits, until none does. Greedy on a per-role basis: 8 roles, a handful of steps. Ternarising
or binarising an ordinary model is very lossy (SmolLM2 ternary_ptq: perplexity in the millions), so a plan
with such roles carries a warning: it fits, it is not a usable model unless the checkpoint is natively
ternary / binary. qwen27b on a 12 GB iPhone at 8K is the case b1 exists for: t3 everywhere needs 6.55 GB of
the ~6 GB an iOS app gets. Mixture-of-experts models: the routed experts start with a floor of q4, lowered to
t3 and then b1 only when no plan fits above it (EXPERT_FLOORS); the 35B fits a 16 GB phone only so.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from pipeline.errors import ConfigError
from pipeline.formats import FORMATS
from pipeline.frontend.hf_config import text_config
from pipeline.quant.convert import TEXT_PREFIXES
from pipeline.quant.gptq import output_error, quantize_rows
from pipeline.quant.memory_plan import (
    OVERRIDING_ROLES,
    ROLE_GROUPS,
    memory_plan,
    modes_for_scheme,
    plan_config,
    read_share,
    tensor_shapes,
)
from pipeline.quant.quantize import dequantize_q4, dequantize_q8, quantize_q4, quantize_q8
from pipeline.quant.ternary import dequantize_ternary, quantize_ternary

LADDER = ("b1", "t3", "q4", "q8", "float")
BELOW_Q4 = ("b1", "t3")           # post-training sign formats: the plan warns when it uses them
SENSITIVITY_MAX_PARAMS = 1.0e9   # the end-to-end sensitivity pass (roles + 1 forwards) for models up to this size
GAUSSIAN_EPS = {"b1": 0.361, "t3": 0.187, "q4": 7.1e-3, "q8": 2.9e-5, "float": 0.0}
BITS = {f: FORMATS[f].bits_per_weight(5120) for f in ("b1", "t3", "q4", "q8", "float")}   # at K = 5120
_FORMAT_NAMES = {"b1": "binary b1", "t3": "ternary t3"}
_HF_KEYS = {
    "qkv_proj": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "o_proj": ("self_attn.o_proj.weight",),
    "gate_up_proj": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down_proj": ("mlp.down_proj.weight",),
    "in_proj": ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight"),
    "out_proj": ("linear_attn.out_proj.weight",),
    "lm_head": ("lm_head.weight",),
    "embed_tokens": ("embed_tokens.weight",),
    # transformers' stacked expert parameters (the sensitivity pass); checkpoints hold them per expert (_EXPERT_CKPT)
    "experts": ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
    "shared_expert": ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight",
                      "mlp.shared_expert.down_proj.weight"),
}
_EXPERT_CKPT = re.compile(r"\.experts\.\d+\.(gate|up|down)_proj\.weight$")
# The routed experts' floor, lowered one rung only when no plan fits above it: q4 unless nothing with q4 experts
# fits, t3 unless nothing with t3 experts fits, then b1 (the gather kernels store all of them, models/moe.py).
# Post-training sign experts are below the project's 90% top-1 bar; measured on the trained toy MoE with only
# the routed experts rounded, top-1 agreement with fp32 over 512 teacher-forced positions (docs/moe.md;
# tests/test_moe.py::test_routed_experts_tolerate_lower_bits asserts these numbers):
EXPERT_FLOORS = ("q4", "t3", "b1")
# Upgrades (the spending of memory left over after the plan fits) may cost at most 10% of the predicted decode
# speed of the plan they start from: an upgrade that buys a little quality with a lot of bytes read per token
# is not what a phone wants. The 35B MoE on the 16 GB phone spent its leftover 3 GB on float GDN / attention
# / shared expert (PREDICTION 11.1 tok/s against 28.1 with the same t3 experts and the rest q4); on the 24 GB
# phone its q8 upgrades cost 9% (25.6 -> 23.3) and stay. The embedding is a gather (never read whole): its
# upgrades cost no speed. docs/quantization.md.
SPEED_KEEP = 0.9
TOY_EXPERT_TOP1 = {"q8": 1.0, "q4": 0.977, "t3": 0.855, "b1": 0.828}


def role_weights(hf_config: dict) -> dict[str, float]:
    """W_r: parameters per role, k/v (and GDN q/k) rows counted once per head that reads them, routed experts
    by the k of E that a token runs through (active parameters). Mixture-of-experts configs plan the shared
    expert as its own role (`shared_expert`)."""
    cfg = plan_config(hf_config)
    params: dict[str, float] = {}
    for group, shape, count in tensor_shapes(cfg):
        if len(shape) != 2:
            continue
        n = shape[0] * shape[1] * count
        if group in ("attn_k", "attn_v"):
            n *= cfg.num_attention_heads / cfg.num_key_value_heads
        if group == "gdn_in_proj_qkv":
            lin = cfg.linear
            key_rows = 2 * lin.key_heads * lin.key_head_dim
            share = lin.value_heads / lin.key_heads
            n = (key_rows * share + shape[0] - key_rows) * shape[1] * count
        num, den = read_share(cfg, group) if group != "embedding" else (1, 1)
        n = n * num / den   # routed experts: the k of E a token runs through carry its error
        roles = [r for r, groups in ROLE_GROUPS.items() if group in groups]
        own = [r for r in roles if r in OVERRIDING_ROLES]
        for role in own[:1] or roles:
            params[role] = params.get(role, 0.0) + n
    return params


def measured_eps(ckpt: Any, roles: list[str], rows: int = 16, blocks: int = 4, calibration: Any = None,
                 tied: bool = False) -> tuple[dict[str, dict[str, float]], dict[str, str]]:
    """(eps_r(f) from samples of the checkpoint's own weights, {role: how it was measured}): output error
    with the calibration's layer inputs where it has them, weight-space error of rounding otherwise."""
    out: dict[str, dict[str, float]] = {}
    how: dict[str, str] = {}
    names = ckpt.names()
    for role in roles:
        tensors = [n for n in names if _in_role(n, role) and len(ckpt.shape(n)) == 2][:4]
        err = {"b1": 0.0, "t3": 0.0, "q4": 0.0, "q8": 0.0, "rtn_q4": 0.0}
        total = 0.0
        kinds = set()
        for name in tensors:
            n_rows, k = ckpt.shape(name)
            if k % 32:
                continue
            layer = _calibrated_input(calibration, name, tied)
            kinds.add("output" if layer else "weights")
            for b in range(blocks):
                start = (n_rows - rows) * b // max(1, blocks - 1) if n_rows > rows else 0
                w = ckpt.get_rows(name, start, min(n_rows, start + rows)).astype(np.float32)
                if layer is None:
                    total += float((w * w).sum())
                    q4 = float(((dequantize_q4(*quantize_q4(w)) - w) ** 2).sum())   # rounded: rtn is q4
                    err["q4"] += q4
                    err["rtn_q4"] += q4
                    err["q8"] += float(((dequantize_q8(*quantize_q8(w)) - w) ** 2).sum())
                    for sign in BELOW_Q4:
                        deq = dequantize_ternary(*quantize_ternary(w, sign), sign, k)
                        err[sign] += float(((deq - w) ** 2).sum())
                else:
                    e, t = _output_errors(w, layer)
                    total += t
                    for fmt in err:
                        err[fmt] += e[fmt]
        if total > 0:
            out[role] = {**{f: err[f] / total for f in err}, "float": 0.0}
            how[role] = "+".join(sorted(kinds))
    return out, how


def _in_role(name: str, role: str) -> bool:
    """Whether checkpoint tensor `name` belongs to `role` (a routed expert's per-expert tensors to `experts` only)."""
    if role == "experts":
        return bool(_EXPERT_CKPT.search(name))
    return name.endswith(_HF_KEYS.get(role, ())) and ".experts." not in name


def checkpoint_params(ckpt: Any) -> int:
    """Number of values in the checkpoint (the size the sensitivity pass's cost scales with)."""
    return sum(math.prod(ckpt.shape(n)) for n in ckpt.names())


def _calibrated_input(calibration: Any, hf_name: str, tied: bool) -> Any:
    """The calibration's input of the linear layer holding checkpoint tensor `hf_name`, or None."""
    if calibration is None or not hf_name.endswith(".weight"):
        return None

    module = hf_name[: -len(".weight")]
    for prefix in TEXT_PREFIXES:            # model.language_model.layers... -> model.layers...
        if module.startswith(prefix):
            module = "model." + module[len(prefix):]
    if module == "model.embed_tokens":
        return calibration.input_of("model.embed_tokens", tied)
    return calibration.input_of(module, tied)


def _output_errors(w: Any, layer: Any) -> tuple[dict[str, float], float]:
    """tr(D H D^T) for q4 and q8 (error feedback, as the build stores them), t3, b1 and rounded q4 (no
    feedback, as the build stores them) and tr(W H W^T)."""
    h, prep = layer.hessian(), layer.prepared()
    errs = {}
    for fmt in ("q4", "q8"):
        levels, s = quantize_rows(w, prep, fmt)
        errs[fmt] = output_error(w, levels * np.repeat(s.astype(np.float32), 32, axis=1), h)
    errs["rtn_q4"] = output_error(w, dequantize_q4(*quantize_q4(w)), h)
    for sign in BELOW_Q4:
        errs[sign] = output_error(w, dequantize_ternary(*quantize_ternary(w, sign), sign, w.shape[1]), h)
    return errs, output_error(w, np.zeros_like(w), h)


def plan_auto(hf_config: dict, *, phone: dict, context: int, compute_dtype: str = "float16",
              prefill_chunk: int = 512, ckpt: Any = None, model_name: str = "model",
              calibration: Any = None, min_format: str = "b1", speed_keep: float | None = SPEED_KEEP) -> dict:
    """The chosen formats and the memory plan they give; ConfigError when nothing from `min_format` (b1, t3
    or q4) up fits. `calibration` (calibrate.Calibration of `ckpt`): eps as calibrated output error (module
    docstring). `speed_keep`: upgrades keep the predicted decode speed at least this share of the plan's
    before them (SPEED_KEEP; None: memory is the only limit)."""
    if not phone or not phone.get("app_budget_gb"):
        raise ConfigError("QUANT=auto needs the phone's app memory budget", path=None,
                          fix="give the target a phone: {ram_gb, app_budget_gb, bandwidth_gbs} or pass --phone")
    moe = text_config(hf_config).is_moe
    budget = float(phone["app_budget_gb"]) * 1e9
    weights = role_weights(hf_config)
    roles = sorted(weights)
    eps = {r: dict(GAUSSIAN_EPS) for r in roles}
    source = "gaussian"
    how: dict[str, str] = {}
    if ckpt is not None:
        tied = text_config(hf_config).tie_word_embeddings
        measured, how = measured_eps(ckpt, roles, calibration=calibration, tied=tied)
        eps.update(measured)
        source = ("measured: relative output error on the calibration text (calibrated rounding)"
                  if "output" in "".join(how.values()) else "measured on the checkpoint's weights (rounding)")
        weight_space = sorted(r for r, h in how.items() if "weights" in h)
        if calibration is not None and weight_space:
            source += f"; weight-space error for {', '.join(weight_space)} (no measured input)"

    cost = {r: {f: eps[r][f] * weights[r] for f in LADDER} for r in roles}
    kl = None
    # the sensitivity pass is not validated on routed experts: MoE plans keep the active-weighted eps
    if ckpt is not None and calibration is not None and checkpoint_params(ckpt) <= SENSITIVITY_MAX_PARAMS \
            and not moe:
        kl = calibration.role_sensitivity({r: _HF_KEYS.get(r, ()) for r in roles}, tied=tied)
        for r in roles:
            rtn = eps[r].get("rtn_q4", 0.0)
            if rtn > 0 and r in kl:
                cost[r] = {f: kl[r] * eps[r][f] / rtn for f in LADDER}
        source += ("; each role's error scaled to its effect on the output: predicted KL = measured KL of "
                   "the model with that role rounded to q4 x eps(format) / eps(q4 rounded)")

    def evaluate(formats: dict[str, str]) -> tuple[int, dict]:
        mode, groups = modes_for_scheme("q4", "float16", formats)
        plan = memory_plan(hf_config, quant=mode, group_modes=groups, compute_dtype=compute_dtype,
                           contexts=(context,), prefill_chunk=prefill_chunk, phone=phone)
        return int(plan["contexts"][0]["total_bytes"]), plan

    formats = {r: "q4" for r in roles}
    total, plan = evaluate(formats)
    steps: list[dict] = []
    expert_floors = [f for f in EXPERT_FLOORS if LADDER.index(f) >= LADDER.index(min_format)]
    candidates = [{"experts": f} for f in expert_floors] if "experts" in roles else [{}]
    floors = candidates[0]

    def lowest(r: str) -> str:
        return max(min_format, floors.get(r, min_format), key=LADDER.index)

    if total > budget:
        for candidate in candidates:   # the experts' floor drops a rung only when nothing fits above it
            floors = candidate
            smallest, small_plan = evaluate({r: lowest(r) for r in roles})
            if smallest <= budget:
                break
        if smallest > budget:
            everywhere = ("q4 everywhere" if min_format == "q4" else
                          f"{_FORMAT_NAMES[min_format]} everywhere ({BITS[min_format]} bits/weight)")
            floored = sorted(r for r in roles if lowest(r) != min_format)
            if floored:
                everywhere += " but " + ", ".join(f"{r} {lowest(r)}" for r in floored) + " (their floor)"
            without_kv = smallest - small_plan["contexts"][0]["kv_bytes"]
            raise ConfigError(
                f"{model_name} does not fit {_phone_name(phone)}: the smallest plan, {everywhere}, "
                f"needs {smallest / 1e9:.2f} GB at {context} tokens of context ({without_kv / 1e9:.2f} GB without "
                f"the KV cache; q4 everywhere {total / 1e9:.2f} GB), the app budget is {budget / 1e9:.3g} GB",
                path=None, fix=(f"choose a phone with an app budget of at least {smallest / 1e9:.2f} GB (--phone, "
                                "configs/phones.yaml)"
                                + (": no context length fits" if without_kv > budget else " or a shorter context")
                                + (", or allow lower formats (auto_min_format: b1)" if min_format != "b1" else "")))
        total, plan = _downgrade_until_fits(formats, roles, cost, budget, evaluate, steps, (total, plan),
                                            floor={r: LADDER.index(lowest(r)) for r in roles})
    floor_speed = _decode_speed(plan)
    min_speed = speed_keep * floor_speed if speed_keep and floor_speed else 0.0
    while True:
        best = None
        for r in roles:
            i = LADDER.index(formats[r])
            if i + 1 == len(LADDER):
                continue
            trial = {**formats, r: LADDER[i + 1]}
            t_total, t_plan = evaluate(trial)
            gain = cost[r][formats[r]] - cost[r][LADDER[i + 1]]
            if min_speed and _decode_speed(t_plan) < min_speed:
                continue          # the speed this upgrade would cost is over what upgrades may spend
            if t_total <= budget and t_total > total and (best is None or gain / (t_total - total) > best[0]):
                best = (gain / (t_total - total), r, LADDER[i + 1], t_total, t_plan)
        if best is None:
            break
        _, r, fmt, total, plan = best
        formats[r] = fmt
        steps.append({"role": r, "format": fmt, "total_bytes": total})
    norm = 1.0 if kl is not None else sum(weights.values())
    error = sum(cost[r][formats[r]] for r in roles) / norm
    q4_error = sum(cost[r]["q4"] for r in roles) / norm
    return {"phone": phone, "context": context, "budget_bytes": int(budget), "total_bytes": total,
            "formats": formats, "steps": steps, "eps_source": source, "eps_measured_as": how,
            "eps": {r: eps[r] for r in roles}, "role_weights": weights,
            "error_model": "predicted-kl" if kl is not None else "weighted-eps",
            "ternary_roles": sorted(r for r, f in formats.items() if f in BELOW_Q4),
            "role_floor": {r: lowest(r) for r in floors}, "moe": plan.get("moe"),
            "role_kl_q4_rtn": kl, "cost": cost,
            "weighted_error": error, "weighted_error_all_q4": q4_error,
            "weights_bytes": plan["weights_total"]["bytes"], "plan": plan,
            "speed_keep": speed_keep if min_speed else None, "decode_tok_s_before_upgrades": floor_speed}


def _decode_speed(plan: dict) -> float | None:
    """The plan's PREDICTION of decode tok/s at its context (None without the phone's bandwidth)."""
    return plan["contexts"][0].get("predicted_decode_tok_s")


def _phone_name(phone: dict) -> str:
    """The phone as the user named it (--phone NAME) and as the registry describes it."""
    name = phone.get("name", "the phone")
    return f"{phone['id']} ({name})" if phone.get("id") and phone["id"] != name else name


def _downgrade_until_fits(formats: dict[str, str], roles: list[str], cost: dict, budget: float, evaluate: Any,
                          steps: list[dict], current: tuple[int, dict], floor: dict[str, int]) -> tuple[int, dict]:
    """Roles one rung down the ladder from q4 (q4 -> t3 -> b1, never below LADDER[floor[role]]; in `formats`,
    recorded in `steps`) until the plan fits: the cheapest single downgrade that fits, else the least added
    cost per byte saved. `current`: evaluate(formats), already computed. The caller checked that every role
    at its floor fits."""
    total, plan = current
    top = LADDER.index("q4")
    while total > budget:
        options = []
        for r in roles:
            i = LADDER.index(formats[r])
            if not floor[r] < i <= top:
                continue
            lower = LADDER[i - 1]
            t_total, t_plan = evaluate({**formats, r: lower})
            if t_total < total:
                options.append((cost[r][lower] - cost[r][formats[r]], total - t_total, r, t_total, t_plan, lower))
        fitting = [o for o in options if o[3] <= budget]
        _, _, r, total, plan, lower = (min(fitting, key=lambda o: o[0]) if fitting else
                                       min(options, key=lambda o: o[0] / o[1]))
        formats[r] = lower
        steps.append({"role": r, "format": lower, "total_bytes": total})
    return total, plan


TERNARY_WARNING = ("post-training ternary (t3) / binary (b1) for {roles}: the plan fits, but ternarising or "
                   "binarising an ordinary model destroys it (SmolLM2-135M ternary_ptq: perplexity ~1e7) — "
                   "usable only with a natively ternary / binary checkpoint, a bigger phone or a shorter context")


def auto_markdown(result: dict) -> str:
    p, plan = result["phone"], result["plan"]
    ctx = plan["contexts"][0]
    lines = [f"# QUANT=auto for {p.get('name')} ({p.get('ram_gb')} GB, app budget {p['app_budget_gb']} GB) "
             f"at {result['context']} tokens", "",
             (f"Error model: predicted KL on the calibration text, eps {result['eps_source']}. Predicted KL "
              if result.get("error_model") == "predicted-kl" else
              f"Error model: GQA-weighted relative error, eps {result['eps_source']}. Weighted error ")
             + f"{result['weighted_error']:.3g} (q4 everywhere: {result['weighted_error_all_q4']:.3g}).", "",
             "| role | format | bits/weight | weighted params | eps | predicted KL |",
             "|---|---|---:|---:|---:|---:|"]
    predicted = result.get("error_model") == "predicted-kl"
    for r, fmt in sorted(result["formats"].items()):
        kl = f"{result['cost'][r][fmt]:.2e}" if predicted else "—"
        lines.append(f"| {r} | {fmt} | {BITS[fmt]} | {result['role_weights'][r] / 1e6:,.1f} M | "
                     f"{result['eps'][r][fmt]:.2e} | {kl} |")
    if result.get("ternary_roles"):
        lines += ["", "**Warning:** " + TERNARY_WARNING.format(
            roles=", ".join(f"{r} ({result['formats'][r]})" for r in result["ternary_roles"])) + "."]
    lines += ["", f"Weights {result['weights_bytes'] / 1e9:.2f} GB; KV cache {ctx['kv_bytes'] / 1e9:.2f} GB; "
              f"total {result['total_bytes'] / 1e9:.2f} GB of {result['budget_bytes'] / 1e9:.1f} GB; "
              f"PREDICTION: decode {ctx['predicted_decode_tok_s']:.2f} tok/s "
              f"(model: {plan['sustained_bandwidth_share']:.0%} of {p.get('bandwidth_gbs')} GB/s peak / "
              f"{ctx['decode_bytes_per_token'] / 1e9:.2f} GB read per token = weights read + KV + 2 x state)."]
    if result.get("speed_keep"):
        lines += ["", f"Upgrades above the fitting plan kept at least {result['speed_keep']:.0%} of its predicted decode "
                  f"speed ({result['decode_tok_s_before_upgrades']:.2f} tok/s): more bytes read per token for a "
                  "little less error is not spent on a phone (auto_plan.SPEED_KEEP)."]
    moe = result.get("moe")
    if moe:
        lines += ["", f"Mixture of experts: the routed experts are weighted by their active parameters ({moe['top_k']} "
                  f"of {moe['experts']} per token: the error a token sees). " + _expert_floor_line(result)
                  + f" Decode reads the active bytes: {plan['weights_read_per_token']['bytes'] / 1e9:.2f} GB of "
                  f"{result['weights_bytes'] / 1e9:.2f} GB stored."]
    return "\n".join(lines) + "\n"


def _expert_floor_line(result: dict) -> str:
    """Why the experts got their format, with the toy's measured top-1 of the formats below q4."""
    fmt, floor = result["formats"].get("experts"), result["role_floor"].get("experts")
    toy = (f"on the trained toy MoE, post-training t3 experts keep {TOY_EXPERT_TOP1['t3']:.1%} top-1 agreement "
           f"with fp32 and b1 {TOY_EXPERT_TOP1['b1']:.1%} (q4 {TOY_EXPERT_TOP1['q4']:.1%}; the bar is 90%, "
           "docs/moe.md)")
    if fmt is None or LADDER.index(fmt) >= LADDER.index("q4"):
        return f"Experts {fmt}: kept at q4 or above, since a plan fits with them there ({toy})."
    return (f"Experts {fmt} (post-training): no plan with the experts above {floor} fits the budget, so their "
            f"floor came down to {floor}; {toy}.")
