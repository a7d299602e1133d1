"""Build hook: compile protos/ with grpcio-tools into extproc/_gen (generated code is not committed)."""

from __future__ import annotations

import re
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent
PROTOS = ROOT / "protos"
OUT = ROOT / "extproc" / "_gen"


def compile_protos() -> None:
    """Run protoc on every .proto under protos/, then make imports package-relative."""
    from grpc_tools import protoc  # available: listed in [build-system].requires

    files = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    OUT.mkdir(parents=True, exist_ok=True)
    include = str(Path(protoc.__file__).parent / "_proto")
    args = [
        "protoc",
        f"-I{PROTOS}",
        f"-I{include}",
        f"--python_out={OUT}",
        f"--pyi_out={OUT}",
        f"--grpc_python_out={OUT}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on " + ", ".join(files))
    top = {Path(f).parts[0] for f in files}
    for py in OUT.rglob("*.py"):
        text = py.read_text()
        for t in top:
            text = re.sub(rf"^from {t}(\.| )", rf"from extproc._gen.{t}\1", text, flags=re.M)
        py.write_text(text)
    for d in [OUT, *[p for p in OUT.rglob("*") if p.is_dir()]]:
        (d / "__init__.py").touch()


class BuildPyWithProtos(build_py):
    """build_py that generates the protobuf modules first."""

    def run(self) -> None:
        compile_protos()
        # The generated packages did not exist when packages were discovered: list them, or
        # setuptools warns that their files "would be ignored".
        generated = sorted(
            ".".join(init.parent.relative_to(ROOT).parts) for init in OUT.rglob("__init__.py")
        )
        self.packages = [*self.packages, *(p for p in generated if p not in self.packages)]
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
