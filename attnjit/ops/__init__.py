"""The user-facing operations (FlashInfer-compatible names). Importing the package registers them as torch.library
ops (torch.ops.attnjit.*, see library.py) for torch.compile."""

from . import library  # noqa: F401  (registers torch.ops.attnjit.*)
