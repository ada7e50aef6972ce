"""The CUDA selection kernel's source on the CPU (test/ops/cuda_emulator.h): builds the
emulation library (once per test module) and calls it as the CUDA launcher calls the kernel."""

import ctypes
import shutil
import subprocess
from pathlib import Path

import torch

from sgl_ecospec.ops.selection import POLICIES

OPS = Path(__file__).parent / "ops"  # the emulation's C++ sources
CSRC = Path(__file__).parents[1] / "csrc"


def build(folder: Path) -> ctypes.CDLL | None:
    """Compiles the emulation into ``folder``; None without a C++ compiler."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return None
    library = folder / "emu_select.so"
    command = [compiler, "-O1", "-std=c++20", "-ffp-contract=off", "-shared", "-fPIC"]
    command += [f"-I{CSRC}", f"-I{OPS}", str(OPS / "cuda_emulated_select.cpp"), "-o", str(library)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    lib = ctypes.CDLL(str(library))
    p, i64, f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
    lib.emu_select.restype = i64
    lib.emu_select.argtypes = [p] * 6 + [i64, p] + [i64] * 5 + [ctypes.c_int, f64, ctypes.c_bool]
    lib.emu_select.argtypes += [i64, i64, f64, f64, f64, f64, f64, f64, i64]
    lib.emu_error.restype = ctypes.c_char_p
    return lib


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def select_emulated(
    lib: ctypes.CDLL,
    scores,
    parents,
    node_experts,
    budget,
    *,
    root_experts=None,
    policy="ecospec",
    eps=0.1,
    share_buffer=False,
    layer_weights=None,
    expert_rank=None,
    num_ranks=None,
    total_weight=None,
    step_tokens=1.0,
    step_cost=1.0,
    candidate_cost=0.0,
    candidate_decay=1.0,
    min_score=0.0,
    shared_limit=1 << 30,
) -> tuple[torch.Tensor, int]:
    """``select_verify_set``'s CUDA kernel on the CPU (arguments as the op, converted as its
    launcher converts them), with ``shared_limit`` bytes of shared memory. Returns the
    selection and where the workspace went (bit 0: shared memory, bit 1: global memory)."""
    batch, nodes, layers, words = node_experts.shape
    prob = scores.double().contiguous()
    par = parents.long().contiguous()
    experts = node_experts.contiguous()
    roots = None if root_experts is None else root_experts.contiguous()
    weights = None if layer_weights is None else layer_weights.double().contiguous()
    rank, rank_rows, num_experts = None, 1, 0
    if expert_rank is not None:
        rank = expert_rank.long().contiguous()
        rank_rows, num_experts = (layers if rank.dim() == 2 else 1), rank.shape[-1]
        num_ranks = num_ranks or int(rank.max()) + 1
        total_weight = 1.0 / num_ranks if total_weight is None else total_weight
    out = torch.full((batch, budget), -7, dtype=torch.int64)
    where = lib.emu_select(
        _ptr(prob),
        _ptr(par),
        _ptr(experts),
        _ptr(roots),
        _ptr(weights),
        _ptr(rank),
        rank_rows,
        _ptr(out),
        batch,
        nodes,
        layers,
        words,
        budget,
        POLICIES.index(policy),
        eps,
        share_buffer,
        num_experts,
        num_ranks or 1,
        total_weight or 0.0,
        step_tokens,
        step_cost,
        candidate_cost,
        candidate_decay,
        min_score,
        shared_limit,
    )
    assert where >= 0, lib.emu_error().decode()
    return out, where
