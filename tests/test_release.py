"""Release files, the CI workflow, and byte-reproducible release packaging (pipeline/commands/release.py)."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from pipeline.commands.release import (
    LIBRARY_SYMBOL,
    Built,
    load_release,
    make_release,
    matrix_json,
    package,
    write_tarball,
)
from pipeline.errors import CompileError, ConfigError, PipelineError

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"
URL = "https://huggingface.co/org/{model_id}-{target}"
GOOD = {"models": ["smollm2-135m"], "quantizations": ["q4f16"], "targets": ["host-cpu", "android-cpu"], "model_url": URL}


def _write(tmp_path: Path, data: dict, name: str = "rel.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def _clang() -> str | None:
    return next((t for t in ("/usr/lib/llvm-15/bin/clang", shutil.which("clang")) if t and os.path.exists(t)), None)


def _nm() -> str | None:
    return next((t for t in ("/usr/lib/llvm-15/bin/llvm-nm", shutil.which("llvm-nm")) if t and os.path.exists(t)),
                None)


# ------------------------------------------------------------------------------------ release files
def test_default_release_file():
    spec = load_release("default")
    assert spec.models == ("smollm2-135m",)
    assert set(spec.targets) == {"host-cpu", "android-adreno", "android-cpu"}
    assert set(spec.quantizations) == {"q4f16", "q0f16"}
    assert len(spec.entries()) == 6 and len(set(spec.entries())) == 6
    # the release turns PoCL verification off only where a target would run it by default
    assert spec.verify_for("android-adreno") is False
    assert spec.verify_for("host-cpu") is None and spec.verify_for("android-cpu") is None
    assert "{model_id}" in spec.model_url and "{target}" in spec.model_url        # explicit, per model and target


def test_release_file_by_path(tmp_path):
    spec = load_release(_write(tmp_path, {**GOOD, "verify": True, "model_url": "https://x/{target}/{model_id}"}))
    assert spec.name == "rel" and spec.verify is True and spec.model_url == "https://x/{target}/{model_id}"
    assert spec.entries() == [("smollm2-135m", "q4f16", "host-cpu"), ("smollm2-135m", "q4f16", "android-cpu")]


@pytest.mark.parametrize("change, words", [
    ({"models": ["no-such-model"]}, ["unknown model 'no-such-model'", "smollm2-135m"]),
    ({"targets": ["host-cpu", "pdp-11"]}, ["unknown target 'pdp-11'", "android-adreno"]),
    ({"quantizations": ["q3f7"]}, ["unknown quantization 'q3f7'", "q4f16"]),
    ({"targets": ["android-vulkan"]}, ["SPIR-V"]),
    ({"models": []}, ["models must be a non-empty list"]),
    ({"quantizations": "q4f16"}, ["quantizations must be a non-empty list"]),
    ({"targets": ["host-cpu", "host-cpu"]}, ["targets lists host-cpu more than once"]),
    ({"verify": "yes"}, ["verify must be true or false"]),
    ({"model_url": "https://x/models/{target}"}, ["does not contain {model_id}"]),
    ({"model_url": None}, ["no model_url", "android-cpu", "resolve/main", "add model_url: https://"]),
    ({"model_url": "https://x/{model_id}"}, ["has no {target}", "host-cpu, android-cpu"]),
    ({"model_url": "https://x/{model_id}-{quant}-{target}"}, ["unknown field(s) {quant}"]),
    ({"model_url": "https://x/{model_id}-{target"}, ["not a valid template"]),
    ({"model_url": "s3://x/{model_id}-{target}"}, ["not an http(s) address"]),
    ({"model_url": "https://x/{model_id}-{target}/resolve/main"}, ["ends in resolve/main"]),
    ({"name": "a/b"}, ["not a plain file name"]),
    ({"platforms": ["android"]}, ["unknown key(s) platforms", "use only:"]),
])
def test_release_file_errors(tmp_path, change, words):
    path = _write(tmp_path, {**GOOD, **change})
    with pytest.raises(ConfigError) as err:
        load_release(path)
    text = str(err.value)
    assert "\n" not in text and str(path) in text and "fix:" in text
    for word in words:
        assert word in text


def test_model_url_is_optional_without_android(tmp_path):
    """Only MLCChat on Android downloads weights; a host-cpu (or iOS, bundled) release needs no model_url."""
    spec = load_release(_write(tmp_path, {**{k: v for k, v in GOOD.items() if k != "model_url"},
                                          "targets": ["host-cpu"]}))
    assert spec.model_url is None
    one = load_release(_write(tmp_path, {**GOOD, "targets": ["android-cpu"], "model_url": "https://x/{model_id}"}))
    assert one.model_url == "https://x/{model_id}"          # one target: {target} is not needed


def test_missing_release_file_lists_known_ones():
    with pytest.raises(ConfigError, match=r"no release file 'nope'.*default"):
        load_release("nope")


def test_cli_release_error_is_one_line(tmp_path):
    path = _write(tmp_path, {**GOOD, "targets": ["pdp-11"]})
    proc = subprocess.run([sys.executable, "-m", "pipeline", "release", str(path)], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "unknown target 'pdp-11'" in proc.stderr
    assert not (tmp_path / "dist").exists()


def test_matrix_is_one_job_per_model_and_target():
    jobs = matrix_json(load_release("default"))["include"]
    assert [(j["model"], j["target"]) for j in jobs] == [("smollm2-135m", t) for t in
                                                         ("host-cpu", "android-adreno", "android-cpu")]
    assert all(j["quants"].split() == ["q4f16", "q0f16"] for j in jobs)
    assert {j["target"]: j["verify"] for j in jobs} == {"host-cpu": "", "android-adreno": "0", "android-cpu": ""}


# ---------------------------------------------------------------------------------------- workflow
def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", text, flags=re.M))


def test_workflow_is_valid_and_uses_existing_make_targets():
    wf = yaml.safe_load(WORKFLOW.read_text())
    assert set(wf["jobs"]) == {"plan", "build", "publish"}
    assert True in wf or "on" in wf          # PyYAML reads the bare key `on` as True
    runs = [step["run"] for job in wf["jobs"].values() for step in job["steps"] if "run" in step]
    invoked = {m for run in runs for m in re.findall(r"\bmake\s+(?:-\S+\s+)*([A-Za-z][\w.-]*)", run)}
    assert {"release-matrix", "build", "release"} <= invoked
    assert invoked <= _make_targets(), f"workflow calls missing make targets: {invoked - _make_targets()}"
    assert wf["jobs"]["build"]["strategy"]["matrix"] == "${{ fromJSON(needs.plan.outputs.matrix) }}"


# ------------------------------------------------------------------------------------- packaging
def test_tarball_is_reproducible(tmp_path):
    src = tmp_path / "src"
    (src / "b").mkdir(parents=True)
    (src / "b" / "x.bin").write_bytes(b"\x00\x01" * 1000)
    (src / "a.txt").write_text("hello")
    (src / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(src / "run.sh", 0o775)
    write_tarball(src, tmp_path / "1.tar.gz", "root", 1234, extra={"release.json": b"{}"})
    os.utime(src / "a.txt", (5, 5))
    os.chmod(src / "a.txt", 0o600)
    write_tarball(src, tmp_path / "2.tar.gz", "root", 1234, extra={"release.json": b"{}"})
    one, two = (tmp_path / "1.tar.gz").read_bytes(), (tmp_path / "2.tar.gz").read_bytes()
    assert one == two
    assert one[4:8] == b"\0\0\0\0" and not one[3] & 0x08      # gzip: mtime 0, no file name
    with tarfile.open(tmp_path / "1.tar.gz") as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == ["root", "root/a.txt", "root/b", "root/b/x.bin", "root/release.json",
                                         "root/run.sh"]
    assert all(m.mtime == 1234 and m.uid == m.gid == 0 and m.uname == m.gname == "" for m in members)
    assert {m.name: oct(m.mode) for m in members if m.isfile()} == {
        "root/a.txt": "0o644", "root/b/x.bin": "0o644", "root/release.json": "0o644", "root/run.sh": "0o755"}


TRIPLES = {"android-cpu": "aarch64-linux-android", "ios-metal": "arm64-apple-ios"}


def _fake_bundle(tmp_path: Path, name: str, prefix: str, clang: str, target: str = "android-cpu") -> Path:
    """A bundle as emit() writes it, with a .tar holding a real object (ELF or Mach-O) that defines the
    prefix's symbols."""
    bundle = tmp_path / "dist" / f"{name}-q4f16-{target}"
    (bundle / "lib").mkdir(parents=True)
    (bundle / "reports").mkdir()
    src = tmp_path / f"{prefix}.c"
    src.write_text(f"const char {LIBRARY_SYMBOL.format(prefix=prefix)}[4] = \"abc\";\n"
                   f"int __tvm_ffi_{prefix}add(void) {{ return 1; }}\n")
    obj = tmp_path / "lib0.o"
    subprocess.run([clang, f"--target={TRIPLES[target]}", "-c", str(src), "-o", str(obj)], check=True)
    with tarfile.open(bundle / "lib" / f"{prefix}model.tar", "w") as tar:
        tar.add(obj, arcname="lib0.o")
    files = {"tensor-cache.json": "{}", "params_shard_0.bin": "0123", "tokenizer.json": "{}",
             "mlc-chat-config.json": json.dumps({"context_window_size": 16, "model_lib": "lib/x.tar"}),
             "reports/kernels.json": json.dumps({"library": f"{prefix}model.tar", "system_lib_prefix": prefix,
                                                 "key": "k-" + prefix}),
             "reports/coverage.json": "{}",
             "reports/memory.json": json.dumps({"weights_total": {"bytes": 1000}, "kv_cache": {"bytes_per_token": 10},
                                                "recurrent_state": {"bytes": 7}, "activations": {"bytes": 3}})}
    for rel, text in files.items():
        (bundle / rel).write_text(text)
    listed = [{"path": rel} for rel in sorted([*files, f"lib/{prefix}model.tar"])]
    (bundle / "manifest.json").write_text(json.dumps({"build_key": "b-" + prefix, "files": listed}))
    return bundle


