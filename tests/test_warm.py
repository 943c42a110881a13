"""``attnjit warm`` as a long-running tool: each kernel published as it finishes, SIGINT/SIGTERM stop every
compiler and keep what finished, ninja-level failures say what failed, progress on a terminal, plain lines, --quiet
and --json, and the CLI conventions (--version, python -m attnjit, info --json, --jobs)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attnjit import build, jit
from attnjit.cache import BuildEvent, Cache, Job
from attnjit.errors import BuildSetupError
from attnjit.toolchain import Nvcc, find_nvcc, flags_for
from tests.cpu_support import (MERGE_BF16, MERGE_FP16, PREFILL_D64, REPO, entry_dir, kill_tagged, parse_summary,
                               run_cli, tagged_processes, write_script)

FAKE = Nvcc(Path("/nonexistent/nvcc"), "Cuda compilation tools, release 13.0, V13.0.88")


def _wait_for(predicate, what: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"warm exited before {what}: {proc.stderr.read() if proc.stderr else ''}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.skipif(not build._death_signal_prefix(), reason="no setpriv --pdeathsig on this machine")
def test_a_killed_warm_takes_ninja_and_its_compilers_with_it(tmp_path):
    """SIGKILL gives warm no chance to stop ninja (its own session); ninja gets SIGTERM as its parent dies and stops
    every compile, so nothing goes on burning CPU for a build nobody will publish."""
    root, started = tmp_path / "cache", tmp_path / "started"
    slow = write_script(tmp_path / "nvcc", f"""case " $* " in *" --version "*) echo "Cuda compilation tools, release 13.0, V13.0.88"; exit 0 ;; esac
: > "{started}"; sleep 300
""")
    tag = f"warm-kill-{os.getpid()}-{time.monotonic_ns()}"
    env = dict(os.environ, ATTNJIT_NVCC=str(slow), ATTNJIT_TEST_TAG=tag)
    proc = subprocess.Popen([sys.executable, "-m", "attnjit", "warm", "--spec", MERGE_FP16.as_flags(),
                             "--cache-dir", str(root)], env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(started.exists, "the compile started", proc)
        assert len(tagged_processes(tag)) > 2, "expected warm, ninja and the compile to be running"
        proc.kill()
        proc.communicate(timeout=60)
        deadline = time.monotonic() + 20
        while tagged_processes(tag) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = tagged_processes(tag)
    finally:
        kill_tagged(tag)
    assert survivors == [], f"processes outlived the killed warm: {survivors}"
    assert Cache(root, layers=()).lookup(jit.job_for(MERGE_FP16).key) is None


@pytest.mark.nvcc
@pytest.mark.parametrize("sig,status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_keeps_finished_kernels_stops_every_compiler_and_the_next_warm_builds_the_rest(tmp_path, sig,
                                                                                                 status):
    root = tmp_path / "cache"
    real = find_nvcc()
    slow_started = tmp_path / "slow-started"
    # the prefill module compiles "forever"; the two merge modules at full speed
    wrapper = write_script(tmp_path / "nvcc", f"""case " $* " in *" --version "*) exec "{real}" "$@" ;; esac
