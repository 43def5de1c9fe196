"""Progress output (rich): a spinner per stage, a byte bar with speed and ETA for weight conversion.

Everything goes to stderr so stdout stays clean for generated text and machine-readable output.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)


class Reporter:
    def __init__(self, quiet: bool = False):
        self.console = Console(stderr=True, highlight=False)
        self.quiet = quiet
        self.all_cached = True

    def info(self, text: str) -> None:
        if not self.quiet:
            self.console.print(text)

    @contextmanager
    def step(self, title: str) -> Iterator[None]:
        t0 = time.time()
        if "cache" not in title:
            self.all_cached = False
        if self.quiet:
            yield
            return
        with self.console.status(f"{title} …"):
            yield
        self.console.print(f"[green]✓[/] {title} ({time.time() - t0:.1f} s)")

    @contextmanager
    def bytes_bar(self, title: str, total: int | None, completed: int = 0) -> Iterator[Callable[[int], None]]:
        """A bar in bytes with GB/s and ETA; `completed` bytes are already done (a resumed job), so the
        bar starts there and speed / ETA count only the bytes done from now on."""
        self.all_cached = False
        if self.quiet:
            yield lambda _n: None
            return
        columns = [TextColumn(f"{title}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                   TimeRemainingColumn()]
        with Progress(*columns, console=self.console, transient=False) as bar:
            task = bar.add_task(title, total=total, completed=completed)
            yield lambda n: bar.advance(task, n)
