"""The arch rules: at run time the GPU's own arch wins unless ATTNJIT_ARCH_OVERRIDE forces one; a warm targets
--arch (one or several), else the override, else the local GPUs, else ATTNJIT_ARCH, else sm_90a."""

from __future__ import annotations

import pytest

from attnjit import arch, cli, dispatch
from attnjit.specs import AttentionSpec
from tests.cpu_support import run_cli

SPEC = "op=merge_state,head_dim=64,dtype=fp16"


@pytest.fixture
def gpus(monkeypatch):
    """gpus((9, 0), (8, 0)): the driver reports these devices."""
    def set_(*caps):
        monkeypatch.setattr(arch, "_driver_capabilities", lambda: tuple(caps))
    set_()
    return set_


@pytest.mark.parametrize("cap,env,expected", [
    ((9, 0), {}, "sm_90a"),
    ((8, 0), {}, "sm_80"),
    ((8, 9), {"ATTNJIT_ARCH": "sm_90a"}, "sm_89"),                 # ATTNJIT_ARCH never beats a present GPU
    ((8, 0), {"ATTNJIT_ARCH_OVERRIDE": "sm_90a"}, "sm_90a"),       # the override does
    ((10, 0), {"ATTNJIT_ARCH": "sm_80", "ATTNJIT_ARCH_OVERRIDE": "sm_100a"}, "sm_100a"),
])
def test_the_gpus_own_arch_wins_at_run_time_unless_overridden(monkeypatch, cap, env, expected):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    monkeypatch.setattr(dispatch, "_device_facts", {})   # dispatch asks a device's capability once: a fresh memo
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert dispatch.device_arch(0) == expected


def test_warm_targets_follow_the_documented_order(monkeypatch, gpus):
    assert arch.build_archs(None) == (["sm_90a"], "the default (no GPU here)")
    monkeypatch.setenv("ATTNJIT_ARCH", "sm_80")
    assert arch.build_archs(None) == (["sm_80"], "ATTNJIT_ARCH")
    gpus((9, 0), (9, 0), (8, 6))
    assert arch.build_archs(None) == (["sm_90a", "sm_86"], "the local GPUs")
    monkeypatch.setenv("ATTNJIT_ARCH_OVERRIDE", "sm_100a")
    assert arch.build_archs(None) == (["sm_100a"], "ATTNJIT_ARCH_OVERRIDE")
    assert arch.build_archs("sm_80,sm_90a,sm_80") == (["sm_80", "sm_90a"], "--arch")


def test_warm_defaults_to_the_local_gpu(capsys, gpus):
    gpus((8, 0))
    assert cli.main(["render", "--spec", SPEC]) == 0
    assert capsys.readouterr().out.startswith(
        "// ===== " + AttentionSpec.parse(SPEC + ",arch=sm_80").canonical() + "\n")


def test_several_archs_give_each_spec_once_per_arch(tmp_path):
    catalog = tmp_path / "c.toml"
    catalog.write_text('[[spec]]\nop = "merge_state"\nhead_dim = [64, 128]\ndtype = "fp16"\n\n'
                       '[[spec]]\nop = "merge_state"\nhead_dim = 64\ndtype = "bf16"\narch = "sm_100a"\n')
    proc = run_cli("render", catalog, "--spec", SPEC, "--arch", "sm_80,sm_90a")
    assert proc.returncode == 0, proc.stderr
    heads = [line.removeprefix("// ===== ") for line in proc.stdout.splitlines() if line.startswith("// ===== ")]
    spec = lambda text: AttentionSpec.parse(text).canonical()  # noqa: E731
    assert heads == [spec("op=merge_state,head_dim=64,dtype=fp16,arch=sm_80"),
                     spec("op=merge_state,head_dim=128,dtype=fp16,arch=sm_80"),
                     spec("op=merge_state,head_dim=64,dtype=bf16,arch=sm_100a"),   # a table's own arch stays
                     spec("op=merge_state,head_dim=64,dtype=fp16,arch=sm_90a"),
                     spec("op=merge_state,head_dim=128,dtype=fp16,arch=sm_90a")]


@pytest.mark.parametrize("value", ["sm_75", "hopper", ",", "sm_90a,sm_7"])
def test_a_bad_arch_is_one_error_line(value):
    proc = run_cli("warm", "--spec", SPEC, "--arch", value)
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("attnjit: error: argument --arch: ") and "expected" in line


def test_a_bad_arch_setting_is_named(monkeypatch):
    monkeypatch.setenv("ATTNJIT_ARCH_OVERRIDE", "sm_7")
    with pytest.raises(ValueError, match="ATTNJIT_ARCH_OVERRIDE='sm_7' is invalid: expected sm_XY"):
        arch.build_archs(None)


def test_finding_local_gpus_needs_no_torch_and_never_fails():
    arch._driver_capabilities.cache_clear()
    found = arch.local_archs()  # none on a CPU machine; a list either way
    assert isinstance(found, list) and all(a.startswith("sm_") for a in found)