for a in "$@"; do case "$a" in *kernel.cu) src="$a" ;; esac; done
if grep -q attnjit_attention "$src"; then : > "{slow_started}"; sleep 300; fi
exec "{real}" "$@"
""")
    tag = f"warm-signal-{os.getpid()}-{time.monotonic_ns()}"
    specs = [MERGE_FP16, PREFILL_D64, MERGE_BF16]
    args = [a for s in specs for a in ("--spec", s.as_flags())]
    env = dict(os.environ, ATTNJIT_NVCC=str(wrapper), ATTNJIT_TEST_TAG=tag)
    proc = subprocess.Popen([sys.executable, "-m", "attnjit", "warm", *args, "--cache-dir", str(root), "-j", "3"],
                            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        merges = [entry_dir(root, jit.job_for(s).key) / "manifest.json" for s in (MERGE_FP16, MERGE_BF16)]
        _wait_for(lambda: slow_started.exists() and all(m.exists() for m in merges),
                  "the merge kernels were published while the prefill still compiled", proc)
        assert len(tagged_processes(tag)) > 2, "expected warm, ninja and the slow compile to be running"
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
        time.sleep(0.2)
        survivors = tagged_processes(tag)
    finally:
        kill_tagged(tag)
    assert proc.returncode == status, err
    assert survivors == [], f"processes survived the warm: {survivors}"
    assert "Traceback" not in err
    (line,) = out.strip().splitlines()
    assert line.startswith(f"interrupted by {signal.Signals(sig).name}: 3 specs: 2 built, 0 cached, 0 failed, "
                           "1 not built (")
    cache = Cache(root, layers=())
    assert cache.verify() == []
    assert [cache.lookup(jit.job_for(s).key) is not None for s in specs] == [True, False, True]
    assert [p for p in (root / ".tmp").glob("build-*") if p.is_dir()] == [], "the interrupted build left its dir"

    proc = run_cli("warm", *args, "--cache-dir", root)  # the real nvcc now: only the rest is built
    assert proc.returncode == 0, proc.stderr
    assert parse_summary(proc.stdout) == (3, 1, 2, 0)


def _jobs(n: int) -> list[Job]:
    return [Job(source=f'extern "C" __global__ void k{i}(int *p) {{ *p = {i}; }}\n', flags=flags_for("sm_90a"),
                arch="sm_90a", label=f"tiny{i}", meta={}, nvcc=FAKE) for i in range(n)]


def test_a_ninja_level_failure_says_what_failed_with_a_log_that_exists(tmp_path, monkeypatch):
    fake_ninja = write_script(tmp_path / "ninja", 'echo "ninja: fatal: simulated: No space left on device"\nexit 1\n')
    monkeypatch.setattr(build, "ninja_binary", lambda: str(fake_ninja))
    results = Cache(tmp_path / "cache", layers=()).build(_jobs(2))
    assert [r.status for r in results] == ["failed", "failed"]
    for r in results:
        assert r.error.first_error == "ninja: fatal: simulated: No space left on device"
        assert r.error.log_path.name == "ninja.log" and r.error.log_path.is_file()
        assert "simulated" in r.error.log_path.read_text()


def test_a_full_disk_while_writing_the_build_files_is_one_clear_error(tmp_path, monkeypatch):
    real_write = Path.write_text

    def full(self, *a, **k):
        if self.name == "kernel.cu":
            raise OSError(28, "No space left on device")
        return real_write(self, *a, **k)

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(BuildSetupError) as info:
        Cache(tmp_path / "cache", layers=()).build(_jobs(1))
    msg = str(info.value)
    assert msg.startswith(f"cannot write the build files in {tmp_path / 'cache' / '.tmp'}/build-")
    assert "No space left on device; free space or inodes there" in msg
    assert list((tmp_path / "cache" / ".tmp").iterdir()) == [], "the failed build left its temp dir"


def test_an_nvcc_killed_without_output_reports_its_exit_status(tmp_path):
    dying = write_script(tmp_path / "nvcc", "kill -9 $$\n")
    job = Job(source="x", flags=("-cubin",), arch="sm_90a", label="dies", meta={}, nvcc=Nvcc(dying, FAKE.version))
    (result,) = Cache(tmp_path / "cache", layers=()).build([job])
    assert result.status == "failed" and result.error.log_path.is_file()
    assert result.error.first_error == "attnjit: the nvcc command exited with status 137"


def test_parallel_jobs_must_be_positive(tmp_path, monkeypatch):
    for n in (0, -2):
        with pytest.raises(ValueError, match=f"parallel nvcc jobs must be >= 1, got {n}"):
            Cache(tmp_path / "cache", layers=()).build(_jobs(1), parallel=n)
    monkeypatch.setenv("ATTNJIT_JOBS", "0")
    with pytest.raises(ValueError, match="ATTNJIT_JOBS='0' is invalid: expected a positive integer"):
        Cache(tmp_path / "cache", layers=()).build(_jobs(1))
    for bad in ("0", "-1", "many"):
        proc = run_cli("warm", "--spec", MERGE_FP16.as_flags(), "--jobs", bad, "--cache-dir", tmp_path / "c")
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.strip() == (f"attnjit: error: argument --jobs/-j: expected a positive number of parallel "
                                       f"nvcc jobs, got {bad!r} (see attnjit warm --help)")
        proc = run_cli("warm", "--spec", MERGE_FP16.as_flags(), "--max-specs", bad, "--cache-dir", tmp_path / "c")
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.strip().startswith(f"attnjit: error: argument --max-specs: expected a positive number of "
                                              f"specs, got {bad!r}")


# --- progress ---------------------------------------------------------------------------------------------------

@pytest.mark.nvcc
def test_plain_quiet_and_json_progress(golden, tmp_path):
    root = golden.copy(tmp_path / "cache")
    (entry_dir(root, golden.key(MERGE_FP16)) / "manifest.json").unlink()  # one to build, three cached
    args = [a for s in golden.specs for a in ("--spec", s.as_flags())]
    proc = run_cli("warm", *args, "--cache-dir", root, "--json")
    assert proc.returncode == 0, proc.stderr
    events = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [e["event"] for e in events] == ["begin", "plan", "built", "summary"]
    assert events[1] == {"event": "plan", "kernels": 4, "cached": 3}
    assert events[2]["label"] == MERGE_FP16.short_name() and events[2]["key"] == golden.key(MERGE_FP16)
    assert {k: events[3][k] for k in ("specs", "built", "cached", "failed", "interrupted")} == \
        {"specs": 4, "built": 1, "cached": 3, "failed": 0, "interrupted": None}

    proc = run_cli("warm", *args, "--cache-dir", root, "--quiet")
    assert proc.returncode == 0 and proc.stderr == "" and parse_summary(proc.stdout) == (4, 0, 4, 0)

    (entry_dir(root, golden.key(MERGE_BF16)) / "manifest.json").unlink()
    proc = run_cli("warm", *args, "--cache-dir", root)  # not a terminal: plain lines, each kernel once
    assert proc.returncode == 0
    built = [ln for ln in proc.stderr.splitlines() if ln.startswith("  built ")]
    assert len(built) == 1 and MERGE_BF16.short_name() in built[0]
    assert "\x1b[" not in proc.stderr, "escape codes without a terminal"

    proc = run_cli("warm", *args, "--quiet", "--json", "--cache-dir", root)
    assert proc.returncode == 2 and "not allowed with argument" in proc.stderr


def test_the_terminal_bar_shows_done_total_failures_and_what_compiles():
    from rich.console import Console

    from attnjit.progress import BarReporter

    out = io.StringIO()
    rep = BarReporter(console=Console(file=out, force_terminal=True, width=160))
    rep.begin(4, "/cache")
    rep.event(BuildEvent("plan", total=4, cached=1))
    rep.event(BuildEvent("compiling", compiling=("prefill-paged-causal-d128", "decode-paged-d128")))
    rep.progress.refresh()
    rep.event(BuildEvent("built", "prefill-paged-causal-d128", "k" * 64, seconds=2.0))
    assert rep.now == ["decode-paged-d128"], "a finished kernel is still shown as compiling"
    rep.event(BuildEvent("failed", "decode-paged-d128", "j" * 64, seconds=1.0))
    rep.close()
    text = out.getvalue()
    assert "warming 4 spec(s) into /cache" in text
    assert "decode-paged-d128" in text and "built prefill-paged-causal-d128 in 2.0 s" in text
    assert "3/4" in text and "1 failed" in text and "ETA" in text


# --- CLI conventions ----------------------------------------------------------------------------------------------

def test_version_and_python_dash_m():
    from attnjit import __version__

    for cmd in (["-m", "attnjit", "--version"], ["-m", "attnjit.cli", "--version"]):
        proc = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, cwd=REPO, timeout=60)
        assert proc.returncode == 0 and proc.stdout == f"attnjit {__version__}\n"
    proc = subprocess.run([sys.executable, "-m", "attnjit"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("attnjit: error: the following arguments are required")


def test_info_lists_every_setting_with_its_value_and_source(tmp_path):
    from attnjit import knobs

    env = dict(os.environ, ATTNJIT_LOCK_TIMEOUT="12", ATTNJIT_JOBS="zero", ATTNJIT_NVCC=str(tmp_path / "missing"))
    proc = run_cli("info", "--json", "--cache-dir", tmp_path / "root", env=env)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    settings = {s["name"]: s for s in info["settings"]}
    assert list(settings) == [k.name for k in knobs.ALL]
    assert settings["ATTNJIT_LOCK_TIMEOUT"] | {"meaning": ""} == {
        "name": "ATTNJIT_LOCK_TIMEOUT", "value": 12.0, "source": "env", "raw": "12", "default": 900.0, "meaning": ""}
    assert settings["ATTNJIT_JIT"]["value"] is True and settings["ATTNJIT_JIT"]["source"] == "default"
    assert settings["ATTNJIT_JOBS"]["value"] is None and "is invalid" in settings["ATTNJIT_JOBS"]["error"]
    assert info["cache"]["root"] == str(tmp_path / "root") and "error" in info["nvcc"]
    proc = run_cli("info", "--cache-dir", tmp_path / "root", env=env)
    lines = proc.stdout.splitlines()
    start = lines.index("settings (value, where it comes from):")
    rows = lines[start + 1:]
    assert [r.split()[0] for r in rows] == [k.name for k in knobs.ALL]
    assert any(r.split()[:3] == ["ATTNJIT_LOCK_TIMEOUT", "12.0", "env"] for r in rows)
    assert any(r.split()[:2] == ["ATTNJIT_JOBS", "INVALID"] for r in rows)


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_signal_during_a_publish_loses_neither_the_kernel_nor_its_count(tmp_path, monkeypatch, when):
    """SIGINT can land anywhere in the publish of a finished kernel: before its rename (the cleanup publishes it
    again) or after it (the result is recovered from the cache). Either way the kernel counts as built."""
    from attnjit.cache import BuildInterrupted

    copy_nvcc = write_script(tmp_path / "nvcc", 'while [ "$1" != "-o" ]; do shift; done; cp "$3" "$2"\n')
    tool = Nvcc(copy_nvcc, FAKE.version)
    jobs = [Job(source=f"module {i}\n", flags=("-cubin",), arch="sm_90a", label=f"m{i}", meta={}, nvcc=tool)
            for i in range(2)]
    cache = Cache(tmp_path / "cache", layers=())
    real = Cache._publish
    hit = []

    def interrupted_publish(self, job, d, seconds):
        if not hit:
            hit.append(job.key)
            if when == "before":
                raise KeyboardInterrupt
            real(self, job, d, seconds)
            raise KeyboardInterrupt
        return real(self, job, d, seconds)

    monkeypatch.setattr(Cache, "_publish", interrupted_publish)
    with pytest.raises(BuildInterrupted) as info:
        cache.build(jobs, parallel=1)
    by_key = {r.job.key: r for r in info.value.results}
    assert by_key[hit[0]].status == "built" and Cache(tmp_path / "cache", layers=()).lookup(hit[0]) is not None
    assert list((tmp_path / "cache" / ".tmp").glob("build-*/")) == []
