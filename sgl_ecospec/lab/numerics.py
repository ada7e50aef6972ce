"""Machine-independent float results for the testbed build, and the hash of its weights.

CPU float results depend on the instruction set the kernels pick: the same fp32 matmul
gives other bits under MKL's AVX-512 path than its AVX2 path, and so do PyTorch's own
vectorised reductions (softmax) and oneDNN's bf16 matmuls. A build run with
:data:`PINNED_ENV` uses the AVX2 paths of all three (MKL's conditional numerical
reproducibility in strict mode, which also ignores memory alignment) on every x86-64 CPU
that has AVX2; with the build's fixed thread counts its weights are then bit-identical
across such machines. The settings are read when the libraries load, so a pinned build
runs in a fresh process (:func:`run_pinned`).
"""

import contextlib
import hashlib
import json
import os
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


def pinned() -> bool:
    """Whether this process was started with :data:`PINNED_ENV`."""
    return all(os.environ.get(name) == value for name, value in PINNED_ENV.items())


def run_pinned(argv: list[str]) -> None:
    """Runs ``argv`` in a child process with :data:`PINNED_ENV`; its stdout goes to our
    stderr (progress, not results). Raises RuntimeError naming the exit code on failure."""
    env = {**os.environ, **PINNED_ENV}
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
    under :data:`PINNED_ENV` unless already pinned, then fixes torch at
    :data:`REPRODUCIBLE_THREADS` threads. Figures made this way are bit-identical on any
    x86-64 CPU with AVX2 (and slower: no AVX-512)."""
    if not pinned():
        command = [sys.executable, "-m", "sgl_ecospec.lab.cli", *argv]
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, command, {**os.environ, **PINNED_ENV})
    torch.set_num_threads(REPRODUCIBLE_THREADS)
