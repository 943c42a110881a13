"""Running nvcc through ninja: one target per job, each reported the moment it finishes, interruptible.

``run_ninja`` writes a ``build.ninja`` (one edge per job, ``-k 0`` so one failure stops nothing) and reads ninja's
status lines as they come: without a terminal ninja prints ``[done/total] <key>`` when an edge *finishes*, so each
finished kernel is handed to ``on_finished`` (which publishes it) while the others still compile.

Contracts:
  * A cubin exists in the build directory only when nvcc succeeded (it writes ``kernel.cubin.part``, renamed on
    success), so "finished" is decided by the file, never by parsing compiler output.
  * Ninja runs in a session of its own. On any exception in the caller (KeyboardInterrupt from SIGINT, or SIGTERM
    turned into one by the CLI) ninja gets SIGTERM (it forwards it to each compiler's process group and waits for
    them); whatever is left of the session after a grace period is SIGKILLed. Kernels that finished before the
    signal are still handed to ``on_finished``; then the exception propagates.
  * A failure before or around nvcc (ninja cannot start, a bad ``-j``, a full disk) is reported with ninja's own
    words and a log file that exists, not as "nvcc failed without output".

This module knows nothing about the cache's layout or keys beyond the directory names it is given.
"""

from __future__ import annotations

import functools
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from .errors import BuildSetupError, CompileError

CUBIN, SOURCE, LOG, STARTED, NINJA_LOG = "kernel.cubin", "kernel.cu", "build.log", "started", "ninja.log"
_STATUS = re.compile(r"^\[(\d+)/(\d+)\] ([0-9a-f]{64})$")
STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class Target:
    """One edge: the directory name (the key), its source, and the compiler command's parts."""

    key: str
    source: str
    nvcc: Path
    flags: tuple[str, ...]
    label: str


@dataclass(frozen=True)
class Outcome:
    key: str
    ok: bool
    seconds: float
    log: str                # the compiler's output (or ninja's, when the compiler never ran)
    log_name: str           # the file in the target's directory that holds it


def first_error_line(log: str) -> str:
    """The first ``error`` line of a compiler log (else its last line): what an error message leads with."""
    for line in log.splitlines():
        if re.search(r"\berror\b", line, re.I):
            return line.strip()
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    return lines[-1] if lines else "nvcc failed without output"


@dataclass(frozen=True)
class BuildEvent:
    """What a build reports while it runs (``progress`` callbacks). ``str()`` is the plain one-line form."""

    kind: str                       # plan | start | built | failed | compiling | waiting
    label: str = ""
    key: str = ""
    total: int = 0                  # plan: distinct jobs; start: jobs this ninja run builds
    cached: int = 0                 # plan: how many were already cached
    parallel: int = 0               # start
    seconds: float | None = None    # built / failed
    error: CompileError | None = None
    compiling: tuple[str, ...] = ()  # compiling: labels of the kernels compiling now

    def __str__(self) -> str:
        if self.kind == "plan":
            return f"{self.total} kernel(s): {self.cached} cached, {self.total - self.cached} to build"
        if self.kind == "start":
            return f"compiling {self.total} kernel module(s) with {self.parallel} parallel nvcc job(s)"
        if self.kind == "built":
            return f"  built {self.label} in {self.seconds:.1f} s"
        if self.kind == "failed":
            return f"  FAILED {self.label}: {self.error.first_error if self.error else '?'}"
        if self.kind == "waiting":
            return f"waiting for another process building {self.label}"
        return f"  compiling: {', '.join(self.compiling)}"


def ninja_binary() -> str:
    try:
        import ninja  # type: ignore

        cand = Path(ninja.BIN_DIR) / "ninja"
        if cand.is_file():
            return str(cand)
    except ImportError:
        pass
    found = shutil.which("ninja")
    if not found:
        raise FileNotFoundError("ninja not found: pip install ninja")
    return found


