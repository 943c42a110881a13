"""Kernel packages for a fleet: the verified entries of a set of specs as a read-only cache layer, shipped three
ways, and the installed packages attnjit finds by itself.

  * a directory ``attnjit-kernels-NAME/`` (a layer: list it in ``ATTNJIT_CACHE_PATH``, or bake it into an image);
  * the same directory as ``attnjit-kernels-NAME-VERSION.tar.gz``;
  * a wheel ``attnjit_kernels_NAME-VERSION-py3-none-any.whl``: a package holding the layer, registered under the
    ``attnjit.cache_layers`` entry point group. Once it is installed, every ``Cache`` searches it after
    ``ATTNJIT_CACHE_PATH`` (``ATTNJIT_PACKAGES=0`` turns that off). Finding it imports nothing: the layer's
    directory is located from the package's import spec, so no code of the package runs.

Entries are written from what the cache verified (the cubin bytes whose sha256 matched, the source the key was
computed from); every lookup verifies them again (owner, mode, sha256). Files are 0644 and directories 0755:
readable by the serving user, writable by nobody else, so a layer owned by that user or root is trusted.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import io
import json
import os
import re
import shutil
import sys
import tarfile
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from . import __version__, knobs
from .cache import CUBIN, MANIFEST, SOURCE, Entry

ENTRY_POINT_GROUP = "attnjit.cache_layers"
INDEX = "attnjit-layer.json"
FORMATS = ("wheel", "dir", "tar")
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # reproducible archives


@dataclass(frozen=True)
class Packed:
    entry: Entry
    source: str     # the rendered source the key was computed from
    spec: str       # canonical spec


def check_name(name: str) -> str:
    """A pack's name goes into the wheel's module docstring, its entry point and file names: letters, digits, and
    ``_ . -`` inside, at most 100 characters (a quote or a newline would write code or metadata of its own)."""
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,98}[A-Za-z0-9])?", name):
        raise ValueError(f"--name {name!r} is not a package name: use letters, digits and _ . - inside (at most 100 "
                         "characters), e.g. my_model (a catalog's file name is the default: pass --name for one "
                         "that is not)")
    package_name(name)
    return name


def package_name(name: str) -> str:
    """``default`` -> ``attnjit_kernels_default`` (a valid module name)."""
    clean = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    if not clean:
        raise ValueError(f"--name {name!r} has no letters or digits; give a name like my_model")
    return f"attnjit_kernels_{clean}"


def _layer_files(items: list[Packed], name: str, version: str) -> dict[str, bytes]:
    """Relative path -> bytes of a layer holding ``items``, plus its index."""
    files: dict[str, bytes] = {}
    for it in items:
        e = it.entry
        d = f"{e.key[:2]}/{e.key}"
        inputs = e.manifest.get("key_inputs", {})
        if not isinstance(inputs.get("source_sha256"), str) or not isinstance(inputs.get("arch"), str):
            raise ValueError(f"entry {e.dir}: its manifest.json names no key_inputs.source_sha256 and arch; nothing "
                             "was packed")
        if hashlib.sha256(it.source.encode("utf-8")).hexdigest() != inputs["source_sha256"]:
            raise ValueError(f"entry {e.dir}: its manifest names another source than its spec renders")
        files[f"{d}/{CUBIN}"] = e.image
        files[f"{d}/{MANIFEST}"] = json.dumps(e.manifest, indent=1, sort_keys=True).encode("utf-8")
        files[f"{d}/{SOURCE}"] = it.source.encode("utf-8")
    index = {"name": name, "version": version, "attnjit": __version__,
             "kernels": [{"key": it.entry.key, "label": it.entry.manifest.get("label"), "spec": it.spec,
                          "toolchain": it.entry.toolchain, "arch": it.entry.manifest["key_inputs"]["arch"]}
                         for it in items]}
    files[INDEX] = json.dumps(index, indent=1).encode("utf-8")
    return files


@contextmanager
def _published(dest: Path):
    """Write ``dest`` (a file or a directory) under a temporary name beside it and rename it into place only once
    complete: a killed or failed pack leaves no partial artifact under the final name (and no temporary one behind
    on an error). An existing ``dest`` is an error: a pack never overwrites a layer someone may have installed."""
    if dest.exists() or dest.is_symlink():
        raise FileExistsError(f"{dest} exists; remove it or choose another -o")
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.rename(tmp, dest)
    except BaseException:
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def write_dir(dest: Path, files: dict[str, bytes]) -> None:
    with _published(dest) as tmp:
        tmp.mkdir(mode=0o755)
        tmp.chmod(0o755)
        for rel, data in sorted(files.items()):
            path = tmp / rel
            path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            path.parent.chmod(0o755)
            path.write_bytes(data)
            path.chmod(0o644)


def write_tar(dest: Path, top: str, files: dict[str, bytes]) -> None:
    with _published(dest) as tmp:
        _write_tar(tmp, top, files)


def _write_tar(dest: Path, top: str, files: dict[str, bytes]) -> None:
    with tarfile.open(dest, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        dirs = sorted({"/".join(rel.split("/")[:i]) for rel in files for i in range(1, rel.count("/") + 1)})
        for d in [""] + dirs:
            info = tarfile.TarInfo(f"{top}/{d}".rstrip("/"))
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
            tar.addfile(info)
        for rel, data in sorted(files.items()):
            info = tarfile.TarInfo(f"{top}/{rel}")
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def write_wheel(out_dir: Path, name: str, version: str, files: dict[str, bytes], summary: str) -> Path:
    pkg = package_name(name)
    dist = pkg  # the distribution's normalized name, as wheel file names spell it
    info = f"{dist}-{version}.dist-info"
    contents: dict[str, bytes] = {
        f"{pkg}/__init__.py": (f'"""attnjit kernels {name!r} ({len(files) // 3} kernel modules), version {version}: a '
                               'read-only cache layer attnjit finds once this is installed."""\n\nfrom pathlib import '
                               'Path\n\nLAYER = Path(__file__).resolve().parent / "layer"\n').encode(),
        **{f"{pkg}/layer/{rel}": data for rel, data in files.items()},
        f"{info}/METADATA": (f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\nVersion: {version}\n"
                             f"Summary: {summary}\nRequires-Dist: attnjit>={__version__.split('+')[0]}\n").encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: attnjit pack\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{info}/entry_points.txt": f"[{ENTRY_POINT_GROUP}]\n{name} = {pkg}\n".encode(),
    }
    record = [_record_line(p, d) for p, d in contents.items()] + [f"{info}/RECORD,,"]
    contents[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = out_dir / f"{dist}-{version}-py3-none-any.whl"
    with _published(path) as tmp, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
        for rel, data in contents.items():
            zi = zipfile.ZipInfo(rel, date_time=_ZIP_TIME)
            zi.external_attr = (0o100644 << 16)
            zi.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(zi, data)
    return path


def pack(items: list[Packed], out_dir: Path, *, name: str, version: str,
         formats: tuple[str, ...] = FORMATS) -> list[Path]:
    """Write the requested artifacts into ``out_dir``; returns their paths."""
    if not re.fullmatch(r"\d+(\.\d+)*([a-z]+\d*)?(\+[a-z0-9.]+)?", version):
        raise ValueError(f"--pkg-version {version!r} is not a version like 1.0.0 (PEP 440)")
    check_name(name)
    files = _layer_files(items, name, version)
    out_dir.mkdir(parents=True, exist_ok=True)
    top = f"attnjit-kernels-{re.sub(r'[^a-zA-Z0-9]+', '-', name).strip('-')}"
    written = []
    if "dir" in formats:
        write_dir(out_dir / top, files)
        written.append(out_dir / top)
    if "tar" in formats:
        write_tar(out_dir / f"{top}-{version}.tar.gz", top, files)
        written.append(out_dir / f"{top}-{version}.tar.gz")
    if "wheel" in formats:
        archs = sorted({it.entry.manifest["key_inputs"]["arch"] for it in items})
        written.append(write_wheel(out_dir, name, version, files,
                                   f"{len(items)} attnjit attention kernels for {', '.join(archs)}"))
    return written


# --- finding installed kernel packages ----------------------------------------------------------------------

@lru_cache(maxsize=8)
def _installed_layers(path_key: tuple[str, ...]) -> tuple[Path, ...]:
    found = []
    for dist in importlib.metadata.distributions():
        try:
            eps = dist.entry_points.select(group=ENTRY_POINT_GROUP)
        except Exception:  # noqa: BLE001 - another distribution's malformed entry_points.txt: not ours to fail on
            continue
        for ep in eps:
            package = _package_dir(ep.value.split(":")[0].strip())
            if package is not None and (package / "layer").is_dir() and package / "layer" not in found:
                found.append(package / "layer")
    return tuple(found)


def _package_dir(module: str) -> Path | None:
    """Where package ``module`` is, found without running its code: importlib.util.find_spec("a.b") would import
    ``a``, so each part below the top is looked up in its parent's directories instead."""
    parts = module.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])
        for i in range(1, len(parts)):
            if spec is None or not spec.submodule_search_locations:
                return None
            spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:i + 1]),
                                                            list(spec.submodule_search_locations))
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def installed_layers() -> tuple[Path, ...]:
    """The layers of installed kernel packages (``attnjit pack`` wheels), unless ATTNJIT_PACKAGES=0."""
    if not knobs.PACKAGES.get():
        return ()
    return _installed_layers(tuple(sys.path))
