"""Machine-independent float results for the testbed build, and the hash of its weights.

CPU float results depend on the instruction set the kernels pick: the same fp32 matmul
gives other bits under MKL's AVX-512 path than its AVX2 path, and so do PyTorch's own
vectorised reductions (softmax) and oneDNN's bf16 matmuls. A build run with
:data:`PINNED_ENV` uses the AVX2 paths of all three (MKL's conditional numerical
reproducibility in strict mode, which also ignores memory alignment) on every x86-64 CPU
that has AVX2; with the build's fixed thread counts its weights are then bit-identical
across such machines. The settings are read when the libraries load, so a pinned build
runs in a fresh process (:func:`run_pinned`).

MKL honours a CNR branch other than AUTO only on CPUs it identifies as Intel: on an AMD
CPU ``MKL_CBWR=AVX2`` silently falls back to AUTO and the testbed's weights come out other
bits (measured on an AMD EPYC: the small target's hash differed from the reference). MKL
asks one function of its own, ``mkl_serv_intel_cpu_true``, whether the CPU is Intel; on
other x86-64 CPUs the pinned environment preloads a two-line library defining it to say
yes (:func:`mkl_intel_cpu_shim`, compiled once with the system's C compiler into the
cache), so MKL takes its AVX2 branch there too. With it the same EPYC built the small
target with the reference hash.
"""

import contextlib
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open

PINNED_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "AVX2,STRICT",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}


# What MKL calls to decide whether the CPU is Intel (its CNR branches need a yes).
_MKL_SHIM_SOURCE = "int mkl_serv_intel_cpu_true(void) { return 1; }\n"
_MKL_SHIM_NAME = "libsgl_ecospec_mkl_intel_cpu.so"


def cpu_vendor() -> str | None:
    """The CPU's ``vendor_id`` from /proc/cpuinfo (``GenuineIntel``, ``AuthenticAMD``), or
    None where there is none (not Linux, or not x86)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


class PinningError(RuntimeError):
    """The float results cannot be pinned on this machine (the message says what to do)."""


def needs_mkl_shim() -> bool:
    """Whether MKL needs :func:`mkl_intel_cpu_shim` here: an x86-64 CPU not made by Intel."""
    return platform.machine() in ("x86_64", "AMD64") and cpu_vendor() not in (
        None,
        "GenuineIntel",
    )


def mkl_intel_cpu_shim(cache: str | os.PathLike | None = None) -> Path | None:
    """The library that lets MKL take its AVX2 CNR branch on a non-Intel x86-64 CPU
    (module docstring), compiled into ``cache`` (default ``$SGL_ECOSPEC_CACHE``, else
    ``~/.cache/sgl-ecospec``) on first use; None where not needed (:func:`needs_mkl_shim`).
    Raises :class:`PinningError`, saying what to install, when no C compiler is found."""
    if not needs_mkl_shim():
        return None
    base = cache or os.environ.get("SGL_ECOSPEC_CACHE") or Path.home() / ".cache" / "sgl-ecospec"
    path = Path(base) / "numerics" / _MKL_SHIM_NAME
    if path.is_file():
        return path
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise PinningError(
            f"pinning MKL's float results on this {cpu_vendor()} CPU needs a C compiler "
            "(to build a two-line library; see sgl_ecospec/lab/numerics.py): install gcc "
            "(apt install gcc) or set CC"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    source = path.with_suffix(".c")
    source.write_text(_MKL_SHIM_SOURCE)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    result = subprocess.run(
        [compiler, "-shared", "-fPIC", "-O2", "-o", str(partial), str(source)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise PinningError(f"{compiler} failed to build {path}:\n{result.stderr}")
    partial.replace(path)  # atomic: concurrent builds never load a half-written file
    return path


def pinned_env() -> dict[str, str]:
    """The environment variables a pinned process needs: :data:`PINNED_ENV`, and on a
    non-Intel x86-64 CPU ``LD_PRELOAD`` with :func:`mkl_intel_cpu_shim` first."""
    env = dict(PINNED_ENV)
    shim = mkl_intel_cpu_shim()
    preload = os.environ.get("LD_PRELOAD", "")
    if shim is not None and str(shim) not in preload.split():
        env["LD_PRELOAD"] = f"{shim} {preload}".strip()
    return env


def pinned() -> bool:
    """Whether this process was started with :func:`pinned_env`."""
    if not all(os.environ.get(name) == value for name, value in PINNED_ENV.items()):
        return False
    preload = os.environ.get("LD_PRELOAD", "").split()
    return not needs_mkl_shim() or any(Path(p).name == _MKL_SHIM_NAME for p in preload)


def run_pinned(argv: list[str]) -> None:
    """Runs ``argv`` in a child process with :func:`pinned_env`; its stdout goes to our
    stderr (progress, not results). Raises RuntimeError naming the exit code on failure."""
    env = {**os.environ, **pinned_env()}
    result = subprocess.run(argv, env=env, stdout=sys.stderr, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed with exit code {result.returncode}")


def weights_sha256(directory: str | os.PathLike) -> str:
    """SHA-256 over every tensor of the ``*.safetensors`` files in ``directory``.

    Covers each tensor's name, dtype, shape and bytes in name order, not the file bytes, so
    it does not depend on the order or metadata safetensors wrote.
    """
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {os.fspath(directory)!r}")
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(p), framework="pt")) for p in files]
        owner = {name: handle for handle in handles for name in handle.keys()}
        digest = hashlib.sha256()
        for name in sorted(owner):
            tensor = owner[name].get_tensor(name).contiguous()
            header = {"name": name, "dtype": str(tensor.dtype), "shape": list(tensor.shape)}
            digest.update(json.dumps(header, sort_keys=True).encode())
            digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


REPRODUCIBLE_THREADS = 2


def make_reproducible(argv: list[str]) -> None:
    """Pins this command's float results: re-executes it (``sgl-ecospec`` with ``argv``)
    under :func:`pinned_env` unless already pinned, then fixes torch at
    :data:`REPRODUCIBLE_THREADS` threads. Figures made this way are bit-identical on any
    x86-64 CPU with AVX2 (and slower: no AVX-512)."""
    if not pinned():
        command = [sys.executable, "-m", "sgl_ecospec.lab.cli", *argv]
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, command, {**os.environ, **pinned_env()})
    torch.set_num_threads(REPRODUCIBLE_THREADS)
