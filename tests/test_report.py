"""`python -m pipeline report`: one build's summary, the diff of two, one-line errors; reports/coverage.html."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.errors import PipelineError
from pipeline.report.coverage import _summary
from pipeline.report.html import coverage_html, fmt_dec_bytes
from pipeline.report.text import diff, fmt_bytes, fmt_num, load_coverage, summarize

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------- synthetic builds
def _row(name: str, cls: str, placement: str, d_bytes: int | None, d_flops: int | None, calls: int = 1) -> dict:
    costed = d_bytes is not None
    phase = {"calls": calls, "bytes_per_call": d_bytes, "flops_per_call": d_flops, "costed": costed,
             "bytes": d_bytes * calls if costed else None, "flops": d_flops * calls if costed else None}
    return {"name": name, "op_class": cls, "placement": placement, "rule": "gemv", "callers": {"decode": calls},
            "kv_cache_calls": {}, "params": [], "decode_step": phase, "prefill_chunk": dict(phase)}


def _cov(target: str, device: str, rows: list[dict]) -> dict:
    """A coverage report with the summary computed by coverage.py itself."""
    fake_target = SimpleNamespace(name=target, device=device, phone={})
    return {"target": target, "device": device, "seq_len": 1, "prefill_chunk": 256, "context_len": None,
            "kernels": rows, "summary": _summary(rows, fake_target, None)}


A = _cov("phone-gpu", "gpu", [_row("matmul_a", "dequant-gemv", "GPU", 1000, 4000),
                              _row("norm", "rmsnorm", "CPU", 100, 300),
                              _row("old_only", "elementwise", "GPU", 50, 10),
                              _row("attn", "attention", "GPU", None, None)])
B = _cov("phone-npu", "npu", [_row("matmul_a", "dequant-gemv", "CPU", 1000, 4000),
                              _row("norm", "rmsnorm", "NPU", 100, 300),
                              _row("new_only", "rope", "NPU", 400, 20),
                              _row("attn", "attention", "GPU", None, None)])


def _write(tmp_path: Path, name: str, cov: dict) -> Path:
    bundle = tmp_path / name
    (bundle / "reports").mkdir(parents=True)
    (bundle / "reports" / "coverage.json").write_text(json.dumps(cov, indent=1, sort_keys=True))
    return bundle


def report_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", "report", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_diff_moved_only_and_shares():
    d = diff(A, B)
    moved = {m["name"]: m for m in d["moved"]}
    assert set(moved) == {"matmul_a", "norm"}
    assert (moved["matmul_a"]["from"], moved["matmul_a"]["to"], moved["matmul_a"]["direction"]) == ("GPU", "CPU", "to CPU")
    assert (moved["norm"]["from"], moved["norm"]["to"], moved["norm"]["direction"]) == ("CPU", "NPU", "to accelerator")
    assert d["moved_to_cpu"] == 1 and d["moved_to_accelerator"] == 1
    assert [k["name"] for k in d["only_in_a"]] == ["old_only"]
    assert [(k["name"], k["placement"]) for k in d["only_in_b"]] == [("new_only", "NPU")]
    assert d["common_kernels"] == 3 and not d["identical_placement"]
    byte_share = d["accelerator_share"]["decode_step"]["bytes"]
    # A: 1000 + 50 of 1150 bytes on the accelerator; B: 100 + 400 of 1500
    assert byte_share["a_pct"] == round(100 * 1050 / 1150, 2) and byte_share["b_pct"] == round(100 * 500 / 1500, 2)
    assert byte_share["delta_pct"] == round(byte_share["b_pct"] - byte_share["a_pct"], 2)
    assert (byte_share["a_accelerator"], byte_share["b_accelerator"]) == (1050, 500)
    flop_share = d["accelerator_share"]["decode_step"]["flops"]
    assert flop_share["a_pct"] == round(100 * 4010 / 4310, 2) and flop_share["b_pct"] == round(100 * 320 / 4320, 2)
    cls = d["op_classes"]
    assert cls["dequant-gemv"]["gpu"] == {"a": 1, "b": 0, "delta": -1} and cls["dequant-gemv"]["status"] == "changed"
    assert cls["elementwise"]["status"] == "only in A" and cls["rope"]["status"] == "only in B"
    assert cls["rope"]["decode_bytes"] == {"a": 0, "b": 400, "delta": 400}
    assert cls["attention"]["status"] == "same"
    json.dumps(d)


def test_diff_of_a_build_with_itself():
    d = diff(A, A)
    assert d["identical_placement"] and not d["moved"] and not d["only_in_a"] and not d["only_in_b"]
    assert all(r["status"] == "same" for r in d["op_classes"].values())
    assert all(x["delta_pct"] == 0 for p in d["accelerator_share"].values() for x in p.values())


def test_cli_diff_table_and_json(tmp_path):
    a, b = _write(tmp_path, "a", A), _write(tmp_path, "b", B)
    proc = report_cli(a, b / "reports" / "coverage.json")      # a bundle folder or its coverage.json
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "2 moved (1 to the accelerator, 1 to the CPU)" in out
    assert re.search(r"matmul_a\s+dequant-gemv\s+GPU\s+CPU", out)
    assert re.search(r"norm\s+rmsnorm\s+CPU\s+NPU", out)
    assert "Only in A (1)" in out and "old_only" in out and "Only in B (1)" in out and "new_only" in out
    share = diff(A, B)["accelerator_share"]["decode_step"]["bytes"]
    assert f"{share['a_pct']}%" in out and f"{share['b_pct']}%" in out and f"{share['delta_pct']} pts" in out
    proc = report_cli(a, b, "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == json.loads(json.dumps(diff(A, B, str(a), str(b))))


def test_cli_single_summary(tmp_path):
    a = _write(tmp_path, "a", A)
    proc = report_cli(a)
    assert proc.returncode == 0, proc.stderr
    s = A["summary"]
    assert "4 kernels: 1 on CPU, 3 on GPU" in proc.stdout
    assert f"{s['decode_step']['accelerator']['bytes_pct']}%" in proc.stdout
    assert re.search(r"^Total\s+4\s+3\s+1\s", proc.stdout, re.M)
    proc = report_cli(a, "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["decode_step"]["cpu"]["bytes"] == 100


def test_cli_html_for_one_bundle(tmp_path):
    a = _write(tmp_path, "a", A)
    out = tmp_path / "page.html"
    proc = report_cli(a, "--html", out)
    assert proc.returncode == 0, proc.stderr
    check_page(out.read_text(), A, None)
    proc = report_cli(a, "--html", tmp_path / "no" / "such" / "page.html")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "page.html" in proc.stderr


def _not_json(tmp_path: Path) -> tuple[Path, Path]:
    bundle = _write(tmp_path, "corrupt", A)
    js = bundle / "reports" / "coverage.json"
    js.write_text(js.read_text()[:200])
    return bundle, js


def _not_coverage(tmp_path: Path) -> tuple[Path, Path]:
    bundle = _write(tmp_path, "other", A)
    js = bundle / "reports" / "coverage.json"
    js.write_text(json.dumps({"kernels": "yes"}))
    return bundle, js


def _not_bundle(tmp_path: Path) -> tuple[Path, Path]:
    folder = tmp_path / "just-a-folder"
    folder.mkdir()
    return folder, folder


def _missing(tmp_path: Path) -> tuple[Path, Path]:
    return tmp_path / "nope", tmp_path / "nope"


@pytest.mark.parametrize("breaker,words", [(_missing, "no such file"), (_not_bundle, "not a bundle"),
                                           (_not_json, "corrupt JSON"), (_not_coverage, "not a coverage report")])
@pytest.mark.parametrize("position", [0, 1])
def test_cli_errors_one_line_exit_2(tmp_path, breaker, words, position):
    bad, culprit = breaker(tmp_path)
    good = _write(tmp_path, "good", A)
    args = [bad, good] if position == 0 else [good, bad]
    proc = report_cli(*args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    assert str(culprit) in lines[0] and words in lines[0] and "fix:" in lines[0]
    assert proc.stdout == "" and "Traceback" not in proc.stderr


def test_cli_too_many_bundles(tmp_path):
    a = _write(tmp_path, "a", A)
    proc = report_cli(a, a, a)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "one or two" in proc.stderr


def test_load_coverage_accepts_reports_folder(tmp_path):
    a = _write(tmp_path, "a", A)
    assert load_coverage(a / "reports") == load_coverage(a)
    with pytest.raises(PipelineError, match="not a bundle"):
        load_coverage(tmp_path)


# ---------------------------------------------------------------------------------------------- HTML
VOID = {"meta", "br", "img", "hr", "input", "link", "wbr", "col", "source"}


class _Page(HTMLParser):
    """Checks that every element is closed in order; collects visible text and the external references."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.text: list[str] = []
        self.tags: list[tuple[str, dict]] = []
        self.refs: list[str] = []
        self.errors: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        self.refs += [v for k, v in attrs.items() if k in ("src", "href", "xlink:href", "action") and v]
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self.refs += [v for k, v in attrs if k in ("src", "href", "xlink:href") and v]

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:]}")
        else:
            self.stack.pop()

    def handle_data(self, data):
        if self.stack and self.stack[-1] not in ("style", "title"):
            self.text.append(data)


