"""reports/coverage.html: one self-contained page per bundle (inline CSS and SVG, no scripts, no network).

It shows the coverage summary (kernels, FLOPs and bytes on the accelerator vs the CPU, with shares), the
placement shares as bar charts, the per-op-class table with a Total row, the per-kernel table and, beside
them, the memory plan (reports/memory.json) when the bundle has one. The charts are SVG drawn here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup, escape

from pipeline.report.text import PHASES, fmt_bytes, fmt_num, load_memory, summarize

ACCEL_COLOR = "#2f6fb0"
CPU_COLOR = "#d9822b"
OTHER_COLOR = "#7a8b99"
PALETTE = ("#2f6fb0", "#5aa36a", "#d9822b", "#9b59b6", "#c0392b", "#16a085", "#8e6c3a", "#7a8b99")


def fmt_dec_bytes(n: float | None) -> str:
    """Decimal units, as memory.md writes them."""
    if n is None:
        return "n/a"
    n = float(n)
    for div, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}" if unit == "GB" else f"{n / div:.1f} {unit}"
    return f"{int(n)} B"


def _pct(part: float, total: float) -> float:
    return round(100.0 * part / total, 2) if total else 0.0


# ------------------------------------------------------------------------------------------- SVG
def share_bars_svg(rows: list[tuple[str, list[tuple[str, float, str]]]], width: int = 560) -> Markup:
    """Horizontal 100% stacked bars: rows of (label, [(part name, value, color)]); each bar says its shares."""
    label_w, bar_w, row_h, gap = 130, width - 130 - 10, 22, 10
    height = len(rows) * (row_h + gap) + 26
    out = [f'<svg class="chart" role="img" width="{width}" height="{height}" viewBox="0 0 {width} {height}">']
    for i, (label, parts) in enumerate(rows):
        y = i * (row_h + gap)
        total = sum(v for _, v, _ in parts)
        out.append(f'<text x="0" y="{y + 15}" class="lbl">{escape(label)}</text>')
        x = float(label_w)
        if not total:
            out.append(f'<rect x="{label_w}" y="{y}" width="{bar_w}" height="{row_h}" fill="#e5e8eb"/>'
                       f'<text x="{label_w + 6}" y="{y + 15}" class="in dark">nothing costed</text>')
            continue
        for name, value, color in parts:
            w = bar_w * value / total
            share = _pct(value, total)
            if w <= 0:
                continue
            out.append(f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{row_h}" fill="{color}">'
                       f'<title>{escape(label)}: {escape(name)} {share}%</title></rect>')
            if w > 70:
                out.append(f'<text x="{x + 6:.2f}" y="{y + 15}" class="in">{escape(name)} {share}%</text>')
            x += w
    y = len(rows) * (row_h + gap) + 8
    legend = [("accelerator", ACCEL_COLOR), ("CPU", CPU_COLOR)]
    for j, (name, color) in enumerate(legend):
        lx = label_w + j * 120
        out.append(f'<rect x="{lx}" y="{y}" width="12" height="12" fill="{color}"/>'
                   f'<text x="{lx + 18}" y="{y + 11}" class="lbl">{name}</text>')
    out.append("</svg>")
    return Markup("".join(out))


def value_bars_svg(items: list[tuple[str, float, str, str]], width: int = 560) -> Markup:
    """Horizontal bars scaled to the largest value: (label, value, value text, color)."""
    label_w, text_w, row_h, gap = 130, 110, 16, 6
    bar_w = width - label_w - text_w
    height = max(1, len(items)) * (row_h + gap)
    top = max((v for _, v, _, _ in items), default=0) or 1
    out = [f'<svg class="chart" role="img" width="{width}" height="{height}" viewBox="0 0 {width} {height}">']
    for i, (label, value, text, color) in enumerate(items):
        y = i * (row_h + gap)
        w = bar_w * value / top
        out.append(f'<text x="0" y="{y + 12}" class="lbl">{escape(label)}</text>'
                   f'<rect x="{label_w}" y="{y}" width="{w:.2f}" height="{row_h}" fill="{color}">'
                   f'<title>{escape(label)}: {escape(text)}</title></rect>'
                   f'<text x="{label_w + w + 4:.2f}" y="{y + 12}" class="lbl">{escape(text)}</text>')
    out.append("</svg>")
    return Markup("".join(out))


# ------------------------------------------------------------------------------------------ model
def _page_model(cov: dict[str, Any], memory: dict[str, Any] | None) -> dict[str, Any]:
    s = summarize(cov)
    acc_k, cpu_k = s["kernels_on_accelerator"], s["kernels_on_cpu"]
    phases = []
    for phase in PHASES:
        p = s[phase]
        phases.append({"name": phase.replace("_", " "), "acc": p["accelerator"], "cpu": p["cpu"], "total": p["total"],
                       "not_costed": p["not_costed"]})
    bars = [("kernels", [("accelerator", acc_k, ACCEL_COLOR), ("CPU", cpu_k, CPU_COLOR)])]
    for ph in phases:
        for metric in ("flops", "bytes"):
            bars.append((f"{ph['name']} {'FLOPs' if metric == 'flops' else 'bytes'}",
                         [("accelerator", ph["acc"][metric] or 0, ACCEL_COLOR), ("CPU", ph["cpu"][metric] or 0, CPU_COLOR)]))
    classes = [{"name": name, **c} for name, c in s["op_classes"].items()]
    class_chart = value_bars_svg([(c["name"], c.get("decode_bytes", 0), fmt_bytes(c.get("decode_bytes", 0)),
                                   ACCEL_COLOR if not c.get("cpu") else CPU_COLOR if not c.get("gpu") else OTHER_COLOR)
                                  for c in classes if c.get("decode_bytes")])
    kernels = []
    for r in cov["kernels"]:
        who = {**r.get("callers", {}), **{f"{k} (kv-cache)": v for k, v in r.get("kv_cache_calls", {}).items()}}
        d, p = r.get("decode_step") or {}, r.get("prefill_chunk") or {}
        kernels.append({"name": r["name"], "op_class": r["op_class"], "placement": r["placement"],
                        "module": r.get("module", "-"), "executed": r.get("executed", ""),
                        "reason": r.get("reason", ""),
                        "rule": r.get("rule", ""), "callers": ", ".join(f"{k}×{v}" for k, v in sorted(who.items())) or "-",
                        "d_calls": d.get("calls", 0), "d_bytes": d.get("bytes"), "d_flops": d.get("flops"),
                        "p_calls": p.get("calls", 0), "p_bytes": p.get("bytes"), "p_flops": p.get("flops")})
    return {"cov": cov, "s": s, "phone": s.get("phone"), "phases": phases, "share_chart": share_bars_svg(bars), "classes": classes,
            "class_chart": class_chart, "kernels": kernels, "mem": _memory_model(memory) if memory else None}


def _memory_model(plan: dict[str, Any]) -> dict[str, Any]:
    by_prec: dict[str, dict[str, int]] = {}
    for g in plan["weights"].values():
        row = by_prec.setdefault(g.get("precision", "?"), {"params": 0, "bytes": 0, "groups": 0})
        row["params"] += g.get("params", 0)
        row["bytes"] += g.get("bytes", 0)
        row["groups"] += 1
    total = plan.get("weights_total", {}).get("bytes") or sum(r["bytes"] for r in by_prec.values())
    precisions = [{"name": k, **v, "pct": _pct(v["bytes"], total)}
                  for k, v in sorted(by_prec.items(), key=lambda kv: -kv[1]["bytes"])]
    state = plan.get("recurrent_state") or {}
    acts = plan.get("activations") or {}
    contexts = list(plan.get("contexts", []))
    # what a session holds at each context: weights, KV, fixed state, activations
    chart_items = []
    for c in contexts:
        chart_items.append((f"ctx {c['context']}", c["total_bytes"], fmt_dec_bytes(c["total_bytes"]),
                            "#5aa36a" if c.get("fits", True) else "#c0392b"))
    weights_chart = value_bars_svg([(p["name"], p["bytes"], fmt_dec_bytes(p["bytes"]), PALETTE[i % len(PALETTE)])
                                    for i, p in enumerate(precisions)])
    return {"plan": plan, "precisions": precisions, "weights_total": plan.get("weights_total", {}),
            "read_per_token": plan.get("weights_read_per_token", {}), "kv": plan.get("kv_cache", {}),
            "state": state, "acts": acts, "contexts": contexts, "phone": plan.get("phone"),
            "weights_chart": weights_chart, "context_chart": value_bars_svg(chart_items),
            "groups": [{"name": k, **v} for k, v in plan["weights"].items()]}


# --------------------------------------------------------------------------------------- template
_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1d2328;background:#f6f7f9}
header{background:#1d2b3a;color:#fff;padding:14px 24px}header h1{margin:0;font-size:20px}header p{margin:4px 0 0;opacity:.85}
main{display:flex;flex-wrap:wrap;gap:20px;padding:20px 24px;align-items:flex-start}
section,aside{background:#fff;border:1px solid #dde2e7;border-radius:6px;padding:12px 18px;box-sizing:border-box}
section.coverage{flex:3 1 720px;min-width:0}aside.memory{flex:1 1 420px;min-width:0}
h2{font-size:16px;margin:18px 0 8px;border-bottom:1px solid #e5e8eb;padding-bottom:4px}h2:first-child{margin-top:4px}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:0}
.card{border:1px solid #dde2e7;border-radius:6px;padding:8px 12px;min-width:130px}
.card dt{font-size:12px;color:#5b6670}.card dd{margin:0;font-size:18px;font-weight:600}
.card dd small{font-size:12px;font-weight:400;color:#5b6670}
table{border-collapse:collapse;font-size:13px;margin:6px 0}th,td{border-bottom:1px solid #e5e8eb;padding:3px 8px;text-align:right}
th{background:#eef1f4;font-weight:600}th:first-child,td:first-child{text-align:left}td.t,th.t{text-align:left}td{white-space:nowrap}
tr.total td{font-weight:700;border-top:2px solid #9aa5b1}
.wide{overflow-x:auto}code{font-size:12px}
.acc{color:#2f6fb0;font-weight:600}.cpu{color:#b8641a;font-weight:600}
.chart{max-width:100%;height:auto;display:block;margin:6px 0}.chart .lbl{font-size:12px;fill:#1d2328}
.chart .in{font-size:11px;fill:#fff}.chart .dark{fill:#5b6670}
.note{color:#5b6670;font-size:12px}
"""

_TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>Kernel coverage: {{ cov.target }} ({{ cov.device }})</title>
<style>{{ css }}</style>
</head>
<body>
<header>
<h1>Kernel coverage: {{ cov.target }} ({{ cov.device }})</h1>
<p>{{ s.kernels }} kernels; decode step at seq_len={{ cov.get("seq_len", 1) }}, prefill chunk of {{ cov.get("prefill_chunk", "?") }} tokens
{%- if cov.get("context_len") is not none %}, KV cache costed at a context of {{ cov.context_len }} tokens{% endif %}.</p>
{%- if cov.get("phase_note") %}
<p class="note">{{ cov.phase_note }}</p>
{%- endif %}
{%- if cov.get("npu_runtime") %}
<p class="note">NPU runtime: {{ cov.npu_runtime }}</p>
{%- endif %}
</header>
<main>
<section class="coverage">
<h2>Summary</h2>
<dl class="cards" id="summary">
<div class="card"><dt>kernels</dt><dd id="kernels">{{ s.kernels }}</dd></div>
<div class="card"><dt>on accelerator</dt><dd class="acc" id="kernels-accelerator">{{ s.kernels_on_accelerator }}</dd></div>
<div class="card"><dt>on CPU</dt><dd class="cpu" id="kernels-cpu">{{ s.kernels_on_cpu }}</dd></div>
{%- if s.get("execution") %}
<div class="card"><dt>executed here</dt><dd id="kernels-executed">{{ s.execution.executed }}</dd></div>
<div class="card"><dt>compiled, not executed</dt><dd id="kernels-not-executed">{{ s.execution.not_executed }}</dd></div>
{%- endif %}
{%- for ph in phases %}
<div class="card"><dt>{{ ph.name }} FLOPs on accelerator</dt><dd>{{ ph.acc.flops_pct }}% <small>{{ num(ph.acc.flops) }}</small></dd></div>
<div class="card"><dt>{{ ph.name }} bytes on accelerator</dt><dd>{{ ph.acc.bytes_pct }}% <small>{{ bytes(ph.acc.bytes) }}</small></dd></div>
{%- endfor %}
</dl>
<table id="shares">
<thead><tr><th>phase</th><th>accelerator FLOPs</th><th>%</th><th>CPU FLOPs</th><th>%</th><th>accelerator bytes</th><th>%</th><th>CPU bytes</th><th>%</th></tr></thead>
<tbody>
{%- for ph in phases %}
<tr><td>{{ ph.name }}</td><td>{{ num(ph.acc.flops) }}</td><td>{{ ph.acc.flops_pct }}%</td><td>{{ num(ph.cpu.flops) }}</td><td>{{ ph.cpu.flops_pct }}%</td><td>{{ bytes(ph.acc.bytes) }}</td><td>{{ ph.acc.bytes_pct }}%</td><td>{{ bytes(ph.cpu.bytes) }}</td><td>{{ ph.cpu.bytes_pct }}%</td></tr>
{%- endfor %}
</tbody>
</table>
{%- if phases[0].not_costed %}
<p class="note">Not costed per decode step (run-time sizes, dispatched by the KV cache): {{ phases[0].not_costed | join(", ") }}</p>
{%- endif %}
{%- if phone %}
<p id="phone">Estimated decode step on {{ phone.name }}: <b>{{ phone.decode_step_ms }} ms</b>
{%- if phone.decode_tok_s_upper_bound %} (at most {{ phone.decode_tok_s_upper_bound }} tok/s){% endif %};
{{ phone.bandwidth_gbs }} GB/s peak, {{ phone.effective_bandwidth_gbs }} GB/s sustained<span class="note"> — {{ phone.note }}</span>.</p>
{%- endif %}
{%- if s.get("execution") %}
<p class="note" id="execution">Executed here: {{ s.execution.executed }} of {{ s.kernels }} kernels ({{ s.execution.how }}); {{ s.execution.not_executed }} compiled, not executed.
{%- if s.execution.mismatched %} <b>MISMATCH vs LLVM: {{ s.execution.mismatched | join(", ") }}</b>{% endif %}</p>
{%- endif %}
{%- if cov.summary.get("crossings") %}
<p class="note" id="crossings">CPU&lt;-&gt;{{ cov.summary.crossings.get("accelerator", "NPU") }} crossings per decoded token: {{ cov.summary.crossings.crossings_per_token }}, moving about {{ bytes(cov.summary.crossings.bytes_moved_per_token) }} per token ({{ cov.summary.crossings.note }}).</p>
{%- endif %}
{%- for m in s.get("splits", []) %}
<p class="note split">{{ m }}</p>
{%- endfor %}
<h2>Placement shares</h2>
{{ share_chart }}
<h2>Op classes</h2>
<div class="wide"><table id="op-classes">
<thead><tr><th>op class</th><th>kernels</th><th>accelerator</th><th>CPU</th><th>decode calls</th><th>decode bytes</th><th>decode FLOPs</th></tr></thead>
<tbody>
{%- for c in classes %}
<tr><td>{{ c.name }}</td><td>{{ c.kernels }}</td><td>{{ c.gpu }}</td><td>{{ c.cpu }}</td><td>{{ c.decode_calls }}</td><td>{{ bytes(c.decode_bytes) }}</td><td>{{ num(c.decode_flops) }}</td></tr>
{%- endfor %}
<tr class="total"><td>Total</td><td>{{ s.op_classes_total.kernels }}</td><td>{{ s.op_classes_total.gpu }}</td><td>{{ s.op_classes_total.cpu }}</td><td>{{ s.op_classes_total.decode_calls }}</td><td>{{ bytes(s.op_classes_total.decode_bytes) }}</td><td>{{ num(s.op_classes_total.decode_flops) }}</td></tr>
</tbody>
</table></div>
<p class="note">Decode bytes per op class (blue: all on the accelerator, orange: all on the CPU, grey: both):</p>
{{ class_chart }}
<h2>Kernels</h2>
<div class="wide"><table id="kernels-table">
<thead><tr><th>kernel</th><th class="t">op class</th><th class="t">module</th><th class="t">placement</th><th class="t">rule</th><th class="t">callers</th><th>decode calls</th><th>decode bytes</th><th>decode FLOPs</th><th>prefill calls</th><th>prefill bytes</th><th>prefill FLOPs</th><th class="t">executed here</th><th class="t">reason</th></tr></thead>
<tbody>
{%- for k in kernels %}
<tr><td><code>{{ k.name }}</code></td><td class="t">{{ k.op_class }}</td><td class="t">{{ k.module }}</td><td class="t {{ 'cpu' if k.placement == 'CPU' else 'acc' }}">{{ k.placement }}</td><td class="t">{{ k.rule }}</td><td class="t">{{ k.callers }}</td><td>{{ k.d_calls }}</td><td>{{ bytes(k.d_bytes) }}</td><td>{{ num(k.d_flops) }}</td><td>{{ k.p_calls }}</td><td>{{ bytes(k.p_bytes) }}</td><td>{{ num(k.p_flops) }}</td><td class="t">{{ k.executed }}</td><td class="t">{{ k.reason }}</td></tr>
{%- endfor %}
</tbody>
</table></div>
</section>
{%- if mem %}
<aside class="memory" id="memory">
<h2>Memory plan: {{ mem.plan.model_type }} {{ mem.plan.quant }}</h2>
<p class="note">Compute {{ mem.plan.compute_dtype }}; {{ mem.plan.layers.total }} layers ({{ mem.plan.layers.full_attention }} full attention, {{ mem.plan.layers.linear_attention }} linear attention). GB = 10^9 bytes.</p>
<h2>Weights by precision</h2>
<table id="weights-by-precision">
<thead><tr><th>precision</th><th>groups</th><th>params</th><th>bytes</th><th>%</th></tr></thead>
<tbody>
{%- for p in mem.precisions %}
<tr><td>{{ p.name }}</td><td>{{ p.groups }}</td><td>{{ num(p.params) }}</td><td>{{ dbytes(p.bytes) }}</td><td>{{ p.pct }}%</td></tr>
{%- endfor %}
<tr class="total"><td>Total</td><td></td><td>{{ num(mem.weights_total.params) }}</td><td>{{ dbytes(mem.weights_total.bytes) }}</td><td>100%</td></tr>
</tbody>
</table>
{{ mem.weights_chart }}
<p>Read per decoded token: {{ dbytes(mem.read_per_token.bytes) }}</p>
<h2>KV cache and totals by context</h2>
<p class="note">KV cache: {{ num(mem.kv.bytes_per_token) }} bytes per token ({{ mem.kv.layers }} layers x 2 x {{ mem.kv.kv_heads }} x {{ mem.kv.head_dim }}, {{ mem.kv.dtype }}).</p>
<table id="contexts">
<thead><tr><th>context</th><th>KV cache</th><th>total RAM</th>{% if mem.phone %}<th>fits</th><th>predicted tok/s</th>{% endif %}</tr></thead>
<tbody>
{%- for c in mem.contexts %}
<tr><td>{{ c.context }}</td><td>{{ dbytes(c.kv_bytes) }}</td><td>{{ dbytes(c.total_bytes) }}</td>{% if mem.phone %}<td>{{ "yes" if c.fits else "no" }}</td><td>{{ "%.2f" | format(c.predicted_decode_tok_s) }}</td>{% endif %}</tr>
{%- endfor %}
</tbody>
</table>
{{ mem.context_chart }}
{%- if mem.phone %}
<p class="note">Phone: {{ mem.phone.name }}, {{ mem.phone.ram_gb }} GB RAM, app budget {{ mem.phone.app_budget_gb }} GB, {{ mem.phone.bandwidth_gbs }} GB/s peak. Decode speeds are predictions ({{ (mem.plan.sustained_bandwidth_share * 100) | round | int }}% of peak bandwidth / bytes per token), not measurements.</p>
{%- endif %}
<h2>Recurrent state and activations</h2>
<table id="state">
<tbody>
<tr><td>recurrent state{% if not mem.state.bytes %} (none: no linear-attention layers){% endif %}</td><td>{{ dbytes(mem.state.bytes or 0) }}</td></tr>
{%- if mem.state.bytes %}
<tr><td>GDN state ({{ mem.state.gdn_dtype }})</td><td>{{ dbytes(mem.state.gdn_bytes) }}</td></tr>
<tr><td>conv state ({{ mem.state.conv_dtype }})</td><td>{{ dbytes(mem.state.conv_bytes) }}</td></tr>
{%- endif %}
<tr><td>activations, prefill chunk of {{ mem.plan.prefill_chunk }}</td><td>{{ dbytes(mem.acts.chunk_bytes) }}</td></tr>
{%- if mem.acts.gdn_workspace_bytes %}
<tr><td>GDN chunk workspace</td><td>{{ dbytes(mem.acts.gdn_workspace_bytes) }}</td></tr>
{%- endif %}
<tr><td>last-token logits (fp32)</td><td>{{ dbytes(mem.acts.logits_bytes) }}</td></tr>
</tbody>
</table>
<h2>Weight groups</h2>
<table id="weight-groups">
<thead><tr><th>group</th><th>params</th><th>bytes</th><th class="t">precision</th></tr></thead>
<tbody>
{%- for g in mem.groups %}
<tr><td>{{ g.name }}</td><td>{{ num(g.params) }}</td><td>{{ dbytes(g.bytes) }}</td><td class="t">{{ g.precision }}</td></tr>
{%- endfor %}
</tbody>
</table>
</aside>
{%- endif %}
</main>
</body>
</html>
"""


def coverage_html(cov: dict[str, Any], memory: dict[str, Any] | None = None) -> str:
    """The page for a coverage report (and optionally its memory plan), as one HTML string."""
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.globals.update(num=fmt_num, bytes=fmt_bytes, dbytes=fmt_dec_bytes)
    return env.from_string(_TEMPLATE).render(css=Markup(_CSS), **_page_model(cov, memory))


def write_coverage_html(reports_dir: str | Path) -> Path:
    """reports/coverage.html from reports/coverage.json (+ memory.json when present); returns its path."""
    reports = Path(reports_dir)
    cov = json.loads((reports / "coverage.json").read_text())
    out = reports / "coverage.html"
    out.write_text(coverage_html(cov, load_memory(reports / "coverage.json")))
    return out
