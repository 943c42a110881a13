"""attnjit.knobs reads the environment live through one dict lookup (knobs._lookup): every change is seen at the
next read, values equal os.environ.get's (non-ASCII and undecodable bytes too), a bad value is an error naming the
variable, and any other os.environ mapping is read through its own get."""

from __future__ import annotations

import os

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


def test_a_replaced_environ_mapping_is_read_through_its_get(monkeypatch):
    monkeypatch.setattr(os, "environ", {"ATTNJIT_NATIVE": "no"})
    assert knobs._lookup("ATTNJIT_NATIVE") == "no" and knobs.NATIVE.get() is False
    assert knobs._lookup("ATTNJIT_JIT") is None and knobs.JIT.get() is True
