import pytest


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def pytest_collection_modifyitems(config, items):
    """Tests under tests/gpu are marked `gpu` and skipped, with the reason, where there is no CUDA device."""
    have_gpu = _cuda_available()
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run scripts/gpu_check.sh on the GPU machine")
    for item in items:
        if "/tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not have_gpu:
                item.add_marker(skip)
