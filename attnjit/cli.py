"""The ``attnjit`` command: warm, cache, info, render, catalog.

Every subcommand exits non-zero with one clear line on failure (``attnjit: error: ...``); an unexpected exception
is not swallowed (it propagates with its traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import warnings
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

from . import knobs
from .build import restore_signals
from .cache import Cache, dir_bytes, printable
from .pack import FORMATS
from .errors import AttnjitError, CatalogError
from .specs import (DEFAULT_ARCH, MAX_CATALOG_SPECS, AttentionSpec, SpecError, dump_catalog, load_catalog,
                    specs_from_log, write_catalog)


def _err(msg: str) -> None:
    print(f"attnjit: error: {msg}", file=sys.stderr)


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


CATALOGS = Path(__file__).resolve().parent / "catalogs"


def shipped_catalogs() -> list[str]:
    return sorted(p.stem for p in CATALOGS.glob("*.toml"))


def find_catalog(name: str) -> Path:
    """A catalog file path, or the name of a catalog shipped in the package (``default``): a file wins."""
    path = Path(name)
    if path.exists() or "/" in name or name.endswith(".toml"):
        return path
    shipped = CATALOGS / f"{name}.toml"
    if shipped.is_file():
        return shipped
    raise CatalogError(name, None, None, f"no catalog file of that name here, and no catalog of that name ships "
                       f"with attnjit (shipped: {', '.join(shipped_catalogs())}; see attnjit catalog list)")


def _cache(args) -> Cache:
    return Cache(args.cache_dir) if getattr(args, "cache_dir", None) else Cache()


def _with_arch(text: str, arch: str) -> str:
    """A --spec with ``arch`` where it names none (key=value form or JSON); a key given twice is an error (the last
    would win silently)."""
    if text.lstrip().startswith("{"):
        obj = json.loads(text, object_pairs_hook=_unique_pairs)
        if isinstance(obj, dict) and "arch" not in obj:
            obj["arch"] = arch
        return json.dumps(obj)
    keys = [part.split("=", 1)[0].strip() for part in text.split(",") if part.strip()]
    _refuse_repeats(keys)
    return text if "arch" in keys else f"{text},arch={arch}"


def _unique_pairs(pairs: list) -> dict:
    _refuse_repeats([k for k, _ in pairs])
    return dict(pairs)


def _refuse_repeats(keys: list[str]) -> None:
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise ValueError(f"{', '.join(twice)} given more than once")


def _specs(args) -> list[AttentionSpec]:
    """The specs of the catalogs and --spec options, each spec that names no arch once per target arch."""
    from .arch import build_archs

    archs, _source = build_archs(args.arch)
    specs: dict[AttentionSpec, None] = {}  # ordered, de-duplicated in O(1) per spec
    for path in args.catalogs:
        for arch in archs:
            specs.update(dict.fromkeys(load_catalog(find_catalog(path), arch=arch, max_specs=args.max_specs)))
    for text in args.spec or []:
        if not text.strip():
            raise CatalogError("--spec", None, None, "empty spec; expected key=value,... such as "
                               "op=decode,head_dim=128,page_size=16,dtype=bf16")
        for arch in archs:
            try:
                s = AttentionSpec.parse(_with_arch(text, arch))
            except (SpecError, ValueError) as exc:
                raise CatalogError("--spec", None, getattr(exc, "field", None), str(exc)) from None
            except TypeError as exc:  # a JSON object without op
                raise CatalogError("--spec", None, None, f"{exc}; expected key=value,... with op=...") from None
            specs.setdefault(s)
    if not specs:
        raise CatalogError("(command line)", None, None, "no specs: give a catalog file or --spec key=value,...")
    return list(specs)


def _size(text: str) -> int:
    from .maintenance import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _arch_list(text: str) -> str:
    from .arch import parse_arch_list

    try:
        return ",".join(parse_arch_list(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--arch: ")) from None


def _formats(text: str) -> str:
    chosen = [f.strip() for f in text.split(",") if f.strip()]
    bad = [f for f in chosen if f not in FORMATS]
    if bad or not chosen:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list of {', '.join(FORMATS)}")
    return ",".join(chosen)


def _out_dir(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty -o names no directory")
    return text


def _pack_name(text: str) -> str:
    from .pack import check_name

    try:
        return check_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(text: str, what: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of {what}, got {text!r}")
    return n


def _max_specs(text: str) -> int:
    return _positive(text, "specs")


def _jobs(text: str) -> int:
    return _positive(text, "parallel nvcc jobs")


def _cache_dir(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty --cache-dir names no directory; leave the option out for "
                                         "ATTNJIT_CACHE_DIR or ~/.cache/attnjit")
    return text


@contextmanager
def _interruptible(caught: dict[str, str]):
    """SIGTERM behaves as SIGINT (a KeyboardInterrupt, so builds stop their compilers and keep what finished);
    ``caught["signal"]`` names the one that arrived."""
    def handler(signum, _frame):
        caught["signal"] = signal.Signals(signum).name
        raise KeyboardInterrupt

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        restore_signals(old)


_SIGNAL_EXIT = {"SIGINT": 130, "SIGTERM": 143}


def run_build(args, specs: list[AttentionSpec], cache: Cache) -> tuple[list, str | None, float]:
    """Warm ``specs`` with the progress the flags ask for: (results, the signal that interrupted it or None, s)."""
    from .cache import BuildInterrupted
    from .jit import warm
    from .progress import reporter

    rep = reporter(quiet=args.quiet, as_json=args.json)
    caught: dict[str, str] = {}
    t0 = time.monotonic()
    rep.begin(len(specs), cache.root)
    try:
        with _interruptible(caught):
            try:
                results, stopped = warm(specs, cache, parallel=args.jobs, progress=rep.event), None
            except BuildInterrupted as exc:
                results, stopped = exc.results, caught.get("signal", "SIGINT")
    finally:
        rep.close()
    if not args.json:
        for r in results:
            if r.status == "failed" and r.error is not None:
                _err(f"{r.job.label}: {r.error.first_error} (log: {r.error.log_path})")
    return results, stopped, time.monotonic() - t0


def cmd_warm(args) -> int:
    from .progress import counts, summary_line

    specs = _specs(args)
    results, stopped, seconds = run_build(args, specs, _cache(args))
    if args.json:
        print(json.dumps({"event": "summary", "specs": len(specs), **counts(results), "seconds": round(seconds, 1),
                          "interrupted": stopped,
                          "failures": [{"label": r.job.label, "error": r.error.first_error,
                                        "log": str(r.error.log_path)}
                                       for r in results if r.status == "failed" and r.error is not None]},
                         separators=(",", ":")))
    else:
        print(summary_line(len(specs), results, seconds, stopped), flush=True)
    if stopped:
        return _SIGNAL_EXIT.get(stopped, 130)
    return 1 if counts(results)["failed"] else 0


def cmd_pack(args) -> int:
    from .pack import Packed, check_name, pack
    from .progress import counts, summary_line

    name = args.name or (Path(args.catalogs[0]).stem if args.catalogs else "kernels")
    check_name(name)   # before any build (a catalog's file name is the default)
    specs = _specs(args)
    cache = _cache(args)
    results, stopped, seconds = run_build(args, specs, cache)
    if not args.json:
        print(summary_line(len(specs), results, seconds, stopped), file=sys.stderr, flush=True)
    if stopped:
        return _SIGNAL_EXIT.get(stopped, 130)
    if counts(results)["failed"]:
        _err(f"{counts(results)['failed']} spec(s) failed to build; nothing was packed")
        return 1
    items = list({r.entry.key: Packed(r.entry, r.job.source, r.job.context.canonical())
                  for r in results if r.entry is not None}.values())
    written = pack(items, Path(args.output), name=name, version=args.pkg_version,
                   formats=tuple(args.format.split(",")))
    for path in written:
        if args.json:
            print(json.dumps({"event": "packed", "path": str(path), "kernels": len(items)}))
        else:
            print(f"wrote {path} ({len(items)} kernels)")
    return 0


def cmd_cache(args) -> int:
    from .maintenance import clear, format_size, prune

    cache = _cache(args)
    if args.action == "list":
        rows, total, bad = [], 0, 0
        for base, key, entry, problem in cache.iter_entries():
            where = "root" if base == cache.root else f"layer {base}"
            size = dir_bytes(cache.row_dir(base, key))
            total += size
            if entry is None:
                bad += 1
                rows.append((where != "root", "", key, printable(f"{key[:16]}  BAD ({problem})  {where}")))
            else:
                m = entry.manifest
                rows.append((where != "root", m.get("label", "?"), key, printable(
                             f"{key[:16]}  {m.get('label', '?'):<52} {size / 1024:8.1f} KiB  {entry.toolchain:<20} "
                             f"{m.get('compile_seconds', 0):6.1f} s  {m.get('created', '?')}  {where}")))
        for *_, line in sorted(rows, key=lambda r: r[:3]):  # the root first, then by label
            print(line)
        print(f"{len(rows)} entries, {format_size(total)}" + (f", {bad} bad" if bad else ""))
        return 0
    if args.action == "verify":
        total = bad = 0
        for base, key, entry, problem in cache.iter_entries():
            total += 1
            if entry is None:
                bad += 1
                print(printable(f"BAD {cache.row_dir(base, key)}: {problem}"))
        print(f"{total} entries checked, {bad} bad")
        return 1 if bad else 0
    verb = "would remove" if args.dry_run else "removed"
    if args.action == "clear":
        items = clear(cache, dry_run=args.dry_run)
        for item in items if args.dry_run else ():
            print(f"{verb} {item.dir}")
        print(f"{verb} {len(items)} entries from {cache.root}")
        return 0
    if args.action == "prune":
        if args.max_bytes is None and args.built_by is None and not args.keep:
            _err("cache prune needs --max-bytes SIZE (e.g. 500M), --built-by TOOLCHAIN (see attnjit cache list) or "
                 "--keep CATALOG")
            return 2
        keep = None
        if args.keep:  # the keys the catalogs build now (rendered and hashed: no nvcc runs)
            from .jit import job_for

            specs = _specs(SimpleNamespace(catalogs=args.keep, spec=None, arch=args.arch, max_specs=args.max_specs))
            keep = frozenset(job_for(s).key for s in specs)
        removed, remaining = prune(cache, args.max_bytes, built_by=args.built_by, keep=keep, dry_run=args.dry_run)
        for item in removed if args.dry_run else ():
            print(f"{verb} {item.dir}")
        print(f"{verb} {len(removed)} entries; {remaining} bytes ({format_size(remaining)}) remain in {cache.root}")
        return 0
    raise AssertionError(args.action)


def _info(args) -> dict:
    from . import __version__
    from .toolchain import nvcc

    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    info: dict = {"attnjit": __version__, "python": sys.version.split()[0],
                  "packages": {p: version(p) for p in ("torch", "cupy-cuda13x", "jinja2", "ninja", "filelock", "rich")}}
    try:
        tc = nvcc()
        info["nvcc"] = {"path": str(tc.path), "release": tc.release, "id": tc.ident,
                        "version": tc.version.splitlines()[-1] if tc.version else ""}
    except AttnjitError as exc:
        info["nvcc"] = {"error": str(exc)}
    from .arch import build_archs, local_archs

    info["gpu_archs"] = local_archs()
    try:
        archs, source = build_archs(None)
        info["warm_archs"] = {"archs": archs, "from": source}
    except ValueError as exc:
        info["warm_archs"] = {"error": str(exc)}
    cache = _cache(args)
    info["cache"] = {"root": str(cache.root), "writable": cache.root_writable(),
                     "layers": [str(p) for p in cache.layers], "stats": cache.stats()}
    info["strict"] = not knobs.JIT.get()
    from .ops import scheduler

    info["compiled_scheduler"] = {"built": scheduler._cplan is not None,
                                  "path": getattr(scheduler._cplan, "__file__", None)}
    info["settings"] = [k.describe() for k in knobs.ALL]
    return info


def cmd_info(args) -> int:
    info = _info(args)
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(f"attnjit {info['attnjit']}  python {info['python']}")
    for pkg, ver in info["packages"].items():
        print(f"  {pkg:<14} {ver or 'not installed'}")
    tc = info["nvcc"]
    if "error" in tc:
        print(f"nvcc: not found ({tc['error']})")
    else:
        print(f"nvcc: {tc['path']} (release {tc['release']})")
        print(f"  {tc['version']}")
    print(f"gpus: {', '.join(info['gpu_archs']) or 'none'}")
    wa = info["warm_archs"]
    print(f"warm arch: {', '.join(wa['archs'])} (from {wa['from']})" if "archs" in wa else f"warm arch: {wa['error']}")
    c = info["cache"]
    print(f"cache root: {c['root']} ({'writable' if c['writable'] else 'read-only'})")
    print(f"cache layers: {', '.join(c['layers']) or '(none; set ATTNJIT_CACHE_PATH)'}")
    for base, st in c["stats"].items():
        print(f"  {base}: {st['entries']} entries, {st['bytes'] / 1024:.1f} KiB"
              + ("" if st["exists"] else " (absent)"))
    print(f"strict mode (ATTNJIT_JIT=0): {'on' if info['strict'] else 'off'}")
    cs = info["compiled_scheduler"]
    print(f"compiled scheduler (attnjit._cplan): {cs['path'] if cs['built'] else 'not built (plans in Python)'}")
    print("settings (value, where it comes from):")
    for k in info["settings"]:
        value = k["value"] if "error" not in k else f"INVALID ({k['error']})"
        shown = "unset" if value is None or value == [] else value
        print(f"  {k['name']:<22} {str(shown):<28} {k['source']:<8} {k['meaning']}")
    return 0


def cmd_render(args) -> int:
    from .generator import render

    for spec in _specs(args):
        print(f"// ===== {spec.canonical()}")
        sys.stdout.write(render(spec).source)
    return 0


def cmd_catalog(args) -> int:
    if args.action == "list":
        if args.log is not None or args.output is not None:
            _err("catalog list takes no file (it lists the catalogs shipped with attnjit)")
            return 2
        for name in shipped_catalogs():
            path = CATALOGS / f"{name}.toml"
            first = next((ln.lstrip("# ").strip() for ln in path.read_text().splitlines() if ln.startswith("#")), "")
            print(f"{name:<16} {len(load_catalog(path)):4d} specs  {first}")
        return 0
    if args.log is None:
        _err("catalog from-log needs the JSONL file ATTNJIT_LOG wrote")
        return 2
    path = Path(args.log)
    try:
        specs = specs_from_log(path)
    except OSError as exc:
        _err(f"cannot read {path}: {exc.strerror or exc}")
        return 1
    except ValueError as exc:
        _err(str(exc))
        return 1
    text = dump_catalog(specs, header=f"Specs dispatched in {path.name} ({len(specs)}), written by attnjit catalog "
                                      "from-log.\nPre-warm with: attnjit warm <this file>")
    if args.output and args.output != "-":
        try:
            write_catalog(Path(args.output), text)
        except (OSError, ValueError) as exc:
            _err(f"cannot write {args.output}: {getattr(exc, 'strerror', None) or exc}")
            return 1
        print(f"wrote {len(specs)} specs to {args.output}")
    else:
        sys.stdout.write(text)
    return 0


class _Parser(argparse.ArgumentParser):
    """Usage mistakes are one line too: ``attnjit: error: ...`` and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"attnjit: error: {message} (see {self.prog} --help)\n")


