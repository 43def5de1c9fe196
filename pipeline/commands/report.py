"""`python -m pipeline report A [B]`: one build's coverage summary, or what changed between two builds."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.report.html import coverage_html
from pipeline.report.text import diff, diff_text, load_coverage, load_memory, summarize, summary_text


def main(paths: list[str], as_json: bool = False, html: str | None = None) -> int:
    """Print one build's summary (one path) or the diff of two (exit 0); PipelineError for bad input."""
    if not 1 <= len(paths) <= 2:
        raise PipelineError(f"report takes one or two bundles, got {len(paths)}",
                            fix="python -m pipeline report A [B]")
    reports = [load_coverage(p) for p in paths]
    if html:
        if len(paths) != 1:
            raise PipelineError("--html renders one bundle's report", fix="python -m pipeline report A --html OUT")
        page = coverage_html(reports[0], load_memory(paths[0]))
        try:
            Path(html).write_text(page)
        except OSError as err:
            raise PipelineError(f"cannot write the HTML page ({err.strerror})", path=html,
                                fix="give --html a path in an existing, writable folder") from None
    if len(paths) == 1:
        result = summarize(reports[0], str(paths[0]))
        text = summary_text(result)
    else:
        result = diff(reports[0], reports[1], str(paths[0]), str(paths[1]))
        text = diff_text(result)
    print(json.dumps(result, indent=1, sort_keys=True) if as_json else text, end="\n" if as_json else "")
    return 0
