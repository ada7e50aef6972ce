"""The CUDA selection kernel's source on the CPU (test/ops/cuda_emulator.h): builds the
emulation library (once per test module) and calls it with the arguments the CUDA launcher
has after its checks (csrc/selection_call.h's structs, mirrored here for ctypes)."""

import ctypes
import shutil
import subprocess
from pathlib import Path

import torch

from sgl_ecospec.ops.options import POLICIES, SelectionOptions
from sgl_ecospec.ops.selection_reference import resolve_ranks

OPS = Path(__file__).parent / "ops"  # the emulation's C++ sources
CSRC = Path(__file__).parents[1] / "csrc"
_P, _I64, _F64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double


class _Buffers(ctypes.Structure):  # SelectBuffers
    _fields_ = [(n, _P) for n in ("prob", "parents", "experts", "roots", "weights", "out")]


class _Shape(ctypes.Structure):  # SelectShape
    _fields_ = [(n, _I64) for n in ("batch", "num_nodes", "layers", "words", "budget")]


class _Options(ctypes.Structure):  # SelectOptions
    _fields_ = [("policy", ctypes.c_int), ("eps", _F64), ("share_buffer", ctypes.c_bool)]
    _fields_ += [("num_ranks", _I64)]
    _fields_ += [(n, _F64) for n in ("total_weight", "step_tokens", "step_cost")]
    _fields_ += [(n, _F64) for n in ("candidate_cost", "candidate_decay", "min_score")]
    _fields_ += [("round_sync", ctypes.c_bool)]


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
    lib.emu_select.restype = _I64
    lib.emu_select.argtypes = [_P] * 4 + [_I64] * 4
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
    layer_weights=None,
    expert_rank=None,
    num_ranks=None,
    options: SelectionOptions | None = None,
    shared_limit=1 << 30,
    max_blocks=132,
    **option_keywords,
) -> tuple[torch.Tensor, int]:
    """``select_verify_set``'s CUDA kernel on the CPU (arguments as the op's, converted as its
    launcher converts them), with ``shared_limit`` bytes of shared memory and, for
    ``round_sync``, at most ``max_blocks`` co-resident blocks (an H100's multiprocessors by
    default). Returns the selection and where the workspace went (bit 0: shared memory, bit
    1: global memory)."""
    options = SelectionOptions.of(options, option_keywords)
    num_ranks, total_weight = resolve_ranks(expert_rank, num_ranks, options.total_weight)
    tensors = dict(
        prob=scores.double().contiguous(),
        parents=parents.long().contiguous(),
        experts=node_experts.contiguous(),
        roots=None if root_experts is None else root_experts.contiguous(),
        weights=None if layer_weights is None else layer_weights.double().contiguous(),
        out=torch.full((scores.shape[0], budget), -7, dtype=torch.int64),
    )
    rank = None if expert_rank is None else expert_rank.long().contiguous()
    scalars = _Options(
        POLICIES.index(options.policy),
        options.eps,
        options.share_buffer,
        num_ranks,
        total_weight,
        options.step_tokens,
        options.step_cost or 0.0,  # as the C++ check leaves it where unused
        options.candidate_cost,
        options.candidate_decay,
        options.min_score,
        options.round_sync,
    )
    where = lib.emu_select(
        ctypes.byref(_Buffers(**{k: _ptr(t) for k, t in tensors.items()})),
        ctypes.byref(_Shape(*node_experts.shape[:4], budget)),
        ctypes.byref(scalars),
        _ptr(rank),
        1 if rank is None or rank.dim() == 1 else rank.shape[0],
        0 if rank is None else rank.shape[-1],
        shared_limit,
        max_blocks,
    )
    assert where >= 0, lib.emu_error().decode()
    return tensors["out"], where
