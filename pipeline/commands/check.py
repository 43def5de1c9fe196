"""`python -m pipeline check BUNDLE... [--runtime R]`: does each bundle satisfy the app runtime's contract?

Inspects a bundle of any target without running it (verify/contract.py); one line per violation, exit 1 when
there is any."""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.verify.contract import check_bundle


def main(bundles: list[str], runtime: str | None = None) -> int:
    failed = 0
    for name in bundles:
        path = Path(name)
        if not path.is_dir():
            raise PipelineError("not a bundle folder", path=path, fix="give a folder that `pipeline build` wrote")
        result = check_bundle(path, runtime)
        for line in result.violations:
            print(f"{path}: {line}")
        if result.ok:
            counts = ", ".join(f"{v} {k}" for k, v in result.checked.items())
            print(f"{path}: ok for runtime {result.runtime} ({counts})")
        failed += not result.ok
    return 1 if failed else 0
