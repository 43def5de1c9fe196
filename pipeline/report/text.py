"""`python -m pipeline report A [B]`: one build's coverage summary, or what changed between two builds.

A and B are bundle folders (dist/<model>-<quant>-<target>/, whose reports/coverage.json is read) or
coverage.json files. The diff matches kernels by name and lists the ones that moved between the CPU
and the accelerator (GPU or NPU), the ones only one build has, the change in the accelerator's share of
FLOPs and bytes per decode step and prefill chunk, and the per-op-class changes. `--json` prints the same
as one JSON object.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError
from pipeline.op_classes import OP_CLASSES

PHASES = ("decode_step", "prefill_chunk")
CLASS_KEYS = ("kernels", "gpu", "cpu", "decode_calls", "decode_bytes", "decode_flops")
_FIX_PATH = "give a bundle folder (dist/<model>-<quant>-<target>) or its reports/coverage.json"
_FIX_REBUILD = "rebuild the bundle (python -m pipeline build ...) to rewrite it"


# ------------------------------------------------------------------------------------------ loading
def coverage_path(path: str | Path) -> Path:
    """The coverage.json of a bundle folder, a reports/ folder or a file; a one-line error otherwise."""
    p = Path(path)
    if not p.exists():
        raise PipelineError("no such file or folder", path=p, fix=_FIX_PATH)
    if p.is_file():
        return p
    for candidate in (p / "reports" / "coverage.json", p / "coverage.json"):
        if candidate.is_file():
            return candidate
    raise PipelineError("not a bundle: it has no reports/coverage.json", path=p,
                        fix=f"{_FIX_PATH}; bundles are written by python -m pipeline build")


def load_coverage(path: str | Path) -> dict[str, Any]:
    """A coverage report read from a bundle or a coverage.json, checked for the fields the report uses."""
    js = coverage_path(path)
    try:
        data = json.loads(js.read_text())
    except UnicodeDecodeError:
        raise PipelineError("not a coverage.json (not text)", path=js, fix=_FIX_REBUILD) from None
    except json.JSONDecodeError as err:
        raise PipelineError(f"corrupt JSON (line {err.lineno}, column {err.colno}: {err.msg})", path=js,
                            fix=_FIX_REBUILD) from None
    except OSError as err:
        raise PipelineError(f"cannot read it ({err.strerror})", path=js, fix=_FIX_PATH) from None
    problem = _shape_problem(data)
    if problem:
        raise PipelineError(f"not a coverage report ({problem})", path=js, fix=_FIX_REBUILD)
    return data


def _shape_problem(data: Any) -> str | None:
    if not isinstance(data, dict):
        return "top level is not an object"
    if not isinstance(data.get("kernels"), list):
        return "no 'kernels' list"
    if not isinstance(data.get("summary"), dict):
        return "no 'summary' object"
    for row in data["kernels"]:
        if not isinstance(row, dict) or not {"name", "op_class", "placement"} <= row.keys():
            return "a kernel row lacks name / op_class / placement"
    for phase in PHASES:
        p = data["summary"].get(phase)
        if not isinstance(p, dict) or not {"accelerator", "cpu", "total"} <= p.keys():
            return f"summary has no '{phase}' shares"
    if not isinstance(data["summary"].get("op_classes"), dict):
        return "summary has no 'op_classes'"
    return None


def load_memory(path: str | Path) -> dict[str, Any] | None:
    """The memory plan beside a coverage.json (reports/memory.json), or None when there is none / it is unreadable."""
    mem = coverage_path(path).parent / "memory.json"
    try:
        data = json.loads(mem.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and "weights" in data and "contexts" in data else None


# --------------------------------------------------------------------------------------- summaries
def is_accelerator(placement: str) -> bool:
    return placement != "CPU"


def summarize(cov: dict[str, Any], source: str = "") -> dict[str, Any]:
    """The numbers `report A` prints: counts by placement, accelerator/CPU shares, per-op-class rows."""
    s = cov["summary"]
    placements: dict[str, int] = {}
    for row in cov["kernels"]:
        placements[row["placement"]] = placements.get(row["placement"], 0) + 1
    out: dict[str, Any] = {
        "source": source, "target": cov.get("target"), "device": cov.get("device"),
        "kernels": len(cov["kernels"]), "placements": dict(sorted(placements.items())),
        "kernels_on_accelerator": sum(n for p, n in placements.items() if is_accelerator(p)),
        "kernels_on_cpu": placements.get("CPU", 0),
    }
    for phase in PHASES:
        p = s[phase]
        out[phase] = {side: {k: p[side].get(k) for k in ("flops", "bytes", "flops_pct", "bytes_pct")}
                      for side in ("accelerator", "cpu")}
        out[phase]["total"] = dict(p["total"])
        out[phase]["not_costed"] = list(p.get("not_costed", []))
    out["op_classes"] = s["op_classes"]
    out["op_classes_total"] = s.get("op_classes_total") or {
        k: sum(c.get(k, 0) for c in s["op_classes"].values()) for k in CLASS_KEYS}
    if "phone" in s:
        out["phone"] = s["phone"]
    if "execution" in s:
        out["execution"] = s["execution"]
    out["splits"] = [sp.get("message", "") for sp in cov.get("splits") or []]
    return out


def diff(a: dict[str, Any], b: dict[str, Any], a_name: str = "A", b_name: str = "B") -> dict[str, Any]:
    """What changed from build A to build B (kernels matched by name)."""
    ka = {r["name"]: r for r in a["kernels"]}
    kb = {r["name"]: r for r in b["kernels"]}
    moved = []
    for name in sorted(ka.keys() & kb.keys()):
        pa, pb = ka[name]["placement"], kb[name]["placement"]
        if pa != pb:
            direction = ("to accelerator" if is_accelerator(pb) and not is_accelerator(pa) else
                         "to CPU" if is_accelerator(pa) and not is_accelerator(pb) else "between accelerators")
            moved.append({"name": name, "op_class": kb[name]["op_class"], "from": pa, "to": pb,
                          "direction": direction, "decode_bytes": _phase(kb[name], "decode_step", "bytes"),
                          "decode_flops": _phase(kb[name], "decode_step", "flops")})

    def only(rows: dict, other: dict) -> list[dict[str, Any]]:
        return [{"name": n, "op_class": rows[n]["op_class"], "placement": rows[n]["placement"],
                 "decode_bytes": _phase(rows[n], "decode_step", "bytes"),
                 "decode_flops": _phase(rows[n], "decode_step", "flops")}
                for n in sorted(rows.keys() - other.keys())]

    sa, sb = a["summary"], b["summary"]
    shares = {}
    for phase in PHASES:
        shares[phase] = {}
        for metric in ("flops", "bytes"):
            va = sa[phase]["accelerator"].get(f"{metric}_pct", 0.0)
            vb = sb[phase]["accelerator"].get(f"{metric}_pct", 0.0)
            shares[phase][metric] = {
                "a_pct": va, "b_pct": vb, "delta_pct": round(vb - va, 2),
                "a_accelerator": sa[phase]["accelerator"].get(metric, 0),
                "b_accelerator": sb[phase]["accelerator"].get(metric, 0),
                "a_total": sa[phase]["total"].get(metric, 0), "b_total": sb[phase]["total"].get(metric, 0)}
    classes = {}
    ca, cb = sa["op_classes"], sb["op_classes"]
    for cls in _class_order(ca, cb):
        ra, rb = ca.get(cls, {}), cb.get(cls, {})
        row = {k: {"a": ra.get(k, 0), "b": rb.get(k, 0), "delta": rb.get(k, 0) - ra.get(k, 0)} for k in CLASS_KEYS}
        row["status"] = ("only in A" if cls not in cb else "only in B" if cls not in ca else
                         "changed" if any(v["delta"] for v in row.values()) else "same")
        classes[cls] = row
    return {
        "a": {"source": a_name, "target": a.get("target"), "device": a.get("device"), "kernels": len(ka)},
        "b": {"source": b_name, "target": b.get("target"), "device": b.get("device"), "kernels": len(kb)},
        "common_kernels": len(ka.keys() & kb.keys()),
        "moved": moved,
        "moved_to_accelerator": sum(1 for m in moved if m["direction"] == "to accelerator"),
        "moved_to_cpu": sum(1 for m in moved if m["direction"] == "to CPU"),
        "only_in_a": only(ka, kb), "only_in_b": only(kb, ka),
        "accelerator_share": shares, "op_classes": classes,
        "identical_placement": not moved and ka.keys() == kb.keys(),
    }


def _phase(row: dict[str, Any], phase: str, key: str) -> int | None:
    return (row.get(phase) or {}).get(key)


def _class_order(*maps: dict[str, Any]) -> list[str]:
    names = set().union(*maps)
    return sorted(names, key=lambda c: (OP_CLASSES.index(c) if c in OP_CLASSES else len(OP_CLASSES), c))


# ------------------------------------------------------------------------------------------- text
def fmt_bytes(n: float | None) -> str:
    """Binary units, as coverage.md writes them."""
    if n is None:
        return "n/a"
    sign, n = ("-" if n < 0 else ""), abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    return f"{sign}{n}"


def fmt_num(n: float | None) -> str:
    return "n/a" if n is None else f"{n:,}"


def _signed(n: float, fmt=fmt_num) -> str:
    return "0" if n == 0 else (f"+{fmt(n)}" if n > 0 else fmt(n))


def table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    """A plain text table: first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))

    return [line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]]


