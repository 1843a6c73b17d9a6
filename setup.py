"""Only the C extensions: everything else is in pyproject.toml.

``gatehouse.codecs._speedups`` holds C versions of the byte readers on the proxy's hot
path (gatehouse/codecs/_speedups.c), ``gatehouse.codecs._decoder`` the compiled decoders
(gatehouse/codecs/_decoder.c), ``gatehouse.metrics._counting`` the metrics' counting
of the usual exchange (gatehouse/metrics/_counting.c), ``gatehouse.capture._records`` the
observation log's JSON lines (gatehouse/capture/_records.c).  All are optional: where no C
compiler is found the build goes on without them and the Python code, which gives the
same results, runs.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "gatehouse.codecs._speedups",
            sources=["gatehouse/codecs/_speedups.c"],
            depends=["gatehouse/codecs/_wire.h"],
            optional=True,
            extra_compile_args=["-Wall", "-Wextra", "-Wno-unused-parameter"],
        ),
        Extension(
            "gatehouse.codecs._decoder",
            sources=["gatehouse/codecs/_decoder.c"],
            depends=["gatehouse/codecs/_wire.h"],
            optional=True,
            extra_compile_args=["-Wall", "-Wextra", "-Wno-unused-parameter"],
        ),
        Extension(
            "gatehouse.metrics._counting",
            sources=["gatehouse/metrics/_counting.c"],
            optional=True,
            extra_compile_args=["-Wall", "-Wextra", "-Wno-unused-parameter"],
        ),
        Extension(
            "gatehouse.capture._records",
            sources=["gatehouse/capture/_records.c"],
            optional=True,
            extra_compile_args=["-Wall", "-Wextra", "-Wno-unused-parameter"],
        ),
    ]
)
