"""mlx-aot-kernels: AOT kernel builds + a kernel registry for MLX inference engines.

`pip install -e '.[cpu]'` (Linux) / `pip install -e .` (macOS) builds the native launcher
registry._ext with CMake (csrc/). Building a wheel also compiles the kernels for every target this
machine's toolchains build, whatever it runs itself (python -m build_tools compile --target all:
a wheel is for other hosts), into registry/_artifacts and packages kernels.yaml and the kernel
sources under registry/_manifest, where the registry finds them.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
MANIFEST_FILES = ["kernels.yaml"]
SOURCE_DIRS = ["metal_src", "cuda_src", "cpu_src"]


class CMakeExtension(Extension):
    def __init__(self, name: str, source_dir: Path):
        super().__init__(name, sources=[])
        self.source_dir = str(source_dir)


def _cmake() -> str:
    # Prefer the cmake of this Python environment (pip's cmake >= 3.27) over an older system one.
    local = Path(sys.executable).parent / "cmake"
    found = str(local) if local.exists() else shutil.which("cmake")
    if not found:
        raise RuntimeError("cmake >= 3.27 is needed to build registry._ext: pip install 'cmake>=3.27'")
    return found


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CMakeExtension):
            return super().build_extension(ext)
        out = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_temp = Path(self.build_temp).resolve() / ext.name
        build_temp.mkdir(parents=True, exist_ok=True)
        args = [f"-DPython_EXECUTABLE={sys.executable}", f"-DMLX_AOT_OUTPUT_DIR={out}",
                "-DCMAKE_BUILD_TYPE=Release", *os.environ.get("CMAKE_ARGS", "").split()]
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 2)
        subprocess.run([_cmake(), "-S", ext.source_dir, "-B", str(build_temp), *args], check=True)
        subprocess.run([_cmake(), "--build", str(build_temp), "--parallel", jobs], check=True)


class BuildPyWithArtifacts(build_py):
    """Wheels carry the manifest, the kernel sources and the artifacts this machine can build."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # editable installs read the checkout; `python -m build_tools compile` fills registry/_artifacts
        pkg = Path(self.build_lib) / "registry"
        manifest_dir = pkg / "_manifest"
        shutil.rmtree(manifest_dir, ignore_errors=True)
        manifest_dir.mkdir(parents=True)
        for name in MANIFEST_FILES:
            shutil.copy2(ROOT / name, manifest_dir / name)
        for d in SOURCE_DIRS:
            if (ROOT / d).is_dir():
                shutil.copytree(ROOT / d, manifest_dir / d)
        if os.environ.get("MLX_AOT_SKIP_ARTIFACTS", "") not in ("", "0"):
            return
        sys.path.insert(0, str(ROOT))
        from build_tools import compile_kernels

        report = compile_kernels(targets=("all",), out_dir=pkg / "_artifacts", manifest=manifest_dir / "kernels.yaml",
                                 log=lambda line: print(line, file=sys.stderr))
        if not report.ok:
            raise RuntimeError("kernel compilation failed while building the wheel; see the output above")


setup(
    name="mlx-aot-kernels",
    version="0.1.0",
    description="Ahead-of-time kernel builds and a kernel registry for MLX-based LLM inference engines",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["registry", "registry.*", "build_tools", "build_tools.*"]),
    package_data={"registry": ["_manifest/**/*", "_artifacts/**/*"]},
    ext_modules=[CMakeExtension("registry._ext", ROOT / "csrc")],
    cmdclass={"build_ext": CMakeBuild, "build_py": BuildPyWithArtifacts},
    install_requires=["pyyaml>=6", "click>=8", "numpy>=1.24", "mlx==0.32.4"],
    extras_require={
        # Linux: plain `mlx` has no libmlx; pick the CPU or the CUDA 13 build. Each comes with the
        # mlx-lm the drop-in caches are built against (registry/integrations/); on macOS: `.[mlx-lm]`.
        "cpu": ["mlx[cpu]==0.32.4", "mlx-lm==0.32.2"],
        "cuda13": ["mlx[cuda13]==0.32.4", "mlx-lm==0.32.2"],
        "mlx-lm": ["mlx-lm==0.32.2"],
        # `python -m build_tools bench --plot`
        "bench": ["matplotlib>=3.7"],
        # nanobind: its headers, for the Metal launcher type-check (tests/test_metal_launcher_compiles.py)
        "test": ["pytest>=8", "mlx-lm==0.32.2", "matplotlib>=3.7", "nanobind==3.0.1"],
    },
    entry_points={"console_scripts": ["mlx-aot-kernels=build_tools.cli:cli",
                                      # mlx-lm's generate and server commands with the drop-in caches
                                      "mlx-aot-generate=registry.integrations.generate:main",
                                      "mlx-aot-server=registry.integrations.server:main"]},
)
