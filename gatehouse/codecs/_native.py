"""The C readers (``_speedups``, built from _speedups.c when a C compiler is found), or
None: then, or with ``GATEHOUSE_PURE_PYTHON=1`` in the environment, the Python readers
run.  Both give the same results (tests/test_speedups.py); the C ones cost a tenth."""

from __future__ import annotations

import os
from types import ModuleType
from typing import Final

speedups: ModuleType | None = None
# Why the Python readers run (for the start-up log and `gatehouse check`); None when the
# C ones do.
python_reason: str | None = None
PYTHON_ASKED: Final = bool(os.environ.get("GATEHOUSE_PURE_PYTHON"))
if PYTHON_ASKED:
    python_reason = "GATEHOUSE_PURE_PYTHON is set"
else:
    try:
        from gatehouse.codecs import _speedups as speedups
    except ImportError as exc:  # not built here: the Python readers
        speedups = None
        python_reason = (f"the C module was not built ({exc}): install with a C compiler "
                         "for the faster readers")

# The compiled decoders in C (_decoder.c, built with _speedups), or None: then the
# generated Python decoders run alone.  Both give the same records
# (tests/test_codec_native.py); where the C one refuses a frame, the Python one reads it
# again and says why.
decoder: ModuleType | None = None
if not PYTHON_ASKED:
    try:
        from gatehouse.codecs import _decoder as decoder
    except ImportError as exc:  # built with _speedups: not here without it
        decoder = None
        python_reason = python_reason or (f"the C decoder was not built ({exc}): install "
                                          "with a C compiler for the faster codec")

# "c" or "python": the ``byte_readers`` label of gatehouse_info ("python" where any of
# the C modules is not there).
BYTE_READERS: Final = "python" if speedups is None or decoder is None else "c"