def _share_rows(s: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for phase in PHASES:
        acc, cpu = s[phase]["accelerator"], s[phase]["cpu"]
        rows.append([f"{phase} FLOPs", fmt_num(acc["flops"]), f"{acc['flops_pct']}%", fmt_num(cpu["flops"]),
                     f"{cpu['flops_pct']}%"])
        rows.append([f"{phase} bytes", fmt_bytes(acc["bytes"]), f"{acc['bytes_pct']}%", fmt_bytes(cpu["bytes"]),
                     f"{cpu['bytes_pct']}%"])
    return rows


def summary_text(summary: dict[str, Any]) -> str:
    s = summary
    where = ", ".join(f"{n} on {p}" for p, n in s["placements"].items()) or "none"
    out = [f"Coverage of {s['source'] or 'the build'}: target {s['target']} ({s['device']})",
           f"{s['kernels']} kernels: {where}", ""]
    out += table(["per phase", "accelerator", "%", "CPU", "%"], _share_rows(s))
    not_costed = s["decode_step"]["not_costed"]
    if not_costed:
        out += ["", "not costed per decode step (run-time sizes): " + ", ".join(not_costed)]
    if "phone" in s:
        ph = s["phone"]
        out += ["", f"estimated decode step on {ph.get('name')}: {ph.get('decode_step_ms')} ms "
                f"({ph.get('note', '')})"]
    if "execution" in s:
        e = s["execution"]
        out += ["", f"executed here: {e['executed']} kernels ({e['how']}); compiled, not executed: "
                f"{e['not_executed']}" + (f"; MISMATCH: {', '.join(e['mismatched'])}" if e["mismatched"] else "")]
    out += [f"{m}" for m in s.get("splits", [])]
    out += [""]
    rows = [[cls, c.get("kernels", 0), c.get("gpu", 0), c.get("cpu", 0), c.get("decode_calls", 0),
             fmt_bytes(c.get("decode_bytes", 0)), fmt_num(c.get("decode_flops", 0))]
            for cls, c in list(s["op_classes"].items()) + [("Total", s["op_classes_total"])]]
    out += table(["op class", "kernels", "accel", "CPU", "decode calls", "decode bytes", "decode FLOPs"], rows)
    return "\n".join(out) + "\n"


def diff_text(d: dict[str, Any]) -> str:
    a, b = d["a"], d["b"]
    out = [f"A: {a['source']} — {a['target']} ({a['device']}), {a['kernels']} kernels",
           f"B: {b['source']} — {b['target']} ({b['device']}), {b['kernels']} kernels",
           f"{d['common_kernels']} kernels in both; {len(d['moved'])} moved "
           f"({d['moved_to_accelerator']} to the accelerator, {d['moved_to_cpu']} to the CPU); "
           f"{len(d['only_in_a'])} only in A; {len(d['only_in_b'])} only in B", ""]
    out += ["Accelerator share (A -> B)"]
    rows = []
    for phase in PHASES:
        for metric in ("flops", "bytes"):
            x = d["accelerator_share"][phase][metric]
            fmt = fmt_num if metric == "flops" else fmt_bytes
            rows.append([f"{phase} {metric}", f"{x['a_pct']}%", f"{x['b_pct']}%", _signed(x["delta_pct"], str) + " pts",
                         fmt(x["a_accelerator"]), fmt(x["b_accelerator"])])
    out += table(["phase", "A", "B", "change", "A on accel", "B on accel"], rows)
    if d["moved"]:
        out += ["", f"Moved ({len(d['moved'])})"]
        out += table(["kernel", "op class", "from", "to", "decode bytes", "decode FLOPs"],
                     [[m["name"], m["op_class"], m["from"], m["to"], fmt_bytes(m["decode_bytes"]),
                       fmt_num(m["decode_flops"])] for m in d["moved"]])
    for key, label in (("only_in_a", "Only in A"), ("only_in_b", "Only in B")):
        if d[key]:
            out += ["", f"{label} ({len(d[key])})"]
            out += table(["kernel", "op class", "placement", "decode bytes", "decode FLOPs"],
                         [[k["name"], k["op_class"], k["placement"], fmt_bytes(k["decode_bytes"]),
                           fmt_num(k["decode_flops"])] for k in d[key]])
    changed = {c: r for c, r in d["op_classes"].items() if r["status"] != "same"}
    out += ["", "Op classes" + ("" if changed else ": no change")]
    if changed:
        rows = []
        for cls, r in changed.items():
            rows.append([cls, f"{r['kernels']['a']} -> {r['kernels']['b']}", f"{r['gpu']['a']} -> {r['gpu']['b']}",
                         f"{r['cpu']['a']} -> {r['cpu']['b']}", _signed(r["decode_bytes"]["delta"], fmt_bytes),
                         _signed(r["decode_flops"]["delta"]), r["status"]])
        out += table(["op class", "kernels", "accel", "CPU", "decode bytes", "decode FLOPs", ""], rows)
    if d["identical_placement"]:
        out += ["", "Same kernels, same placement."]
    return "\n".join(out) + "\n"


# -------------------------------------------------------------------------------------------- CLI
