"""Only the C extension: everything else is in pyproject.toml.

``gatehouse.codecs._speedups`` holds C versions of the byte readers on the proxy's hot
path (gatehouse/codecs/_speedups.c).  It is optional: where no C compiler is found the
build goes on without it and the Python readers, which give the same results, run.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "gatehouse.codecs._speedups",
            sources=["gatehouse/codecs/_speedups.c"],
            optional=True,
            extra_compile_args=["-Wall", "-Wextra", "-Wno-unused-parameter"],
        )
    ]
)
