"""The JIT path from a spec to a binary in the cache: render, key, look up, build on a miss.

``ensure`` serves the runtime (one spec, honouring strict mode); ``warm`` serves pre-warming (many specs, built in
parallel, failures reported per spec). Render, key and lookup never run nvcc: a host without the toolkit serves
every warmed kernel, and a miss there is a ``CacheMissError`` that says nvcc is missing.
"""

from __future__ import annotations

import re
import shlex
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from . import knobs
from .cache import BuildResult, Cache, Entry, Job
from .errors import CacheMissError, CompileError, NvccNotFoundError
from .generator import render
from .specs import AttentionSpec
from .toolchain import flags_for
from .variants import HOOK_VARIABLES

_SNIPPET_ERROR = re.compile(r'variant (\w+): (\w+)\((\d+)\): error: (.*)')
_UNDEFINED = re.compile(r'identifier "(\w+)" is undefined')


def explain(error: CompileError) -> CompileError:
    """Point a failure inside a variant's snippet at the variant, the hook and the snippet's line, and for an
    unknown name list the names the hook can use."""
    spec = error.spec
    if not isinstance(spec, AttentionSpec) or spec.variant is None:
        return error
    m = _SNIPPET_ERROR.search(error.log)
    if not m:
        return error
    part_name, hook, line, what = m.groups()
    first = f"variant {part_name!r}, {hook} line {line}: {what}"
    undefined = _UNDEFINED.search(what)
    if undefined:
        part = next((p for p in spec.variant.parts if p.name == part_name), None)
        params = [n for n, _ in part.params] if part is not None else []
        first += (f" (names {hook} can use: {', '.join(HOOK_VARIABLES.get(hook, ()))}; parameters: "
                  f"{', '.join(params) or 'none'})")
    return CompileError(spec, error.name, first, error.log_path, error.log)


def job_for(spec: AttentionSpec) -> Job:
    """The spec's build job. Its key needs no toolchain: rendering and hashing never run nvcc."""
    rendered = render(spec)
    return Job(source=rendered.source, flags=flags_for(spec.arch), arch=spec.arch, label=spec.short_name(),
               meta={"spec": spec.to_dict()}, context=spec)


def warm_command(spec: AttentionSpec, cache: Cache) -> str | None:
    """The command that warms ``spec`` into ``cache``, or None when no command line can name the spec (its variant
    was declared in ``__main__`` or not at module level: there is no ``module:attribute`` to write)."""
    if spec.variant is not None and spec.variant.ref is None:
        return None
    return f"attnjit warm --spec {shlex.quote(spec.as_flags())} --cache-dir {shlex.quote(str(cache.root))}"


def cache_miss(spec: AttentionSpec, key: str, cache: Cache, *, reason: str = "strict",
               nvcc_tried: tuple[str, ...] = ()) -> CacheMissError:
    """The error for a kernel that cannot be served: with the entries that were refused and the fix."""
    command = warm_command(spec, cache)
    hint = None
    if command is None:
        assert spec.variant is not None
        hint = (f"Its variant {spec.variant.name!r} was declared in __main__ (or not at module level), so no "
                "catalog or --spec can name it: assign it to a module-level name of an importable module (a catalog "
                "then names it variant = \"module:NAME\"), or warm it from that script with attnjit.warm([spec]).")
    bad = tuple((b.dir, b.problem) for b in cache.bad_entries if b.dir.name == key)
    return CacheMissError(spec, key, cache.search_path(), command, bad=bad, reason=reason, nvcc_tried=nvcc_tried,
                          hint=hint)


@dataclass(frozen=True)
class Binary:
    spec: AttentionSpec
    entry: Entry
    how: str                     # disk | built
    compile_ms: float | None     # when built
    lookup_ms: float


def ensure(spec: AttentionSpec, cache: Cache | None = None) -> Binary:
    """The spec's binary: from the cache, else built (unless ATTNJIT_JIT=0, which raises CacheMissError)."""
    cache = cache or Cache()
    t0 = time.perf_counter()
    job = job_for(spec)
    entry = cache.lookup(job.key)
    if entry is not None:
        return Binary(spec, entry, "disk", None, (time.perf_counter() - t0) * 1e3)
    if not knobs.JIT.get():
        raise cache_miss(spec, job.key, cache)
    try:
        (result,) = cache.build([job])
    except NvccNotFoundError as exc:
        raise cache_miss(spec, job.key, cache, reason="no-nvcc", nvcc_tried=tuple(exc.tried)) from None
    if result.status == "failed":
        assert result.error is not None
        raise explain(result.error)
    assert result.entry is not None
    compile_ms = result.seconds * 1e3 if result.status == "built" and result.seconds is not None else None
    return Binary(spec, result.entry, "built" if result.status == "built" else "disk", compile_ms,
                  (time.perf_counter() - t0) * 1e3)


def warm(specs: Sequence[AttentionSpec], cache: Cache | None = None, *, parallel: int | None = None,
         progress: Callable[[str], None] | None = None) -> list[BuildResult]:
    """Build every spec that is not cached yet; one result per spec, in order."""
    cache = cache or Cache()
    results = cache.build([job_for(s) for s in specs], parallel=parallel, progress=progress)
    for r in results:
        if r.error is not None:
            r.error = explain(r.error)
    return results
