"""How ``attnjit warm`` and ``attnjit pack`` show a build: a live bar on a terminal, one plain line per kernel
otherwise, nothing but errors and the summary with ``--quiet``, JSON lines with ``--json``.

Each reporter takes the cache's ``BuildEvent``s; the command prints the summary itself (``summary_line``).
"""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

from .cache import BuildEvent, BuildResult


class Reporter:
    """Plain lines on stderr, each kernel once: what is being done, every kernel built or failed."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream or sys.stderr

    def begin(self, n_specs: int, root: Any) -> None:
        self._say(f"warming {n_specs} spec(s) into {root}")

    def event(self, ev: BuildEvent) -> None:
        if ev.kind in ("plan", "start", "built", "failed", "waiting"):
            self._say(str(ev))

    def close(self) -> None:
        pass

    def _say(self, line: str) -> None:
        print(line, file=self.stream, flush=True)


class QuietReporter(Reporter):
    def begin(self, n_specs: int, root: Any) -> None:
        pass

    def event(self, ev: BuildEvent) -> None:
        pass


class JsonReporter(Reporter):
    """One JSON object per line on stdout: ``built``/``failed`` as they happen, then the command's summary."""

    def __init__(self, stream: TextIO | None = None):
        super().__init__(stream or sys.stdout)

    def begin(self, n_specs: int, root: Any) -> None:
        self.emit({"event": "begin", "specs": n_specs, "root": str(root)})

    def event(self, ev: BuildEvent) -> None:
        if ev.kind == "plan":
            self.emit({"event": "plan", "kernels": ev.total, "cached": ev.cached})
        elif ev.kind == "built":
            self.emit({"event": "built", "label": ev.label, "key": ev.key, "seconds": round(ev.seconds or 0, 3)})
        elif ev.kind == "failed":
            self.emit({"event": "failed", "label": ev.label, "key": ev.key,
                       "error": ev.error.first_error if ev.error else None,
                       "log": str(ev.error.log_path) if ev.error else None})

    def emit(self, obj: dict[str, Any]) -> None:
        print(json.dumps(obj, separators=(",", ":")), file=self.stream, flush=True)


class BarReporter(Reporter):
    """A live bar (rich): done/total, failures, elapsed, ETA and the kernels compiling now; each finished kernel
    also leaves one line above the bar."""

    def __init__(self, stream: TextIO | None = None, console: Any = None):
        super().__init__(stream)
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        self.console = console or Console(file=self.stream, stderr=self.stream is sys.stderr)
        self.progress = Progress(TextColumn("[bold]warm[/bold]"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[failed]} failed"), TimeElapsedColumn(),
                                 TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.fields[now]}"),
                                 console=self.console, transient=False)
        self.task = self.progress.add_task("warm", total=None, failed=0, now="")
        self.failed = 0
        self.now: list[str] = []   # labels compiling now (as last reported), minus those finished since

    def begin(self, n_specs: int, root: Any) -> None:
        self.console.print(f"warming {n_specs} spec(s) into {root}", highlight=False)
        self.progress.start()

    def event(self, ev: BuildEvent) -> None:
        if ev.kind == "plan":
            self.progress.update(self.task, total=ev.total, completed=ev.cached)
        elif ev.kind in ("built", "failed"):
            self.failed += ev.kind == "failed"
            self.progress.console.print(str(ev).strip(), highlight=False, markup=False)
            self.now = [label for label in self.now if label != ev.label]
            self.progress.update(self.task, advance=1, failed=self.failed, now=self._now())
        elif ev.kind == "compiling":
            self.now = list(ev.compiling)
            self.progress.update(self.task, now=self._now())
        elif ev.kind == "waiting":
            self.progress.console.print(str(ev), highlight=False, markup=False)

    def _now(self) -> str:
        now = ", ".join(self.now)
        return (now[:60] + "...") if len(now) > 63 else now

    def close(self) -> None:
        self.progress.update(self.task, now="")
        self.progress.stop()


def reporter(*, quiet: bool = False, as_json: bool = False) -> Reporter:
    if as_json:
        return JsonReporter()
    if quiet:
        return QuietReporter()
    if sys.stderr.isatty():
        return BarReporter()
    return Reporter()


def counts(results: list[BuildResult]) -> dict[str, int]:
    out = {"built": 0, "cached": 0, "failed": 0, "interrupted": 0}
    for r in results:
        out[r.status] += 1
    return out


def summary_line(n_specs: int, results: list[BuildResult], seconds: float, interrupted: str | None) -> str:
    c = counts(results)
    if interrupted:
        return (f"interrupted by {interrupted}: {n_specs} specs: {c['built']} built, {c['cached']} cached, "
                f"{c['failed']} failed, {c['interrupted']} not built ({seconds:.1f} s); what was built is kept, "
                "run the same command again to build the rest")
    return f"{n_specs} specs: {c['built']} built, {c['cached']} cached, {c['failed']} failed ({seconds:.1f} s)"
