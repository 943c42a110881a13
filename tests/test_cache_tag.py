"""The cache root is attnjit's own (attnjit/cache_tag.py): a directory of the user's, pointed at by mistake, is refused
before anything in it is touched; a new or empty root, or a cache of an attnjit that predates the tag, is tagged."""

from __future__ import annotations

import pytest

from attnjit.cache import Cache
from attnjit.cache_tag import TAG, TAG_TEXT
from attnjit.errors import CacheError


def _project(tmp_path):
    """A user's directory that looks a little like a cache: attnjit's work-folder names holding the user's files, and
    a file named like a shard."""
    root = tmp_path / "project"
    (root / "failed" / "run1").mkdir(parents=True)
    (root / "failed" / "run1" / "r.txt").write_text("results")
    (root / ".tmp" / "build-2024" / "src").mkdir(parents=True)
    (root / ".tmp" / "build-2024" / "src" / "main.c").write_text("int main;")
    (root / "36").write_text("the user's")
    (root / "ab" / ("ab" * 32)).mkdir(parents=True)     # and a folder shaped like an entry, which prune would remove
    (root / "ab" / ("ab" * 32) / "data.bin").write_text("the user's")
    (root / "notes.md").write_text("the user's")
    root.chmod(0o700)
    return root


def _files(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_a_directory_of_the_users_is_refused_by_build_clear_and_prune(tmp_path):
    root = _project(tmp_path)
    before = _files(root)
    cache = Cache(root, layers=())
    with pytest.raises(CacheError, match=rf"holds 36, notes.md, which attnjit did not write, and no {TAG}"):
        cache._ensure_root()    # what build() and tuning records do first
    for call in (cache.clear, lambda: cache.prune(0)):
        with pytest.raises(CacheError, match="not its own"):
            call()
    assert _files(root) == before, "a refused root lost or gained files"


def test_a_new_or_empty_root_is_tagged_and_an_untagged_attnjit_root_is_adopted(tmp_path):
    new = tmp_path / "new"
    Cache(new, layers=())._ensure_root()
    assert (new / TAG).read_text() == TAG_TEXT
    old = tmp_path / "old"   # what an attnjit before the tag left: shards, work folders, tuning records
    (old / "ab" / ("ab" * 32)).mkdir(parents=True)
    for sub in (".tmp", ".locks", ".trash", "failed", "tuning"):
        (old / sub).mkdir()
    old.chmod(0o700)
    Cache(old, layers=())._ensure_root()
    assert (old / TAG).is_file()


def test_a_tagged_root_is_the_caches_whatever_else_it_holds(tmp_path):
    root = _project(tmp_path)
    (root / TAG).write_text(TAG_TEXT)
    Cache(root, layers=())._ensure_root()   # the tag says it is attnjit's: its contents are attnjit's to manage
    assert all((root / sub).is_dir() for sub in (".tmp", ".locks", ".trash", "failed"))
