"""scripts/launch_cpu.sh's argument handling, with a fake environment: its python prints
the arguments it gets, its stub libcuda exists (no build), and nvidia-smi finds no GPU."""

import os
import stat
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "launch_cpu.sh"


def executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def launch(tmp_path):
    venv, tools = tmp_path / "venv", tmp_path / "tools"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib" / "sgl_ecospec_stub").mkdir(parents=True)
    (venv / "lib" / "sgl_ecospec_stub" / "libcuda.so.1").write_bytes(b"")
    executable(venv / "bin" / "python", '#!/bin/sh\nprintf "%s\\n" "$@"\n')
    tools.mkdir()
    executable(tools / "nvidia-smi", "#!/bin/sh\nexit 1\n")  # the test host may have a GPU
    env = {
        **os.environ,
        "ECOSPEC_CPU_VENV": str(venv),
        "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}",
    }

    def run(*args):
        result = subprocess.run(
            ["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60
        )
        return result.returncode, result.stdout.splitlines(), result.stderr

    return run


SERVER = ["-m", "sglang.launch_server", "--device", "cpu"]
NO_GRAPH = ["--disable-decode-cuda-graph"]


@pytest.mark.parametrize(
    "spec", [["--speculative-algorithm", "ECOSPEC"], ["--speculative-algorithm=EAGLE3"]]
)
def test_speculative_decoding_gets_the_triton_backend(launch, spec):
    code, argv, err = launch("--model-path", "m", *spec, "--max-total-tokens", "256", *NO_GRAPH)
    assert code == 0, err
    tail = ["--model-path", "m", *spec, "--max-total-tokens", "256", *NO_GRAPH]
    assert argv == SERVER + tail + ["--attention-backend", "triton"]
    (line,) = err.splitlines()
    assert "adding --attention-backend triton" in line and "torch_native" in line


@pytest.mark.parametrize(
    "backend", [["--attention-backend", "triton"], ["--attention-backend=triton"], []]
)
def test_an_explicit_triton_backend_or_no_speculation_passes_unchanged(launch, backend):
    spec = ["--speculative-algorithm", "ECOSPEC"] if backend else []
    code, argv, err = launch("--model-path", "m", *spec, *backend, *NO_GRAPH)
    assert code == 0 and err == ""
    assert argv == SERVER + ["--model-path", "m", *spec, *backend, *NO_GRAPH]


def test_the_decode_graph_is_disabled_and_said_once(launch):
    spec = ["--speculative-algorithm", "ECOSPEC", "--attention-backend", "triton"]
    code, argv, err = launch("--model-path", "m", *spec)
    assert code == 0, err
    assert argv == SERVER + ["--model-path", "m", *spec, *NO_GRAPH]
    (line,) = err.splitlines()
    assert "adding --disable-decode-cuda-graph" in line and "CUDA graphs" in line


@pytest.mark.parametrize(
    "off",
    [
        ["--disable-cuda-graph"],
        ["--disable-decode-cuda-graph"],
        ["--cuda-graph-backend-decode", "disabled"],
        ["--cuda-graph-backend-decode=disabled", "--cuda-graph-backend-prefill=disabled"],
        ["--cuda-graph-backend-prefill", "disabled", "--disable-cuda-graph"],
    ],
)
def test_a_decode_graph_already_off_adds_nothing(launch, off):
    code, argv, err = launch("--model-path", "m", *off)
    assert code == 0 and err == ""
    assert argv == SERVER + ["--model-path", "m", *off]


@pytest.mark.parametrize(
    "graph",
    [
        ["--cuda-graph-backend-decode", "full"],
        ["--cuda-graph-backend-prefill=breakable"],
        ["--cuda-graph-bs-decode", "1", "2"],
        ["--cuda-graph-max-bs-decode", "8"],
        ["--cuda-graph-config", '{"decode": {"backend": "disabled"}}'],
        ["--enable-profile-cuda-graph"],
        ["--debug-cuda-graph"],
    ],
)
def test_a_flag_that_asks_for_graphs_is_refused(launch, graph):
    code, argv, err = launch("--model-path", "m", *graph, "--disable-cuda-graph")
    assert code == 2 and argv == []
    assert "error" in err and graph[0].split("=")[0] in err and "CUDA graphs" in err


@pytest.mark.parametrize(
    "backend", [["--attention-backend", "torch_native"], ["--attention-backend=intel_amx"]]
)
def test_another_backend_with_speculative_decoding_is_refused(launch, backend):
    code, argv, err = launch("--model-path", "m", "--speculative-algorithm", "ECOSPEC", *backend)
    assert code == 2 and argv == []
    assert "error" in err and "pass --attention-backend triton" in err
