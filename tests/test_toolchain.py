"""Lookups never need a toolchain; the toolchain that built an entry is recorded, shown and prunable.

Policy (attnjit/cache.py): the key is sha256(format, arch, flags, source); any verified entry for them serves a
lookup whichever nvcc built it; a build uses and records the local nvcc; ``cache prune --built-by`` removes the
entries of one toolchain."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from attnjit import jit
from attnjit.cache import Cache
from attnjit.toolchain import find_nvcc, nvcc
from tests.cpu_support import MERGE_FP16, entry_dir, hidden_nvcc_env, parse_summary, run_cli, write_script

OLD_PATCH = "Cuda compilation tools, release 13.0, V13.0.48"


# In a fresh interpreter: every lookup path with nvcc discovery itself booby-trapped.
STRICT_LOOKUPS = textwrap.dedent("""
    import json, sys
    import attnjit.toolchain as tc
    def trap(*a, **k):
        raise AssertionError("a lookup looked for nvcc")
    tc.nvcc = tc.find_nvcc = trap
    from attnjit import jit
    from attnjit.cache import Cache
    from attnjit.specs import load_catalog
    out = []
    for spec in load_catalog(sys.argv[1]):
        b = jit.ensure(spec)
        assert b.entry.image[:4] == b"\\x7fELF", "not the verified cubin bytes"
        out.append([spec.short_name(), b.how, b.entry.toolchain])
    print(json.dumps(out))
""")


def _catalog(tmp_path: Path, specs) -> Path:
    path = tmp_path / "golden.toml"
    path.write_text("\n".join("[[spec]]\n" + "\n".join(f"{k} = {json.dumps(v)}" for k, v in s.to_dict().items())
                              for s in specs))
    return path


@pytest.mark.nvcc
@pytest.mark.parametrize("jit_on", ["0", "1"])
def test_strict_lookups_of_a_warmed_catalog_hit_with_no_nvcc_anywhere(golden, tmp_path, jit_on):
    root = golden.copy(tmp_path / "cache")
    env, ran = hidden_nvcc_env(tmp_path, ATTNJIT_CACHE_DIR=str(root), ATTNJIT_JIT=jit_on)
    proc = subprocess.run([sys.executable, "-c", STRICT_LOOKUPS, str(_catalog(tmp_path, golden.specs))], env=env,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    tool = nvcc().ident
    assert rows == [[s.short_name(), "disk", tool] for s in golden.specs]
    assert not ran.exists(), f"nvcc was executed: {ran.read_text()}"
    # the CLI's read-only commands need no nvcc either
    for args in (("cache", "list"), ("cache", "verify"), ("warm", str(_catalog(tmp_path, golden.specs)))):
        proc = run_cli(*args, "--cache-dir", root, env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr
    assert parse_summary(proc.stdout) == (4, 0, 4, 0)
    assert not ran.exists(), f"nvcc was executed: {ran.read_text()}"


def test_a_miss_with_no_nvcc_says_nvcc_is_missing(tmp_path):
    env, ran = hidden_nvcc_env(tmp_path, ATTNJIT_CACHE_DIR=str(tmp_path / "cache"))
    del env["ATTNJIT_NVCC"]
    script = ("from attnjit import jit\nfrom attnjit.specs import AttentionSpec\nfrom attnjit.errors import "
              "CacheMissError\ntry:\n    jit.ensure(AttentionSpec.parse('op=merge_state,head_dim=64,dtype=fp16'))\n"
              "except CacheMissError as e:\n    print(e.reason); print(e)\n")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    reason, message = proc.stdout.strip().split("\n", 1)
    assert reason == "no-nvcc"
    assert message.startswith("kernel not in the cache and nvcc is missing, so it cannot be built here (looked at "
                              "ATTNJIT_NVCC (unset); $CUDA_HOME/bin/nvcc (CUDA_HOME unset); nvcc on PATH (none)): "
                              '{"op":"merge_state"')
    assert "attnjit warm --spec op=merge_state" in message


@pytest.mark.nvcc
def test_entries_built_by_another_patch_release_serve_lookups_and_can_be_pruned(tmp_path, monkeypatch):
    real = find_nvcc()
    older = write_script(tmp_path / "nvcc-13.0.48", f"""case " $* " in
  *" --version "*) echo "nvcc: NVIDIA (R) Cuda compiler driver"; echo "{OLD_PATCH}"; exit 0 ;;
esac
exec "{real}" "$@"
""")
    root = tmp_path / "cache"
    env = dict(os.environ, ATTNJIT_NVCC=str(older))
    proc = run_cli("warm", "--spec", MERGE_FP16.as_flags(), "--cache-dir", root, env=env)
    assert proc.returncode == 0, proc.stderr
    key = jit.job_for(MERGE_FP16).key
    manifest = json.loads((entry_dir(root, key) / "manifest.json").read_text())
    assert manifest["toolchain"]["id"] == "nvcc 13.0 V13.0.48" and manifest["toolchain"]["nvcc"] == str(older)
    assert OLD_PATCH in manifest["toolchain"]["version"]

    # the local nvcc (another patch release) is served the entry, strict or not, and is told who built it
    assert nvcc().ident != "nvcc 13.0 V13.0.48"
    for strict in ("0", "1"):
        monkeypatch.setenv("ATTNJIT_JIT", strict)
        binary = jit.ensure(MERGE_FP16, Cache(root, layers=()))
        assert binary.how == "disk" and binary.entry.toolchain == "nvcc 13.0 V13.0.48"
    proc = run_cli("cache", "list", "--cache-dir", root)
    assert "nvcc 13.0 V13.0.48" in proc.stdout.splitlines()[0]

    # prune --built-by removes that toolchain's entries (dry run first), and the next warm rebuilds with ours
    for spelling in ("nvcc 13.0 V13.0.88", "V13.0.88", "12.8"):
        proc = run_cli("cache", "prune", "--built-by", spelling, "--cache-dir", root)
        assert proc.returncode == 0 and proc.stdout.startswith("removed 0 entries"), (spelling, proc.stdout)
    proc = run_cli("cache", "prune", "--built-by", "V13.0.48", "--dry-run", "--cache-dir", root)
    assert proc.stdout.splitlines() == [f"would remove {entry_dir(root, key)}",
                                        f"would remove 1 entries; 0 bytes (0 B) remain in {root}"]
    proc = run_cli("cache", "prune", "--built-by", "13.0.48", "--cache-dir", root)
    assert proc.returncode == 0 and proc.stdout.startswith("removed 1 entries")
    assert not entry_dir(root, key).exists()
    monkeypatch.setenv("ATTNJIT_JIT", "1")
    rebuilt = jit.ensure(MERGE_FP16, Cache(root, layers=()))
    assert rebuilt.how == "built" and rebuilt.entry.toolchain == nvcc().ident
