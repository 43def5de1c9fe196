"""AArch64 CPU classes as data (configs/cpu_classes.yaml): a target names its class, which gives LLVM's mattr;
`--phone NAME` builds for that phone's class; the memory plan and the coverage report name it; a bad name is one
line naming the file."""

from __future__ import annotations

import dataclasses

import pytest

from pipeline.config import load_cpu_class, load_phone, load_target
from pipeline.errors import ConfigError


def _mattr(target) -> set[str]:
    return {str(a) for a in target.tvm().attrs["mattr"]}


def test_target_class_gives_mattr():
    for name in ("android-cpu", "android-hexagon"):
        target = load_target(name)
        assert target.cpu_class == "dotprod" and _mattr(target) == {"+neon", "+fullfp16", "+dotprod"}
    i8mm = dataclasses.replace(load_target("android-cpu"), cpu_class="i8mm")
    assert {"+dotprod", "+i8mm", "+bf16"} <= _mattr(i8mm)
    explicit = dataclasses.replace(i8mm, tvm_target={**i8mm.tvm_target, "mattr": ["+neon"]})
    assert _mattr(explicit) == {"+neon"}                      # a target's own mattr wins
    assert load_target("host-cpu").cpu_class is None


def test_phones_name_a_class():
    assert load_phone("android-16gb")["cpu_class"] == "i8mm"
    assert "cpu_class" not in load_phone("iphone-12gb")
    assert "smmla" in load_cpu_class("i8mm")["description"]


def test_unknown_class_is_one_line():
    with pytest.raises(ConfigError) as err:
        load_cpu_class("sve9")
    assert "cpu_classes.yaml" in str(err.value) and "dotprod" in str(err.value)


@pytest.mark.slow   # a whole SmolLM2 android-cpu build (~1.5 min on 2 cores)
def test_phone_builds_for_its_class_and_reports_name_it(tmp_path, monkeypatch):
    from pipeline.progress import Reporter
    from pipeline.stages import run_pipeline

    monkeypatch.setenv("MLP_CACHE_DIR", str(tmp_path / "cache"))
    result = run_pipeline("smollm2-135m", "android-cpu", "q4f16", out=str(tmp_path / "dist"), phone="android-16gb",
                          verify=False, calibration="none", report=Reporter(quiet=True))
    reports = result.bundle / "reports"
    assert "class i8mm" in (reports / "memory.md").read_text()
    assert "built for `i8mm`" in (reports / "coverage.md").read_text()