@pytest.mark.parametrize("target, static", [("android-cpu", "libmodel_android.a"), ("ios-metal", "libmodel_iphone.a")])
def test_static_library_merge_is_reproducible(tmp_path, target, static):
    """Two models' objects in one static library (GNU ar for Android, Darwin ar for iOS), twice,
    byte-identical; app config, weights folder and symbols checked."""
    import dataclasses

    clang = _clang()
    if clang is None or _nm() is None:
        pytest.skip("clang / llvm-nm not installed (apt-get install clang llvm)")
    spec = load_release(_write(tmp_path, {**GOOD, "targets": [target]}))
    spec = dataclasses.replace(spec, models=("m1", "m2"))
    built = [Built(m, "q4f16", target, _fake_bundle(tmp_path, m, f"{m}_q4f16_", clang, target)) for m in spec.models]
    sums = []
    for run in ("a", "b"):
        out = tmp_path / run
        out.mkdir()
        package(spec, built, out)
        sums.append((out / "SHA256SUMS").read_text())
    assert sums[0] == sums[1]
    out = tmp_path / "a"
    lib = out / target / "lib" / static
    symbols = subprocess.run([_nm(), "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    for m in spec.models:
        assert re.search(rf" _?{LIBRARY_SYMBOL.format(prefix=f'{m}_q4f16_')}$", symbols, flags=re.M)
    app = json.loads((out / target / "mlc-app-config.json").read_text())
    assert app == {"model_list": [
        {"model_id": f"{m}-q4f16", "model_lib": f"{m}_q4f16", "model_path": f"{m}-q4f16",
         "model_url": f"https://huggingface.co/org/{m}-q4f16-{target}",
         "estimated_vram_bytes": 1000 + 10 * 16 + 7 + 3} for m in spec.models]}
    weights = out / target / "m1-q4f16"
    assert sorted(p.name for p in weights.iterdir()) == ["mlc-chat-config.json", "params_shard_0.bin",
                                                         "tensor-cache.json", "tokenizer.json"]
    assert json.loads((weights / "mlc-chat-config.json").read_text())["model_lib"] == "m1_q4f16"
    _check_sums(out)


def test_shared_prefix_is_refused(tmp_path):
    import dataclasses

    clang = _clang()
    if clang is None or _nm() is None:
        pytest.skip("clang / llvm-nm not installed (apt-get install clang llvm)")
    spec = load_release(_write(tmp_path, {**GOOD, "targets": ["android-cpu"]}))
    spec = dataclasses.replace(spec, models=("m1", "m2"))
    built = [Built(m, "q4f16", "android-cpu", _fake_bundle(tmp_path, m, "llama_q4f16_", clang)) for m in spec.models]
    (tmp_path / "out").mkdir()
    with pytest.raises(PipelineError, match="share the system-lib prefix 'llama_q4f16_'"):
        package(spec, built, tmp_path / "out")


def test_model_lib_is_the_prefix_without_its_underscore():
    from pipeline.commands.release import model_lib

    assert model_lib("smollm2_135m_q4f16_") == "smollm2_135m_q4f16"
    assert model_lib("m_1b_q4f16_0_") == "m_1b_q4f16_0"                     # only the one trailing '_'
    with pytest.raises(CompileError, match="does not end in '_'"):
        model_lib("llama_q4f16")


def test_same_model_twice_is_refused(tmp_path):
    spec = load_release(_write(tmp_path, {**GOOD, "targets": ["android-cpu"]}))
    built = [Built("m", "q4f16", "android-cpu", tmp_path / f"b{i}") for i in range(2)]
    (tmp_path / "out").mkdir()
    with pytest.raises(ConfigError, match="m-q4f16 would be packaged twice for android-cpu"):
        package(spec, built, tmp_path / "out")


def test_out_folder_is_never_a_foreign_one(tmp_path):
    from pipeline.commands.release import _check_out

    (tmp_path / "dist" / "b").mkdir(parents=True)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="would replace the bundles"):
        _check_out(tmp_path / "dist", tmp_path / "dist")
    with pytest.raises(ConfigError, match="would replace the bundles"):
        _check_out(tmp_path, tmp_path / "dist")
    with pytest.raises(ConfigError, match="not a release folder"):
        _check_out(tmp_path / "mine", tmp_path / "dist")
    _check_out(tmp_path / "new", tmp_path / "dist")               # new, or a previous release: fine
    (tmp_path / "mine" / "release.json").write_text("{}")
    _check_out(tmp_path / "mine", tmp_path / "dist")


def _check_sums(out: Path) -> None:
    """SHA256SUMS lists every file of the release with its digest (what `sha256sum -c` checks)."""
    lines = (out / "SHA256SUMS").read_text().splitlines()
    listed = {line.split("  ", 1)[1]: line.split("  ", 1)[0] for line in lines}
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() and p.name != "SHA256SUMS")
    assert sorted(listed) == files
    for rel, digest in listed.items():
        assert hashlib.sha256((out / rel).read_bytes()).hexdigest() == digest, rel