def parse_page(html: str) -> _Page:
    page = _Page()
    page.feed(html)
    page.close()
    assert not page.errors and not page.stack, (page.errors, page.stack)
    return page


def _visible(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def expected_numbers(cov: dict, memory: dict | None) -> list[str]:
    """What the page must show: the summary's counts, FLOPs, bytes and shares; every kernel; the memory plan."""
    s = summarize(cov)
    want = [f"{s['kernels']}", f"{s['kernels_on_accelerator']}", f"{s['kernels_on_cpu']}"]
    for phase in ("decode_step", "prefill_chunk"):
        for side in ("accelerator", "cpu"):
            p = s[phase][side]
            want += [fmt_num(p["flops"]), fmt_bytes(p["bytes"]), f"{p['flops_pct']}%", f"{p['bytes_pct']}%"]
    for c in list(s["op_classes"].values()) + [s["op_classes_total"]]:
        want += [fmt_bytes(c["decode_bytes"]), fmt_num(c["decode_flops"])]
    for r in cov["kernels"]:
        want += [r["name"], fmt_bytes(r["decode_step"]["bytes"]), fmt_num(r["decode_step"]["flops"])]
    if memory:
        want += [fmt_num(memory["weights_total"]["params"]), fmt_dec_bytes(memory["weights_total"]["bytes"])]
        for c in memory["contexts"]:
            want += [str(c["context"]), fmt_dec_bytes(c["kv_bytes"]), fmt_dec_bytes(c["total_bytes"])]
            if "predicted_decode_tok_s" in c:
                want.append(f"{c['predicted_decode_tok_s']:.2f}")
        want.append(fmt_dec_bytes(memory["recurrent_state"]["bytes"]))
    return want


def check_page(html: str, cov: dict, memory: dict | None) -> _Page:
    page = parse_page(html)
    assert page.refs == [], page.refs                      # no links, no external assets
    assert "<script" not in html and "@import" not in html and "url(" not in html and "http" not in html
    text = _visible(" ".join(page.text))
    missing = [w for w in expected_numbers(cov, memory) if w not in text]
    assert not missing, missing
    assert sum(1 for tag, _ in page.tags if tag == "svg") >= 2
    return page


def test_html_synthetic_numbers_and_rows():
    html = coverage_html(A)
    page = check_page(html, A, None)
    assert 'id="memory"' not in html
    assert "Total" in " ".join(page.text)
    assert any(t == "rect" for t, _ in page.tags)
    # one kernel row per kernel, one op-class row per class + Total
    rows = html.split('id="kernels-table"')[1].split("</table>")[0].count("<tr>")
    assert rows == 1 + len(A["kernels"])
    rows = html.split('id="op-classes"')[1].split("</table>")[0].count("<tr")
    assert rows == 1 + len(A["summary"]["op_classes"]) + 1


def test_html_escapes_names():
    cov = _cov("t<x>", "gpu", [_row("k<script>alert(1)</script>", "gemv", "GPU", 10, 20)])
    html = coverage_html(cov)
    assert "<script" not in html and "&lt;script&gt;" in html
    parse_page(html)


@pytest.fixture(scope="module")
def adreno_bundle(build_bundle) -> Path:
    return build_bundle("smollm2-135m", "android-adreno", "q4f16")


@pytest.fixture(scope="module")
def cpu_bundle(build_bundle) -> Path:
    return build_bundle("smollm2-135m", "android-cpu", "q4f16")


def test_bundle_has_coverage_html_with_memory_plan(adreno_bundle):
    reports = adreno_bundle / "reports"
    cov = json.loads((reports / "coverage.json").read_text())
    memory = json.loads((reports / "memory.json").read_text())
    html = (reports / "coverage.html").read_text()
    check_page(html, cov, memory)
    assert 'id="memory"' in html and "q4 g32 + fp16 scale" in html and "Snapdragon" in html
    manifest = json.loads((adreno_bundle / "manifest.json").read_text())
    assert "reports/coverage.html" in {f["path"] for f in manifest["files"]}


def test_diff_real_builds_gpu_vs_cpu(adreno_bundle, cpu_bundle):
    proc = report_cli(adreno_bundle, cpu_bundle, "--json")
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert d["a"]["target"] == "android-adreno" and d["b"]["target"] == "android-cpu"
    assert d["moved"] and all((m["from"], m["to"]) == ("GPU", "CPU") for m in d["moved"])
    assert len(d["moved"]) == d["common_kernels"] == d["moved_to_cpu"]
    for phase in ("decode_step", "prefill_chunk"):
        for metric in ("flops", "bytes"):
            assert d["accelerator_share"][phase][metric]["a_pct"] == 100.0
            assert d["accelerator_share"][phase][metric]["b_pct"] == 0.0
            assert d["accelerator_share"][phase][metric]["delta_pct"] == -100.0
    # the norms differ by name (GPU targets: our rms_norm_split / fused_add_rms_norm); the embedding gather is common
    assert "dequantize_embedding" in {m["name"] for m in d["moved"]}
    proc = report_cli(adreno_bundle, cpu_bundle)
    assert proc.returncode == 0 and "to the CPU" in proc.stdout and "-100.0 pts" in proc.stdout


# ------------------------------------------------------------------------------------ headless Chromium
CHROMIUM_NAMES = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome", "google-chrome-stable",
                  "headless_shell")


