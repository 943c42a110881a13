"""Kernel packages (``attnjit pack``): a wheel that attnjit finds once installed, a layer directory and a tarball;
each serves every spec of its catalog in strict mode on a host with no nvcc and no writable cache. And the
catalogs that ship inside the package (``attnjit warm default``)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from attnjit.specs import load_catalog
from tests.cpu_support import APPEND_FP16, MERGE_BF16, MERGE_FP16, REPO, hidden_nvcc_env, run_cli, write_script

PACKED = (MERGE_FP16, MERGE_BF16, APPEND_FP16)

# In the serving environment: every spec of the catalog, strictly, with nvcc discovery booby-trapped.
SERVE = """
import json, sys
import attnjit.toolchain as tc
def trap(*a, **k):
    raise AssertionError("a lookup looked for nvcc")
tc.nvcc = tc.find_nvcc = trap
from attnjit import jit
from attnjit.specs import load_catalog
print(json.dumps([[b.how, str(b.entry.layer)] for b in map(jit.ensure, load_catalog(sys.argv[1]))]))
"""


def _catalog(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text("\n".join("[[spec]]\n" + "\n".join(f"{k} = {json.dumps(v)}" for k, v in s.to_dict().items())
                              for s in PACKED))
    return path


def _serve(python: str, catalog: Path, env: dict[str, str], cwd: Path) -> list[list[str]]:
    proc = subprocess.run([python, "-c", SERVE, str(catalog)], env=env, capture_output=True, text=True, timeout=120,
                          cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.nvcc
def test_a_packed_catalog_serves_strictly_from_a_wheel_a_directory_and_a_tarball(golden, tmp_path):
    catalog = _catalog(tmp_path)
    build_env, ran = hidden_nvcc_env(tmp_path)  # packing a warmed cache needs no nvcc either
    out = tmp_path / "out"
    proc = run_cli("pack", catalog, "-o", out, "--name", "tiny", "--pkg-version", "2.1.0",
                   "--cache-dir", golden.copy(tmp_path / "build-cache"), env=build_env)
    assert proc.returncode == 0, proc.stderr
    wheel = out / "attnjit_kernels_tiny-2.1.0-py3-none-any.whl"
    layer, tar = out / "attnjit-kernels-tiny", out / "attnjit-kernels-tiny-2.1.0.tar.gz"
    assert proc.stdout.splitlines() == [f"wrote {p} (3 kernels)" for p in (layer, tar, wheel)]
    assert not ran.exists()

    # the wheel is well formed: every file's RECORD hash matches, and it registers its layer
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        record = zf.read("attnjit_kernels_tiny-2.1.0.dist-info/RECORD").decode().splitlines()
        for line in record:
            path, digest, size = line.rsplit(",", 2)
            if digest:
                data = zf.read(path)
                assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(
                    b"=").decode() and int(size) == len(data)
        assert {ln.split(",")[0] for ln in record} == set(names)
        assert zf.read("attnjit_kernels_tiny-2.1.0.dist-info/entry_points.txt").decode() == \
            "[attnjit.cache_layers]\ntiny = attnjit_kernels_tiny\n"
    assert sum(n.endswith("/kernel.cubin") for n in names) == 3

    # a fresh environment: no nvcc, no writable cache, attnjit from this tree, the wheel installed with pip
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = str(venv / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", str(wheel)], check=True,
                   timeout=300, capture_output=True)
    absent_root = tmp_path / "no-root-here"
    env, ran = hidden_nvcc_env(tmp_path, ATTNJIT_JIT="0", ATTNJIT_CACHE_DIR=str(absent_root), ATTNJIT_PACKAGES="1")
    env.pop("ATTNJIT_CACHE_PATH", None)
    rows = _serve(python, catalog, env, tmp_path)
    site_layer = next(venv.glob("lib/python*/site-packages/attnjit_kernels_tiny/layer"))
    assert rows == [["disk", str(site_layer)]] * 3
    # the same interpreter outside the venv knows nothing of it: the package is what made the hits
    proc = subprocess.run([sys.executable, "-c", SERVE, str(catalog)], env=env, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode != 0 and "CacheMissError" in proc.stderr
    # ATTNJIT_PACKAGES=0 turns the package off
    proc = subprocess.run([python, "-c", SERVE, str(catalog)], env={**env, "ATTNJIT_PACKAGES": "0"},
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode != 0 and "CacheMissError" in proc.stderr

    # the plain directory and the tarball are layers for ATTNJIT_CACHE_PATH
    unpacked = tmp_path / "image"
    with tarfile.open(tar) as tf:
        tf.extractall(unpacked, filter="data")
    for where in (layer, unpacked / "attnjit-kernels-tiny"):
        rows = _serve(sys.executable, catalog, {**env, "ATTNJIT_CACHE_PATH": str(where), "ATTNJIT_PACKAGES": "0"},
                      tmp_path)
        assert rows == [["disk", str(where)]] * 3
    assert not absent_root.exists() and not ran.exists()
    index = json.loads((layer / "attnjit-layer.json").read_text())
    assert index["name"] == "tiny" and index["version"] == "2.1.0" and len(index["kernels"]) == 3


def _installed(site: Path, dist: str, entry_points: str, monkeypatch) -> None:
    """A distribution ``dist`` on sys.path with this entry_points.txt (kernel packages are looked for)."""
    info = site / f"{dist}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(entry_points)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("ATTNJIT_PACKAGES", "1")


def test_finding_a_package_layer_runs_none_of_its_code_even_under_a_dotted_name(tmp_path, monkeypatch):
    from attnjit import pack

    (tmp_path / "vendor" / "kernels" / "layer").mkdir(parents=True)
    (tmp_path / "vendor" / "__init__.py").write_text("raise RuntimeError('vendor/__init__.py ran')\n")
    (tmp_path / "vendor" / "kernels" / "__init__.py").write_text("raise RuntimeError('kernels/__init__.py ran')\n")
    _installed(tmp_path, "vendor_kernels", f"[{pack.ENTRY_POINT_GROUP}]\nv = vendor.kernels\n", monkeypatch)
    assert tmp_path / "vendor" / "kernels" / "layer" in pack.installed_layers()
    assert "vendor" not in sys.modules


def test_another_distributions_malformed_entry_points_do_not_break_finding_layers(tmp_path, monkeypatch):
    from attnjit import pack
    from attnjit.cache import Cache

    (tmp_path / "attnjit_kernels_ok" / "layer").mkdir(parents=True)
    _installed(tmp_path, "attnjit_kernels_ok", f"[{pack.ENTRY_POINT_GROUP}]\nok = attnjit_kernels_ok\n", monkeypatch)
    _installed(tmp_path, "unrelated", "[console_scripts]\na line with no equals sign\n", monkeypatch)
    assert tmp_path / "attnjit_kernels_ok" / "layer" in Cache(tmp_path / "root").layers


def test_pack_refuses_to_package_a_failed_build(tmp_path):
    failing = write_script(tmp_path / "nvcc", 'case " $* " in *" --version "*) echo "release 13.0, V13.0.88"; '
                                               'exit 0;; esac\necho "kernel.cu(1): error: no" >&2\nexit 2\n')
    proc = run_cli("pack", "--spec", MERGE_FP16.as_flags(), "-o", tmp_path / "out", "--cache-dir", tmp_path / "c",
                   env=dict(os.environ, ATTNJIT_NVCC=str(failing)))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == "attnjit: error: 1 spec(s) failed to build; nothing was packed"
    assert not (tmp_path / "out").exists()


def test_pack_refuses_an_entry_whose_manifest_names_no_source(tmp_path):
    from attnjit import jit
    from attnjit.cache import CACHE_FORMAT_VERSION

    key = jit.job_for(MERGE_FP16).key
    d = tmp_path / "c" / key[:2] / key
    d.mkdir(parents=True)
    (d / "kernel.cubin").write_bytes(b"\x7fELF")
    (d / "manifest.json").write_text(json.dumps({"key": key, "format": CACHE_FORMAT_VERSION,
                                                 "cubin_sha256": hashlib.sha256(b"\x7fELF").hexdigest()}))
    proc = run_cli("pack", "--spec", MERGE_FP16.as_flags(), "-o", tmp_path / "out", "--cache-dir", tmp_path / "c")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (f"attnjit: error: ValueError: entry {d}: its manifest.json names "
                                                    "no key_inputs.source_sha256 and arch; nothing was packed")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args,words", [
    (("pack", "--spec", "op=merge_state,head_dim=64,dtype=fp16"), "the following arguments are required: -o"),
    (("pack", "--spec", "op=merge_state,head_dim=64,dtype=fp16", "-o", "x", "--format", "zip"),
     "argument --format: 'zip': expected a comma-separated list of wheel, dir, tar"),
    (("pack", "--spec", "op=merge_state,head_dim=64,dtype=fp16", "-o", ""), "an empty"),
    (("pack", "--spec", "op=merge_state,head_dim=64,dtype=fp16", "-o", "x", "--name", 'x"""; import os; """'),
     "is not a package name"),
    (("pack", "--spec", "op=merge_state,head_dim=64,dtype=fp16", "-o", "x", "--name", "good\n[console_scripts]"),
     "is not a package name"),
])
def test_bad_pack_arguments_are_one_error_line(tmp_path, args, words):
    proc = run_cli(*args)
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("attnjit: error: ") and words in line


# --- catalogs in the package ------------------------------------------------------------------------------------

def test_shipped_catalogs_are_named_and_the_old_paths_still_work(tmp_path):
    import attnjit

    shipped = Path(attnjit.__file__).parent / "catalogs"
    assert sorted(p.name for p in shipped.glob("*.toml")) == ["default.toml", "llama-example.toml"]
    for name in ("default", "llama-example"):
        assert load_catalog(REPO / "specs" / f"{name}.toml") == load_catalog(shipped / f"{name}.toml")
    proc = run_cli("catalog", "list")
    assert proc.returncode == 0
    counts = {name: len(load_catalog(shipped / f"{name}.toml")) for name in ("default", "llama-example")}
    assert [ln.split()[:2] for ln in proc.stdout.splitlines()] == [[n, str(c)] for n, c in counts.items()]
    proc = run_cli("catalog", "list", "extra")   # an argument list ignores would look like a filter that matched
    assert proc.returncode == 2 and "catalog list takes no file" in proc.stderr and proc.stdout == ""
    by_name, by_path = run_cli("render", "default"), run_cli("render", REPO / "specs" / "default.toml")
    assert by_name.returncode == 0 and by_name.stdout == by_path.stdout
    assert by_name.stdout.count("// ===== ") == counts["default"]
    proc = run_cli("warm", "no-such-catalog", "--cache-dir", tmp_path / "c")
    assert proc.returncode == 1 and "no catalog of that name ships with attnjit (shipped: default, llama-example" \
        in proc.stderr
    # a file of that name in the working directory wins over the shipped catalog
    (tmp_path / "default").write_text('[[spec]]\nop = "merge_state"\nhead_dim = 64\ndtype = "fp16"\n')
    proc = subprocess.run([sys.executable, "-m", "attnjit", "render", "default"], capture_output=True, text=True,
                          cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=60)
    assert proc.returncode == 0 and proc.stdout.count("// ===== ") == 1


def test_a_catalog_whose_file_name_is_no_package_name_is_refused_before_any_build(tmp_path):
    cat = tmp_path / 'x"; import os; "'
    cat.mkdir()
    toml = cat / 'evil"name.toml'
    toml.write_text('[[spec]]\nop = "merge_state"\nhead_dim = 64\ndtype = "fp16"\n')
    proc = run_cli("pack", toml, "-o", tmp_path / "out", "--cache-dir", tmp_path / "c")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "is not a package name" in proc.stderr
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").rglob("*.cubin"))
    assert not (tmp_path / "out").exists()


def test_the_package_data_lists_the_catalogs():
    text = (REPO / "pyproject.toml").read_text()
    assert '"catalogs/*.toml"' in text


def test_the_docs_list_every_setting_and_the_license_is_apache():
    from attnjit import knobs

    settings = (REPO / "docs" / "settings.md").read_text()
    rows = [ln.split("|")[1].strip().strip("`") for ln in settings.splitlines() if ln.startswith("| `")]
    assert rows == [k.name for k in knobs.ALL], "docs/settings.md and attnjit/knobs.py list other settings"
    for doc in ("deployment.md", "cli.md", "settings.md"):
        assert f"docs/{doc}" in (REPO / "README.md").read_text()
    license_text = (REPO / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text and 'license = { text = "Apache-2.0" }' in \
        (REPO / "pyproject.toml").read_text()


def test_an_artifact_appears_whole_or_not_at_all_and_is_never_overwritten(tmp_path, monkeypatch):
    """Each artifact is written under a temporary name and renamed into place: a failure while writing leaves
    neither a partial artifact nor the temporary one; an existing artifact is an error, not overwritten."""
    from attnjit import pack as pk

    files = {"index.json": b"{}", "ab/manifest.json": b"{}"}
    def broken(dest, top, files):
        Path(dest).write_bytes(b"partial")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(pk, "_write_tar", broken)
    with pytest.raises(OSError, match="No space left"):
        pk.write_tar(tmp_path / "k.tar.gz", "k", files)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    pk.write_tar(tmp_path / "k.tar.gz", "k", files)
    with pytest.raises(FileExistsError, match="exists; remove it or choose another -o"):
        pk.write_tar(tmp_path / "k.tar.gz", "k", files)
    pk.write_dir(tmp_path / "layer", files)
    assert (tmp_path / "layer" / "ab" / "manifest.json").read_bytes() == b"{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.tar.gz", "layer"]
