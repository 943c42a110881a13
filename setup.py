"""Only what pyproject.toml cannot say: the optional C accelerator of the split-KV scheduler (attnjit/native/cplan.c).

It is built where a C compiler is present and skipped, with a warning, where none is (``optional=True``); attnjit
then plans in Python, with the same results (attnjit/ops/scheduler.py).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("attnjit._cplan", ["attnjit/native/cplan.c", "attnjit/native/readers.c"],
                             depends=["attnjit/native/cplan.h"], optional=True,
                             extra_compile_args=["-O3", "-std=c99", "-Wall", "-Wextra", "-Wno-unused-parameter"])])
