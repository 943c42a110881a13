"""Whether a cache root is attnjit's own: the one rule every step that removes something from the root rests on.

Building cleans up stale build directories and the trash, moves away shard names that are not directories, and
``attnjit cache clear`` / ``prune`` remove entries and failed-build logs: all of it assumes that what lies in the root
was written by attnjit. A root pointed by mistake at a directory of the user's (``--cache-dir .``, ``$HOME``) would lose
the user's files. So a root holds ``CACHEDIR.TAG`` (https://bford.info/cachedir/, which backup tools also honour),
written when the root is first used while empty, or while it holds only what attnjit writes (a cache of an attnjit
that predates the tag); a root that holds anything else and no tag is refused before anything is written or removed.
"""

from __future__ import annotations

import re
import stat
from pathlib import Path

from .errors import CacheError

TAG = "CACHEDIR.TAG"
TAG_TEXT = ("Signature: 8a477f597d28d172789f06886806bc55\n"
            "# This directory is attnjit's kernel cache; see https://bford.info/cachedir/\n")
_WORK = frozenset({".tmp", ".locks", ".trash", "failed", "tuning", TAG})   # what attnjit writes besides the shards
_SHARD = re.compile(r"[0-9a-f]{2}")


def foreign_names(root: Path) -> list[str]:
    """The names in ``root`` that attnjit does not write. A shard name counts as a directory or a symlink (a bad
    shard is moved away as a link, never followed); as a file it may be the user's, which the move would lose."""
    out = []
    for p in sorted(root.iterdir()):
        name = p.name
        if name in _WORK:
            continue
        if _SHARD.fullmatch(name) and stat.S_IFMT(p.lstat().st_mode) in (stat.S_IFDIR, stat.S_IFLNK):
            continue
        out.append(name)
    return out


def claim(root: Path, *, write: bool = True) -> None:
    """Make sure ``root`` (an existing directory, already checked as ours by the trust rules) is attnjit's cache:
    it holds the tag, or it is tagged now (``write``) where it holds nothing attnjit did not write; else CacheError,
    before anything is touched."""
    tag = root / TAG
    try:
        if stat.S_ISREG(tag.lstat().st_mode):
            return
    except FileNotFoundError:
        pass
    foreign = foreign_names(root)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise CacheError(f"cache root {root} holds {shown}, which attnjit did not write, and no {TAG}: attnjit removes "
                         "what it does not recognise in its own root (stale builds, bad entries, failed logs), so it "
                         "will not use a directory that is not its own. Point ATTNJIT_CACHE_DIR (or --cache-dir) at a "
                         f"new or empty directory (or, if this is an attnjit cache, add its {TAG})")
    if write:   # (a write cut short still leaves a regular file of that name, which is all the check asks)
        tag.write_text(TAG_TEXT, encoding="utf-8")