# --------------------------------------------------------------------------- the default model, twice
@pytest.mark.parametrize("targets", [
    pytest.param(["android-cpu"], marks=pytest.mark.slow),                # ~45-52 s alone
    pytest.param(["host-cpu", "android-cpu"], marks=pytest.mark.slow),    # ~90 s alone
])
def test_release_of_default_model_is_reproducible(tmp_path, dist_dir, targets):
    """smollm2-135m x targets x q4f16 built and packaged twice: identical SHA256SUMS, the merged .a holds
    the model's system-lib symbol, the tarballs hold the tree. Bundles go to the session's dist, so builds
    other tests made of the same combination are reused."""
    nm = _nm()
    if nm is None:
        pytest.skip("llvm-nm not installed (apt-get install llvm)")
    spec = load_release(_write(tmp_path, {**GOOD, "targets": targets}, "small.yaml"))
    from pipeline.progress import Reporter

    outs = [make_release(spec, out=tmp_path / run, dist=dist_dir, report=Reporter(quiet=True)) for run in ("a", "b")]
    assert (outs[0] / "SHA256SUMS").read_bytes() == (outs[1] / "SHA256SUMS").read_bytes()
    out = outs[0]
    _check_sums(out)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]      # no temp dirs left behind
    lib = out / "android-cpu" / "lib" / "libmodel_android.a"
    symbols = subprocess.run([nm, "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    prefix = json.loads((out / "android-cpu" / "reports" / "smollm2-135m-q4f16" / "kernels.json").read_text())[
        "system_lib_prefix"]
    assert re.fullmatch(r"[A-Za-z_]\w*_", prefix)
    assert f"{prefix}__tvm_ffi__library_bin" in symbols
    assert re.search(rf" T __tvm_ffi_{prefix}\w+", symbols)          # the kernels, under the same prefix
    for target in targets:
        model_lib = {"host-cpu": "lib/smollm2-135m-q4f16.so", "android-cpu": prefix.removesuffix("_")}[target]
        app = json.loads((out / target / "mlc-app-config.json").read_text())["model_list"]
        assert [(e["model_id"], e["model_lib"], e["model_path"], e["model_url"]) for e in app] == [
            ("smollm2-135m-q4f16", model_lib, "smollm2-135m-q4f16",
             f"https://huggingface.co/org/smollm2-135m-q4f16-{target}")]
        plan = json.loads((out / target / "reports" / "smollm2-135m-q4f16" / "memory.json").read_text())
        assert app[0]["estimated_vram_bytes"] > plan["weights_total"]["bytes"] > 50e6
        weights = out / target / "smollm2-135m-q4f16"
        assert {"mlc-chat-config.json", "tensor-cache.json", "tokenizer.json"} <= {p.name for p in weights.iterdir()}
        cache = json.loads((weights / "tensor-cache.json").read_text())
        assert all((weights / shard["dataPath"]).stat().st_size == shard["nbytes"] for shard in cache["records"])
        chat = json.loads((weights / "mlc-chat-config.json").read_text())   # what the engine parses
        assert chat["model_lib"] == model_lib
        assert all((weights / f).is_file() for f in chat["tokenizer_files"])       # MLCChat downloads each
        assert chat["tokenizer_info"] == {"token_postproc_method": "byte_level", "prepend_space_in_encode": False,
                                          "strip_space_in_decode": False}
        conv = chat["conv_template"]
        assert conv["system_message"] == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
        assert conv["stop_token_ids"] == [2] and conv["roles"]["assistant"] == "<|im_start|>assistant"
        with tarfile.open(out / f"small-{target}.tar.gz") as tar:
            names = set(tar.getnames())
        tree = {f"small-{target}/{p.relative_to(out / target).as_posix()}" for p in (out / target).rglob("*")}
        assert names == tree | {f"small-{target}", f"small-{target}/release.json"}
        with gzip.open(out / f"small-{target}.tar.gz") as gz:
            assert gz.read(1)
    if "host-cpu" in targets:
        assert (out / "host-cpu" / "lib" / "smollm2-135m-q4f16.so").exists()
    manifest = json.loads((out / "release.json").read_text())
    assert [b["target"] for b in manifest["builds"]] == targets
    assert manifest["tool_versions"]["tvm"] and manifest["git"]["commit"]
    assert all(b["library_key"] and b["bundle_build_key"] for b in manifest["builds"])


# ------------------------------------------------------------------------- compile determinism
def _shape_func(order: list[int], dependent: bool = False):
    from tvm import tirx

    H = tirx.decl_buffer((8,), "int64", name="H")

    def store(slot: int):
        src = tirx.IntImm("int64", order[0] if dependent and slot != order[0] else 0)
        return tirx.BufferStore(H, tirx.BufferLoad(H, [src]) * tirx.IntImm("int64", 10 + slot),
                                [tirx.IntImm("int64", slot)])

    return tirx.PrimFunc([H], tirx.SeqStmt([store(s) for s in order]))


def _slots(func) -> list[int]:
    return [int(s.indices[0]) for s in func.body.seq]


def test_shape_function_stores_are_sorted():
    """VMShapeLower's hash-ordered slot stores come out in slot order, so a library's bytes do not change
    from one compile to the next; stores that read another store's slot keep their order."""
    import tvm

    from pipeline.compiler.compile import sort_shape_stores

    mod = tvm.IRModule({"shape_func1": _shape_func([5, 2, 6, 1]), "other": _shape_func([3, 1]),
                        "shape_func2": _shape_func([4, 2, 3], dependent=True)})
    out = sort_shape_stores(mod)
    assert _slots(out["shape_func1"]) == [1, 2, 5, 6]
    def stores(func):
        return {(int(s.indices[0]), str(s.value)) for s in func.body.seq}

    assert stores(out["shape_func1"]) == stores(mod["shape_func1"])    # the same stores, only reordered
    assert _slots(out["other"]) == [3, 1]                 # only VMShapeLower's shape functions
    assert _slots(out["shape_func2"]) == [4, 2, 3]        # H[2] and H[3] read H[4]: order kept
