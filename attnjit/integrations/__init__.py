"""Integrations with other libraries (optional dependencies: each module imports its library when imported)."""
