"""The Makefile hands user values to the pipeline as single arguments, never as shell code (issue: a MODEL of
`x; touch FILE #` ran the command and make exited 0)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")


@pytest.mark.parametrize("model", ["x; touch {marker} #", "$$(touch {marker})", "`touch {marker}`", "a dir/with space"])
def test_make_build_passes_model_as_one_argument(tmp_path, model):
    marker = tmp_path / "PWNED"
    value = model.format(marker=marker)
    # -o: never (re)install the venv from here, whichever checkout the tests run in
    result = subprocess.run(["make", "-s", "-o", ".venv/.installed", "build", f"MODEL={value}",
                             f"OUT={tmp_path / 'out'}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0, result.stdout          # the pipeline's exit status, not the last command's
    assert not marker.exists()
    shown = value.replace("$$", "$")                       # make's own escape for a dollar sign
    assert f"unknown model {shown!r}" in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()