@functools.lru_cache(maxsize=1)
def _death_signal_prefix() -> tuple[str, ...]:
    """``setpriv --pdeathsig TERM --`` where util-linux's setpriv has that option (Linux): ninja then gets SIGTERM
    when the thread that started it dies, even by SIGKILL, and stops its compilers as on Ctrl-C. Without it a killed
    ``attnjit warm`` left ninja (its own session) compiling the rest of the batch. Elsewhere: nothing (ninja runs as
    before). ``preexec_fn`` would do the same without setpriv, but is unsafe in a process with threads."""
    tool = shutil.which("setpriv")
    if tool is None:
        return ()
    try:
        proc = subprocess.run([tool, "--pdeathsig", "TERM", "--", "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return (tool, "--pdeathsig", "TERM", "--") if proc.returncode == 0 else ()


def _escape(text: str) -> str:
    return text.replace("$", "$$").replace("\n", "$\n")


def write_build_file(bdir: Path, targets: Sequence[Target]) -> None:
    lines = ["ninja_required_version = 1.3", "", "rule nvcc",
             # the marker dates the compile (its mtime) and says it is running; the exit status lands in the log
             f"  command = : > $dir/{STARTED} && $nvcc $flags -o $out.part $in > $log 2>&1 && mv -f $out.part $out"
             " || { s=$$?; echo \"attnjit: the nvcc command exited with status $$s\" >> $log; exit $$s; }",
             "  description = $dir", ""]
    try:
        for t in targets:
            d = bdir / t.key
            d.mkdir()
            (d / SOURCE).write_text(t.source, encoding="utf-8")
            lines += [f"build {t.key}/{CUBIN}: nvcc {t.key}/{SOURCE}",
                      f"  dir = {t.key}",
                      f"  nvcc = {_escape(shlex.quote(str(t.nvcc)))}",
                      f"  flags = {_escape(' '.join(shlex.quote(f) for f in t.flags))}",
                      f"  log = {t.key}/{LOG}", ""]
        (bdir / "build.ninja").write_text("\n".join(lines), encoding="utf-8")
    except OSError as exc:
        raise BuildSetupError(bdir, exc.strerror or str(exc)) from None


def _session_members(sid: int) -> list[int]:
    """Processes of session ``sid`` (Linux /proc; empty elsewhere)."""
    out = []
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if len(fields) > 3 and int(fields[3]) == sid:
            out.append(int(entry.name))
    return out


def quiet_signals() -> dict[int, object]:
    """While stopping, a second Ctrl-C must not cut the cleanup short: ignore SIGINT/SIGTERM until
    ``restore_signals``."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}


def restore_signals(saved: dict[int, object]) -> None:
    for s, handler in saved.items():
        signal.signal(s, handler)  # type: ignore[arg-type]


def stop(proc: subprocess.Popen) -> None:
    """Stop ninja and every compiler it started: SIGTERM to ninja, then SIGKILL to what is left of its session."""
    try:
        proc.send_signal(signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    for _ in range(3):
        left = [pid for pid in _session_members(proc.pid) if pid != os.getpid()]
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    proc.wait()


def run_ninja(bdir: Path, targets: Sequence[Target], parallel: int, *,
              on_finished: Callable[[Outcome], None], on_compiling: Callable[[list[str]], None]) -> None:
    """Build every target; call ``on_finished`` once per target (as it finishes, or at the end for targets ninja
    never ran), and ``on_compiling`` with the labels compiling now, about twice a second."""
    if parallel < 1:
        raise ValueError(f"parallel nvcc jobs must be >= 1, got {parallel}")
    write_build_file(bdir, targets)
    by_key = {t.key: t for t in targets}
    reported: set[str] = set()
    ninja_lines: list[str] = []
    t0 = time.time()

    def finish(key: str) -> None:
        if key in reported:
            return
        d = bdir / key
        cubin = d / CUBIN
        try:
            started = (d / STARTED).stat().st_mtime
        except OSError:
            started = t0
        seconds = max(time.time() - started, 0.0)
        ok = cubin.is_file() and cubin.stat().st_size > 0
        log_path = d / LOG
        if log_path.exists():
            log, name = log_path.read_text(encoding="utf-8", errors="replace"), LOG
        else:  # the compiler never ran: what ninja said is the log
            log = "\n".join(ninja_lines) or "ninja exited before starting the nvcc command (no output)"
            name = NINJA_LOG
            try:
                (d / NINJA_LOG).write_text(log + "\n", encoding="utf-8")
            except OSError:
                pass
        on_finished(Outcome(key, ok, seconds, log, name))
        reported.add(key)  # only now: a signal inside on_finished leaves it to the cleanup below to finish again

    env = dict(os.environ, NINJA_STATUS="[%f/%t] ")
    try:
        proc = subprocess.Popen([*_death_signal_prefix(), ninja_binary(), "-k", "0", "-j", str(parallel)],
                                cwd=bdir, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                                start_new_session=True)
    except OSError as exc:
        ninja_lines.append(f"ninja could not be started: {exc.strerror or exc}")
        for key in by_key:
            finish(key)
        return
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    reader = threading.Thread(target=pump, name="attnjit-ninja-output", daemon=True)
    reader.start()
    try:
        while True:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                on_compiling([by_key[k].label for k in by_key if k not in reported
                              and (bdir / k / STARTED).exists()])
                continue
            if line is None:
                break
            m = _STATUS.match(line)
            if m and m.group(3) in by_key:
                finish(m.group(3))
            elif line.strip():
                ninja_lines.append(line)
        proc.wait()
    except BaseException:
        saved = quiet_signals()
        try:
            stop(proc)
            for key in by_key:  # keep what finished before the signal (a publish it cut short is done again)
                if (bdir / key / CUBIN).is_file():
                    finish(key)
        finally:
            restore_signals(saved)
        raise
    reader.join(timeout=5)
    for key in by_key:  # targets ninja never reported (it failed to load the file, or stopped early)
        finish(key)
