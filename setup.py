"""Build hook: the gRPC stubs are generated from protos/ whenever the package is built.

`pip install .`, `pip wheel .` and `python -m build` all run `build_py`, which writes
specdec/v1/*_pb2.py, *_pb2.pyi and *_pb2_grpc.py into what is being built (into the source
tree for an editable install, as `make proto` does). The stubs are never edited by hand and
never committed. Everything else about the package is in pyproject.toml.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTOS = ROOT / "protos"


def generate_stubs(out: Path) -> list[Path]:
    """Run protoc (from grpcio-tools) over protos/specdec/v1/*.proto into `out`."""
    from importlib.resources import files

    from grpc_tools import protoc

    sources = sorted(PROTOS.glob("specdec/v1/*.proto"))
    if not sources:
        raise RuntimeError(f"no .proto files under {PROTOS}: the source tree is incomplete")
    out.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{PROTOS}", f"-I{files('grpc_tools') / '_proto'}", f"--python_out={out}",
            f"--pyi_out={out}", f"--grpc_python_out={out}", *map(str, sources)]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on " + ", ".join(s.name for s in sources))
    return sorted((out / "specdec" / "v1").glob("*_pb2*.py*"))


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        super().run()
        target = ROOT if self.editable_mode else Path(self.build_lib)
        generate_stubs(target)


setup(cmdclass={"build_py": BuildPyWithStubs})
