"""Only the C extensions: everything else is in pyproject.toml.

``gatehouse.codecs._speedups`` holds C versions of the byte readers on the proxy's hot
path (gatehouse/codecs/_speedups.c), ``gatehouse.codecs._decoder`` the compiled decoders
(gatehouse/codecs/_decoder.c), ``gatehouse.metrics._counting`` the metrics' counting
of the usual exchange (gatehouse/metrics/_counting.c), ``gatehouse.capture._records`` the
observation log's JSON lines (gatehouse/capture/_records.c), ``gatehouse.rules._protowire``
the Protobuf walk of validate_records' registry checks (gatehouse/rules/_protowire.c),
``gatehouse.rules._aead`` encrypt_records' AES-256-GCM opening (gatehouse/rules/_aead.c).
All are optional: where no C compiler is found the build goes on without them and the
Python code, which gives the same results, runs.
"""

from setuptools import Extension, setup


def optional_c(name: str, *depends: str, libraries: list[str] | None = None) -> Extension:
    """The C module ``name`` from the .c file of that path; skipped where it cannot build."""
    return Extension(name, sources=[name.replace(".", "/") + ".c"], depends=list(depends),
                     optional=True, libraries=libraries or [],
                     extra_compile_args=["-Wall", "-Wextra", "-Wno-unused-parameter"])


setup(
    ext_modules=[
        optional_c("gatehouse.codecs._speedups", "gatehouse/codecs/_wire.h",
                   "gatehouse/codecs/_opener.h"),
        optional_c("gatehouse.codecs._decoder", "gatehouse/codecs/_wire.h"),
        optional_c("gatehouse.metrics._counting"),
        optional_c("gatehouse.capture._records"),
        optional_c("gatehouse.proxy._peeking", "gatehouse/codecs/_wire.h"),
        optional_c("gatehouse.rules._protowire"),
        # AES-256-GCM opening for encrypt_records, with the system's OpenSSL (libcrypto;
        # Debian's libssl-dev has its headers): skipped without them.
        optional_c("gatehouse.rules._aead", "gatehouse/codecs/_opener.h",
                   libraries=["crypto"]),
    ]
)
