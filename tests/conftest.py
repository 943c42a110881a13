import pytest


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def _nvcc_problem() -> str | None:
    try:
        from attnjit.toolchain import nvcc

        nvcc()
        return None
    except Exception as exc:  # noqa: BLE001
        return str(exc).splitlines()[0]


def _is_gpu_test(path) -> bool:
    return "/tests/gpu/" in str(path).replace("\\", "/")


def pytest_collection_modifyitems(config, items):
    """Tests under tests/gpu are marked `gpu` and skipped, with the reason, where there is no CUDA device.
    Tests marked `nvcc` are skipped, with the reason, where no nvcc can be found."""
    have_gpu = _cuda_available()
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run scripts/gpu_check.sh on the GPU machine")
    nvcc_problem = None
    if any(item.get_closest_marker("nvcc") for item in items):
        nvcc_problem = _nvcc_problem()
    for item in items:
        if _is_gpu_test(item.fspath):
            item.add_marker(pytest.mark.gpu)
            if not have_gpu:
                item.add_marker(skip)
        elif nvcc_problem and item.get_closest_marker("nvcc"):
            item.add_marker(pytest.mark.skip(reason=f"needs nvcc: {nvcc_problem}"))


# Environment variables a CPU test must not inherit (they would change keys, roots, strictness or layers).
_ISOLATED = ("ATTNJIT_CACHE_PATH", "ATTNJIT_JIT", "ATTNJIT_LOG", "ATTNJIT_LOCK_TIMEOUT", "ATTNJIT_ARCH",
             "ATTNJIT_ARCH_OVERRIDE", "ATTNJIT_JOBS", "ATTNJIT_NUM_SMS")


@pytest.fixture(autouse=True)
def _isolated_cache_env(request, tmp_path_factory):
    """CPU tests run with a private default cache root (never ~/.cache) and no inherited attnjit settings.

    The GPU tests keep the environment scripts/gpu_check.sh gives them (a carried, pre-warmed cache)."""
    if _is_gpu_test(request.node.fspath):
        yield
        return
    mp = request.getfixturevalue("monkeypatch")
    for name in _ISOLATED:
        mp.delenv(name, raising=False)
    mp.setenv("ATTNJIT_CACHE_DIR", str(tmp_path_factory.mktemp("default-root") / "cache"))
    mp.setenv("ATTNJIT_PACKAGES", "0")  # kernel packages installed on this machine are not the test's
    yield


@pytest.fixture(scope="session")
def golden(tmp_path_factory):
    """A cache root holding GOLDEN_SPECS, built once per session with the real nvcc. Copy it; never change it."""
    from attnjit.cache import Cache
    from attnjit.jit import warm

    from .cpu_support import GOLDEN_SPECS, Golden

    root = tmp_path_factory.mktemp("golden") / "cache"
    results = warm(GOLDEN_SPECS, Cache(root, layers=()))
    failed = [(r.job.label, r.error and r.error.first_error) for r in results if r.status != "built"]
    assert not failed, f"the session cache did not build: {failed}"
    return Golden(root=root, specs=GOLDEN_SPECS, keys=tuple(r.job.key for r in results))
