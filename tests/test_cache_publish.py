"""What a build publishes, its own lookup reads back: an entry written with a value the reader refuses would be
rebuilt by every later process (and shipped bad by ``attnjit pack``). With a stand-in nvcc (a shell script), no GPU."""

from __future__ import annotations

import warnings
from pathlib import Path

from attnjit.cache import Cache, Job
from attnjit.toolchain import Nvcc, flags_for

_NVCC = r'''#!/bin/sh
if [ "$1" = "--version" ]; then echo "Cuda compilation tools, release 13.0, V13.0.88"; exit 0; fi
out=""; prev=""; for a in "$@"; do if [ "$prev" = "-o" ]; then out="$a"; fi; prev="$a"; in="$a"; done
[ -n "$STEP" ] && touch -d "@$(( $(date +%s) - 31536000 ))" "$(dirname "$in")/started"
{ printf 'FAKECUBIN:'; sha256sum "$in"; } > "$out"
'''


def _nvcc(tmp_path: Path, clock_step: bool) -> Nvcc:
    script = tmp_path / ("nvcc-step" if clock_step else "nvcc")
    script.write_text(_NVCC.replace("[ -n \"$STEP\" ]", "true" if clock_step else "false"))
    script.chmod(0o755)
    return Nvcc(script, "Cuda compilation tools, release 13.0, V13.0.88")


def _built_and_read_back(tmp_path: Path, label: str, clock_step: bool):
    root = tmp_path / "cache"
    job = Job(source=f"// {label!r} {clock_step}\n", flags=flags_for("sm_90a"), arch="sm_90a", label=label, meta={},
              nvcc=_nvcc(tmp_path, clock_step))
    assert Cache(root, layers=()).build([job])[0].status == "built"
    with warnings.catch_warnings():
        warnings.simplefilter("error")    # a bad entry is a warned miss: here an error
        return Cache(root, layers=()).lookup(job.key)


def test_a_clock_step_during_a_compile_still_publishes_a_readable_entry(tmp_path):
    """The compile's duration comes from a marker's mtime: a wall clock stepped back a year mid-build gave a duration
    the reader refuses as insane."""
    entry = _built_and_read_back(tmp_path, "clock", clock_step=True)
    assert entry is not None and 0 <= entry.manifest["compile_seconds"] <= 1e7


def test_a_label_with_control_characters_is_published_printable(tmp_path):
    entry = _built_and_read_back(tmp_path, "prefill\tcausal\x1b[2J", clock_step=False)
    assert entry is not None and entry.manifest["label"] == "prefill?causal?[2J"
