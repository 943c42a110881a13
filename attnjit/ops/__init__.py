"""The user-facing operations (FlashInfer-compatible names)."""
