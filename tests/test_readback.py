"""The read-back kernel of device metadata (attnjit/ops/_readback.py, attnjit/native/readback.cu): the shipped PTX
is the source's, loadable by ptxas for both archs without local memory, and its launch packs the argument struct
the kernel declares. (The GPU run of the kernel itself: tests/gpu/test_plan_host.py.)"""

from __future__ import annotations

import re
import subprocess

import pytest

from attnjit.ops import _readback
from attnjit.toolchain import find_nvcc as nvcc

SOURCE = _readback.PTX.with_name("readback.cu")


def _shipped_form(ptx: str) -> str:
    """readback.cu's regeneration line: nvcc's comment header dropped, `.version` lowered to 7.0, leading blanks
    dropped."""
    lines = [ln for ln in ptx.splitlines() if not ln.startswith("//")]
    lines = [".version 7.0" if ln.startswith(".version ") else ln for ln in lines]
    while lines and not lines[0].strip():
        lines.pop(0)
    return "\n".join(lines) + "\n"


@pytest.mark.nvcc
def test_the_shipped_ptx_is_the_sources(tmp_path):
    out = tmp_path / "readback.ptx"
    subprocess.run([str(nvcc()), "-ptx", "-arch=compute_80", str(SOURCE), "-o", str(out)], check=True)
    assert _shipped_form(out.read_text()) == _readback.PTX.read_text(), (
        "attnjit/native/readback.ptx is stale: regenerate it with the command in readback.cu's header")


@pytest.mark.nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_the_shipped_ptx_assembles_without_local_memory(tmp_path, arch):
    ptxas = nvcc().with_name("ptxas")
    res = subprocess.run([str(ptxas), "-v", f"-arch={arch}", str(_readback.PTX), "-o", str(tmp_path / "r.cubin")],
                         capture_output=True, text=True, check=True)
    info = res.stdout + res.stderr
    assert "Used" in info and not re.search(r"(?<!\d)[1-9]\d* bytes (stack frame|spill)", info), info


def test_the_ptx_declares_one_argument_struct_of_the_packed_size():
    text = _readback.PTX.read_text()
    assert text.startswith(".version 7.0\n.target sm_80\n")
    params = re.findall(rf"\.entry {_readback.KERNEL}\(\s*\.param \.align 8 \.b8 {_readback.KERNEL}_param_0\[(\d+)\]",
                        text)
    assert params == [str(_readback.ARGS.size)] and _readback.ARGS.size == 8 + 8 * _readback.SEGMENTS + 4 * 8
    assert ".local" not in text
    src = SOURCE.read_text()
    assert f"#define READBACK_SEGMENTS {_readback.SEGMENTS}\n" in src


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


def _gather_without_a_gpu() -> tuple[_readback.Gather, _Recorder]:
    g = object.__new__(_readback.Gather)
    rec = _Recorder()
    g._fn = type("Fn", (), {"ptr": 1234})()
    g._launch = rec
    import ctypes
    import threading

    g._buf = ctypes.create_string_buffer(_readback.ARGS.size)
    g._argv = (ctypes.c_void_p * 1)(ctypes.addressof(g._buf))
    g._argv_ptr = ctypes.addressof(g._argv)
    g._lock = threading.Lock()
    g.launches = 0
    return g, rec


def test_a_launch_packs_cumulative_ends_and_pads_the_unused_segments():
    g, rec = _gather_without_a_gpu()
    g.gather(0x1000, [(0x2000, 3), (0x3000, 1), (0x4000, 129)], stream=77)
    values = _readback.ARGS.unpack(g._buf.raw)
    assert values[0] == 0x1000
    assert list(values[1:9]) == [0x2000, 0x3000] + [0x4000] * 6
    assert list(values[9:]) == [3, 4, 133] + [133] * 5   # an unused segment is empty: its end repeats the total
    (fn, gx, gy, gz, bx, by, bz, smem, stream, argv, extra), = rec.calls
    assert (fn, gx, gy, gz, bx, by, bz, smem, stream, argv, extra) == (1234, 1, 1, 1, 256, 1, 1, 0, 77, g._argv_ptr, 0)
    g.gather(0x1000, [(0x2000, 1 << 16), (0x3000, 2)], stream=0)
    assert rec.calls[-1][1] == _readback.MAX_BLOCKS and g.launches == 2


@pytest.mark.parametrize("segments, message", [
    ([], "1 to 8"), ([(1, 1)] * 9, "1 to 8"), ([(1, 0)], "positive"), ([(1, -1)], "positive"),
    ([(1, 1 << 30), (2, 1 << 30)], "int32"),
])
def test_a_launch_refuses_what_the_kernel_cannot_take(segments, message):
    g, rec = _gather_without_a_gpu()
    with pytest.raises(ValueError, match=message):
        g.gather(0x1000, segments, stream=0)
    assert rec.calls == [] and g.launches == 0


def test_without_a_loadable_kernel_the_copies_serve(monkeypatch):
    """gather_for answers None (and says why) where the module does not load; it asks once per device."""
    tries = []

    def refuse(index):
        tries.append(index)
        raise RuntimeError("no driver here")

    monkeypatch.setattr(_readback, "Gather", refuse)
    monkeypatch.setattr(_readback, "_gathers", {})
    monkeypatch.setattr(_readback, "load_errors", {})
    assert _readback.gather_for(3) is None and _readback.gather_for(3) is None
    assert tries == [3] and _readback.load_errors[3] == "RuntimeError: no driver here"
