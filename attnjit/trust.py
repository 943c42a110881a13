"""What the cache may trust, and reading it without a check-then-use window.

Loading a cubin runs its code on the GPU, so the cache trusts only what the current user (or root) owns and nobody
else can write: the root and each layer, the shard and entry directories, and every file it reads. Files are opened
relative to their directory's file descriptor with ``O_NOFOLLOW`` (a symlink is refused, not followed),
``O_NONBLOCK`` (a FIFO never blocks the open), checked with ``fstat`` to be a regular file of bounded size, and read
once: the caller hashes those bytes and loads those bytes, never the path again.

Every refusal is an ``Untrusted`` (or ``OSError`` for a file that is missing or unreadable) carrying one line that
says what was found and what was expected. The cache turns it into a bad entry (a miss) or, for a root or layer, an
``UnsafeCacheError``.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

MAX_MANIFEST_BYTES = 1 << 20      # a manifest is ~1 KiB
MAX_CUBIN_BYTES = 256 << 20       # the largest attnjit module is ~1 MiB; a 10 GB file is refused, not read
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class Untrusted(Exception):
    """A path the cache must not use. ``str()`` is the one-line reason."""


def current_uid() -> int:
    return os.geteuid()


def _uid_of(st: os.stat_result) -> int:
    return st.st_uid  # one place to ask, so a test can simulate another user without being root


def _who(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a directory"), (stat.S_ISREG, "a regular file"),
                       (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "of an unknown file type"


def ownership_problem(st: os.stat_result, what: str) -> str | None:
    """None if ``st`` is owned by us or root and writable by nobody else; else the reason, in one line."""
    uid, owner = current_uid(), _uid_of(st)
    if owner not in (uid, 0):
        return (f"{what} is owned by {_who(owner)}, not by you ({_who(uid)}) or root; only files you or root "
                "own are loaded")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o}); expected go-w"
    return None


def check_tree_top(path: Path, what: str) -> os.stat_result | None:
    """Check a root or layer (symlinks to it are followed: ``~/.cache`` is often one). None if it does not exist."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        raise Untrusted(f"{what} {path} is {_kind(st.st_mode)}, not a directory")
    problem = ownership_problem(st, f"{what} {path}")
    if problem:
        raise Untrusted(problem)
    return st


def private_dir(path: Path, what: str) -> Path:
    """``path``, created 0700 if absent, for files that are deleted or replaced in it: a symlink, anything not a
    directory, or a directory that is not trusted is refused, never written or cleaned through."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise Untrusted(f"{what} {path} is {_kind(st.st_mode)}, not a directory")
    problem = ownership_problem(st, f"{what} {path}")
    if problem:
        raise Untrusted(problem)
    return path


@contextmanager
def open_dir(name: str | Path, what: str, *, dir_fd: int | None = None, follow: bool = False) -> Iterator[int]:
    """A file descriptor of a trusted directory (``name`` relative to ``dir_fd``). FileNotFoundError if absent."""
    flags = _DIR_FLAGS & ~os.O_NOFOLLOW if follow else _DIR_FLAGS
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            raise Untrusted(f"{what} is {_kind(st.st_mode)}, not a directory") from None
        raise
    try:
        problem = ownership_problem(os.fstat(fd), what)
        if problem:
            raise Untrusted(problem)
        yield fd
    finally:
        os.close(fd)


def read_file(dir_fd: int, name: str, what: str, max_bytes: int) -> bytes:
    """The bytes of a trusted regular file ``name`` in the directory ``dir_fd``, at most ``max_bytes`` of them.

    Refuses (``Untrusted``) a symlink, FIFO, device, socket or directory, a file owned by another user or writable
    by others, and a file larger than ``max_bytes``; raises ``FileNotFoundError``/``PermissionError`` for a missing
    or unreadable one. Never blocks and never reads more than ``max_bytes + 1`` bytes.
    """
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISREG(st.st_mode):  # checked before open: opening a device can have effects
        raise Untrusted(f"{what} is {_kind(st.st_mode)}, not a regular file")
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):
            raise Untrusted(f"{what} changed into something other than a regular file while being opened") from None
        raise
    try:
        st = os.fstat(fd)  # what was opened, whatever the name points at now
        if not stat.S_ISREG(st.st_mode):
            raise Untrusted(f"{what} is {_kind(st.st_mode)}, not a regular file")
        problem = ownership_problem(st, what)
        if problem:
            raise Untrusted(problem)
        if st.st_size > max_bytes:
            raise Untrusted(f"{what} is {st.st_size} bytes, more than the {max_bytes} an entry may hold")
        chunks, got = [], 0
        while got <= st.st_size:
            chunk = os.read(fd, min(1 << 20, st.st_size + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got != st.st_size:
            raise Untrusted(f"{what} changed size while being read ({st.st_size} bytes before, {got} read)")
        return b"".join(chunks)
    finally:
        os.close(fd)


def replace_file(path: Path, text: str, mode: int, *, fsync: bool = False) -> None:
    """``text`` into ``path`` whole or not at all: written beside it under a fresh temporary name (``.NAME.*.part``,
    created exclusively, so never through a planted link), given ``mode``, then renamed over ``path``. A failed or
    killed write leaves the old file (or none) and, but for a kill, no temporary file."""
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    tmp = Path(name)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
