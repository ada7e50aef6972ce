"""Builds sgl_ecospec and its extension sgl_ecospec._C from csrc/.

C++ CPU ops are always built. CUDA sources (csrc/*.cu) are added when a CUDA toolkit and a
CUDA build of torch are both present; SGL_ECOSPEC_CUDA=0 forces a CPU-only build and
SGL_ECOSPEC_CUDA=1 makes a missing toolkit an error instead of a silent CPU-only build. The
CUDA code is sm_90 machine code (H100, H200) plus compute_90 PTX, which the driver compiles
at load time for newer architectures. SGL_ECOSPEC_NVCC_FLAGS adds nvcc flags (for example
"-lineinfo" for compute-sanitizer's source lines, "-Xptxas -v" for the register report).
"""

import os
import platform
import shlex
from pathlib import Path

from setuptools import find_packages, setup

try:
    from torch.utils import cpp_extension
except ImportError as exc:
    # pip's isolated build environment has no torch (pyproject.toml does not ask for one: it
    # would be the newest torch, whose C++ ABI the serving environment's torch does not share).
    raise SystemExit(
        "sgl-ecospec compiles sgl_ecospec._C against the torch it will run with: install it "
        "into the environment that has torch and sglang with `pip install --no-build-isolation .` "
        "(CUDA_HOME set for the CUDA kernels), or run `bash scripts/setup_env.sh` "
        f"(torch cannot be imported here: {exc})"
    ) from None

ROOT = Path(__file__).parent
CSRC = ROOT / "csrc"


def _want_cuda() -> bool:
    flag = os.environ.get("SGL_ECOSPEC_CUDA", "auto").lower()
    if flag not in {"0", "1", "auto"}:
        raise SystemExit(f"SGL_ECOSPEC_CUDA must be 0, 1 or auto, got {flag!r}")
    has_sources = any(CSRC.glob("*.cu"))
    available = has_sources and cpp_extension.CUDA_HOME is not None and _torch_has_cuda()
    if flag == "1" and not available:
        raise SystemExit(
            "SGL_ECOSPEC_CUDA=1 but no CUDA build is possible: need csrc/*.cu, a CUDA toolkit "
            f"(CUDA_HOME={cpp_extension.CUDA_HOME}) and a CUDA build of torch."
        )
    return flag != "0" and available


def _torch_has_cuda() -> bool:
    import torch

    return torch.version.cuda is not None


def _nvcc_flags() -> list[str]:
    extra = shlex.split(os.environ.get("SGL_ECOSPEC_NVCC_FLAGS", ""))
    arch = ["-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_90,code=compute_90"]
    return ["-O3", "-std=c++20", *arch, *extra]


def _extension():
    # ATen's parallel_for only runs in parallel when the caller is compiled with OpenMP.
    cxx_flags = ["-O3", "-std=c++20", "-fopenmp"]
    if platform.machine() in {"x86_64", "AMD64"}:
        cxx_flags.append("-mpopcnt")
    sources = sorted(str(p.relative_to(ROOT)) for p in CSRC.glob("*.cpp"))
    if _want_cuda():
        sources += sorted(str(p.relative_to(ROOT)) for p in CSRC.glob("*.cu"))
        return cpp_extension.CUDAExtension(
            "sgl_ecospec._C",
            sources,
            extra_compile_args={
                "cxx": cxx_flags,
                "nvcc": _nvcc_flags(),
            },
            extra_link_args=["-fopenmp"],
        )
    return cpp_extension.CppExtension(
        "sgl_ecospec._C", sources, extra_compile_args=cxx_flags, extra_link_args=["-fopenmp"]
    )


setup(
    name="sgl-ecospec",
    version="0.1.0",
    description="Cost-aware speculative decoding (EcoSpec) for MoE models in SGLang",
    packages=find_packages(include=["sgl_ecospec", "sgl_ecospec.*"])
    + find_packages("python", include=["sglang_ecospec*"]),
    # The SGLang plugin (ECOSPEC) and its CPU development mode live in python/; see
    # docs/sglang.md and docs/structures.md.
    package_dir={
        "sglang_ecospec": "python/sglang_ecospec",
        "sglang_ecospec_cpu": "python/sglang_ecospec_cpu",
    },
    # The testbed's shipped EAGLE-3 drafts (docs/testbed.md).
    package_data={"sgl_ecospec.lab.testbed": ["drafts/*/*.json", "drafts/*/*.safetensors"]},
    python_requires=">=3.10",
    install_requires=["torch", "numpy", "scipy", "safetensors"],
    extras_require={"plot": ["matplotlib"]},
    ext_modules=[_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
    entry_points={
        "console_scripts": ["sgl-ecospec=sgl_ecospec.lab.cli:main"],
        # Run by sglang.srt.plugins.load_plugins() in every SGLang server process.
        "sglang.srt.plugins": ["ecospec=sglang_ecospec:register"],
    },
)
