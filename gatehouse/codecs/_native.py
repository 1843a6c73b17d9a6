"""The C readers (``_speedups``, built from _speedups.c when a C compiler is found), or
None: then, or with ``GATEHOUSE_PURE_PYTHON=1`` in the environment, the Python readers
run.  Both give the same results (tests/test_speedups.py); the C ones cost a tenth."""

from __future__ import annotations

import os
from types import ModuleType

speedups: ModuleType | None = None
if not os.environ.get("GATEHOUSE_PURE_PYTHON"):
    try:
        from gatehouse.codecs import _speedups as speedups
    except ImportError:  # not built here: the Python readers
        speedups = None