def chromium() -> str | None:
    return next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)


def render_dom(html_path: Path) -> str:
    exe = chromium()
    if exe is None:
        pytest.skip("no Chromium binary on PATH (" + ", ".join(CHROMIUM_NAMES) + "); `make system-deps` "
                    "installs chromium-headless-shell with apt as root")
    proc = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           "--disable-extensions", "--dump-dom", html_path.resolve().as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_chromium_renders_coverage_html(adreno_bundle, tmp_path):
    reports = adreno_bundle / "reports"
    cov = json.loads((reports / "coverage.json").read_text())
    memory = json.loads((reports / "memory.json").read_text())
    dom = render_dom(reports / "coverage.html")
    assert "<title>Kernel coverage: android-adreno (gpu)</title>" in dom
    # Chromium's own parse keeps every row and chart where the page put them (a malformed table would not)
    body = dom.split('id="kernels-table"')[1].split("</table>")[0]
    assert body.count("<tr>") == 1 + len(cov["kernels"])
    assert dom.count("<svg") >= 4 and 'id="memory"' in dom
    text = re.sub(r"<style>.*?</style>", " ", dom, flags=re.S)
    text = _visible(re.sub(r"<[^>]+>", " ", text)).replace("&amp;", "&")
    missing = [w for w in expected_numbers(cov, memory) if w not in text]
    assert not missing, missing
