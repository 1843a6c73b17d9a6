"""``.proto`` files compiled by the real ``protoc`` (the ``grpcio-tools`` wheel): the
generated Python module, for messages to serialize, and the ``FileDescriptorProto``
protoc made, the truth a schema read from text is held to."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

from google.protobuf import descriptor_pb2


def compile_proto(text: str, name: str, where: Path, imports: Mapping[str, str] = {}
                  ) -> tuple[ModuleType, bytes]:
    """``text`` saved as ``where/name.proto``, compiled: (``name_pb2``, the file's
    serialized ``FileDescriptorProto``).  ``imports``: the files it imports, by name
    (compiled first, their modules importable)."""
    import grpc_tools

    includes = Path(grpc_tools.__file__).parent / "_proto"  # the well-known types
    for imported, source in imports.items():
        compile_proto(source, imported.removesuffix(".proto"), where)
    (where / f"{name}.proto").write_text(text)
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{where}",
                    f"-I{includes}", f"--python_out={where}",
                    f"--descriptor_set_out={where / name}.desc", f"{name}.proto"],
                   check=True, cwd=where, capture_output=True, text=True)
    if str(where) not in sys.path:
        sys.path.insert(0, str(where))  # name_pb2 imports its imports' modules
    spec = importlib.util.spec_from_file_location(f"{name}_pb2", where / f"{name}_pb2.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # the generated code looks itself up
    spec.loader.exec_module(module)
    files = descriptor_pb2.FileDescriptorSet.FromString(
        (where / f"{name}.desc").read_bytes())
    [compiled] = [f for f in files.file if f.name == f"{name}.proto"]
    return module, compiled.SerializeToString()
