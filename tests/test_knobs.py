"""attnjit.knobs reads the environment live through one dict lookup (knobs._lookup): every change is seen at the
next read, values equal os.environ.get's (non-ASCII and undecodable bytes too), a bad value is an error naming the
variable, and any other os.environ mapping is read through its own get."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from attnjit import knobs


def test_the_lookup_is_live_and_equals_os_environ(monkeypatch):
    monkeypatch.delenv("ATTNJIT_NATIVE", raising=False)
    assert knobs.NATIVE.get() is True and not knobs.NATIVE.is_set()
    monkeypatch.setenv("ATTNJIT_NATIVE", "0")
    assert knobs.NATIVE.get() is False and knobs.NATIVE.is_set()
    monkeypatch.setenv("ATTNJIT_NATIVE", " On ")
    assert knobs.NATIVE.get() is True
    monkeypatch.setenv("ATTNJIT_NATIVE", "")
    assert knobs.NATIVE.get() is True and not knobs.NATIVE.is_set()   # empty: the default
    for value in ("/tmp/caché", "/tmp/\udcff-raw-byte", "x" * 4096):
        monkeypatch.setenv("ATTNJIT_LOG", value)
        assert knobs._lookup("ATTNJIT_LOG") == os.environ.get("ATTNJIT_LOG") == value
    monkeypatch.delenv("ATTNJIT_LOG")
    assert knobs._lookup("ATTNJIT_LOG") is None and knobs.LOG.get() is None


def test_a_bad_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("ATTNJIT_NATIVE", "maybe")
    with pytest.raises(ValueError, match=r"ATTNJIT_NATIVE='maybe' is invalid: expected 1/0"):
        knobs.NATIVE.get()
    monkeypatch.setenv("ATTNJIT_NUM_SMS", "-3")
    with pytest.raises(ValueError, match=r"ATTNJIT_NUM_SMS='-3' is invalid: expected a positive integer"):
        knobs.NUM_SMS.get()


@pytest.mark.parametrize("knob", [knobs.CACHE_DIR, knobs.NVCC, knobs.LOG, knobs.CACHE_PATH])
def test_a_path_of_blanks_only_is_refused_not_taken_as_a_directory_named_by_a_space(monkeypatch, knob):
    """``ATTNJIT_CACHE_DIR=" "`` (a stray space in a shell line) made a cache root named by a space in the working
    directory."""
    monkeypatch.setenv(knob.name, " " if knob is not knobs.CACHE_PATH else "/tmp/layer: ")
    with pytest.raises(ValueError, match=rf"{knob.name}=.* is invalid: expected a path, got only blanks"):
        knob.get()
    monkeypatch.setenv(knob.name, "/tmp/ x")
    assert str(knob.get()).endswith("/tmp/ x") or knob.get() == (Path("/tmp/ x"),)


def test_a_replaced_environ_mapping_is_read_through_its_get(monkeypatch):
    monkeypatch.setattr(os, "environ", {"ATTNJIT_NATIVE": "no"})
    assert knobs._lookup("ATTNJIT_NATIVE") == "no" and knobs.NATIVE.get() is False
    assert knobs._lookup("ATTNJIT_JIT") is None and knobs.JIT.get() is True


def _fresh_log_state(monkeypatch):
    from attnjit import dispatch

    monkeypatch.setattr(dispatch, "_log_state", {"raw": None, "file": None})
    return dispatch


def test_a_log_fifo_without_a_reader_is_an_error_not_a_hang(tmp_path):
    """ATTNJIT_LOG naming a FIFO nobody reads: open() would block the process forever; it is a ValueError that names
    the variable, at once (checked in a child process, so a regression fails by timeout instead of hanging here)."""
    import subprocess
    import sys

    fifo = tmp_path / "log.fifo"
    os.mkfifo(fifo)
    env = {**os.environ, "ATTNJIT_LOG": str(fifo)}
    code = "from attnjit import dispatch\ntry:\n    dispatch._log_file()\nexcept ValueError as e:\n    print(e)\n"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "ATTNJIT_LOG" in out.stdout and "FIFO with no reader" in out.stdout, out.stdout


def test_a_log_fifo_with_a_reader_receives_the_records(tmp_path, monkeypatch):
    dispatch = _fresh_log_state(monkeypatch)
    fifo = tmp_path / "log.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        monkeypatch.setenv("ATTNJIT_LOG", str(fifo))
        f = dispatch._log_file()
        f.write('{"op": "decode"}\n')
        assert os.read(reader, 100) == b'{"op": "decode"}\n'
        f.close()
    finally:
        os.close(reader)


def test_a_log_path_of_blanks_is_refused_where_the_record_is_opened(tmp_path, monkeypatch):
    """The dispatch record opens ATTNJIT_LOG itself: a blank value made a file named by a space in the working
    directory."""
    dispatch = _fresh_log_state(monkeypatch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ATTNJIT_LOG", "  ")
    with pytest.raises(ValueError, match="ATTNJIT_LOG=.* is invalid: expected a path, got only blanks"):
        dispatch._log_file()
    assert list(tmp_path.iterdir()) == []


def test_a_log_path_that_cannot_be_appended_to_names_the_variable(tmp_path, monkeypatch):
    dispatch = _fresh_log_state(monkeypatch)
    monkeypatch.setenv("ATTNJIT_LOG", str(tmp_path))   # a directory
    with pytest.raises(ValueError, match="ATTNJIT_LOG=.*cannot be opened to append"):
        dispatch._log_file()
    assert dispatch._log_state["file"] is None   # the next dispatch tries again (and says so again)