def _shape(text: str) -> tuple[int, int]:
    try:
        batch, length = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BATCHxLENGTH such as 8x2048, got {text!r}") from None
    if batch < 1 or length < 1 or batch * length > 1 << 24:
        raise argparse.ArgumentTypeError(f"expected a positive BATCHxLENGTH of at most 2^24 tokens, got {text!r}")
    return batch, length


def cmd_tune(args) -> int:
    from .tune import tune

    specs = _specs(args)
    cache = _cache(args)
    batch, length = args.shape
    rows = []
    for spec in specs:
        outcome = tune(spec, batch=batch, length=length, reps=args.reps, cache=cache,
                       say=(lambda _m: None) if args.json else _progress)
        rows.append({"spec": outcome.spec.short_name(), "best": outcome.best,
                     "ms": {k: round(v, 4) for k, v in outcome.ms.items()}, "note": outcome.note})
        if not args.json:
            if outcome.best is None:
                print(f"{outcome.spec.short_name()}: {outcome.note}")
            else:
                times = ", ".join(f"{k} {v:.4f} ms" for k, v in outcome.ms.items())
                print(f"{outcome.spec.short_name()}: {outcome.best} ({times}); recorded in {cache.root / 'tuning'}")
    if args.json:
        print(json.dumps({"shape": f"{batch}x{length}", "results": rows}, separators=(",", ":")))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = _Parser(prog="attnjit", description="JIT attention kernels: pre-warm, inspect, render, package.")
    parser.add_argument("--version", action="version", version=f"attnjit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def build_args(p):
        p.add_argument("--jobs", "-j", type=_jobs, help="parallel nvcc jobs, >= 1 (default: ATTNJIT_JOBS or CPU count)")
        shown = p.add_mutually_exclusive_group()
        shown.add_argument("--quiet", "-q", action="store_true", help="print only errors and the summary line")
        shown.add_argument("--json", action="store_true", help="one JSON object per line on stdout, for machines")

    def spec_args(p):
        p.add_argument("catalogs", nargs="*",
                       help="catalog TOML files, or names of catalogs shipped with attnjit (default; see attnjit "
                            "catalog list)")
        p.add_argument("--spec", action="append", help="a spec as key=value,... (repeatable)")
        p.add_argument("--arch", type=_arch_list,
                       help="target arch(s) for specs that name none, e.g. sm_90a or sm_80,sm_90a (default: "
                            "ATTNJIT_ARCH_OVERRIDE, else the local GPUs' archs, else ATTNJIT_ARCH, else "
                            f"{DEFAULT_ARCH})")
        p.add_argument("--max-specs", type=_max_specs, default=MAX_CATALOG_SPECS,
                       help=f"refuse catalogs that expand to more specs than this (default {MAX_CATALOG_SPECS:,})")

    p = sub.add_parser("warm", help="compile every spec of the catalogs into the cache")
    spec_args(p)
    build_args(p)
    p.add_argument("--cache-dir", type=_cache_dir, help="cache root (default ATTNJIT_CACHE_DIR or ~/.cache/attnjit)")
    p.set_defaults(fn=cmd_warm)

    p = sub.add_parser("cache", help="list, verify, clear or prune the cache")
    p.add_argument("action", choices=["list", "verify", "clear", "prune"])
    p.add_argument("--max-bytes", type=_size, help="prune: keep at most this much (bytes, or 500M, 2G: binary units)")
    p.add_argument("--built-by", metavar="TOOLCHAIN",
                   help="prune: remove the entries this toolchain built (an id from cache list: 'nvcc 13.0 V13.0.88', "
                        "V13.0.88 or 13.0)")
    p.add_argument("--keep", action="append", metavar="CATALOG",
                   help="prune: remove every entry these catalogs (files or shipped names; repeatable) do not build "
                        "now, e.g. the kernels of an older attnjit or of specs no longer listed")
    p.add_argument("--arch", type=_arch_list, help="prune --keep: the target arch(s) of specs that name none, as for "
                                                    "warm")
    p.add_argument("--max-specs", type=_max_specs, default=MAX_CATALOG_SPECS, help=argparse.SUPPRESS)
    p.add_argument("--dry-run", action="store_true", help="clear/prune: list what would be removed, remove nothing")
    p.add_argument("--cache-dir", type=_cache_dir, help="cache root")
    p.set_defaults(fn=cmd_cache)

    p = sub.add_parser("info", help="versions, nvcc, arch, cache root and layers, every setting and its source")
    p.add_argument("--cache-dir", type=_cache_dir, help="cache root")
    p.add_argument("--json", action="store_true", help="the same as one JSON object")
    p.set_defaults(fn=cmd_info)

    p = sub.add_parser("render", help="print the CUDA source of each spec")
    spec_args(p)
    p.set_defaults(fn=cmd_render)

    p = sub.add_parser("pack", help="warm catalogs and package their kernels: a wheel, a layer directory, a tarball")
    spec_args(p)
    build_args(p)
    p.add_argument("-o", "--output", required=True, type=_out_dir, metavar="DIR", help="where the packages go")
    p.add_argument("--name", type=_pack_name,
                   help="package name: letters, digits and _ . - (default: the first catalog's name)")
    p.add_argument("--pkg-version", default="1.0.0", help="the packages' version (default 1.0.0)")
    p.add_argument("--format", type=_formats, default=",".join(FORMATS),
                   help=f"comma-separated, any of {', '.join(FORMATS)} (default all)")
    p.add_argument("--cache-dir", type=_cache_dir, help="cache root to warm into and pack from")
    p.set_defaults(fn=cmd_pack)

    p = sub.add_parser("tune", help="on a GPU: time each tile configuration of the specs, record the fastest")
    spec_args(p)
    p.add_argument("--shape", type=_shape, default=(8, 2048), metavar="BATCHxLENGTH",
                   help="the prefill batch to time (default 8x2048)")
    p.add_argument("--reps", type=_jobs, default=20, help="calls per timed block (default 20)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--cache-dir", type=_cache_dir, help="cache root (its tuning/ folder gets the records)")
    p.set_defaults(fn=cmd_tune)

    p = sub.add_parser("catalog", help="turn a dispatch log (ATTNJIT_LOG) into a spec catalog; list shipped ones")
    p.add_argument("action", choices=["from-log", "list"], help="from-log: a log to a catalog; list: shipped catalogs")
    p.add_argument("log", nargs="?", help="from-log: the JSONL written by ATTNJIT_LOG")
    p.add_argument("-o", "--output", help="catalog file to write (default stdout)")
    p.set_defaults(fn=cmd_catalog)
    return parser


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning (a bad cache entry, ...) is one line on stderr, not Python's two-line file:line form."""
    print(f"attnjit: warning: {str(message).removeprefix('attnjit: ')}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    shown, warnings.showwarning = warnings.showwarning, _show_warning
    try:
        return args.fn(args)
    except (AttnjitError, CatalogError, SpecError) as exc:
        _err(str(exc).splitlines()[0])
        return 1
    except KeyboardInterrupt:
        _err("interrupted")
        return 130
    except BrokenPipeError:   # `attnjit render ... | head`: the reader is gone; nothing more to say, as cat does
        try:
            sys.stdout = open(os.devnull, "w")   # so that the interpreter's final flush does not raise again
        except OSError:
            pass
        return 141
    except (ValueError, OSError) as exc:
        _err(f"{type(exc).__name__}: {exc}")
        return 1
    finally:
        warnings.showwarning = shown


if __name__ == "__main__":
    sys.exit(main())
