"""The deployment files: Dockerfile, scripts/docker_install.sh, compose.yaml, docs/deploy.md.

The image cannot be built here (no Docker, no GPU), so its steps run outside Docker: the
install script runs on a copy of the build context (``.dockerignore`` applied), CPU-only and
into a temporary ``--target``, and every launch and benchmark command of the compose file and
of the docs is parsed by sglang's own argument parsers. ``scripts/test.sh`` lints the
Dockerfile with hadolint.
"""

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from sglang.srt.server_args import ServerArgs
from sglang_ecospec.settings import ENV_PREFIX, EcoSpecSettings

ROOT = Path(__file__).resolve().parents[2]
INSTALL_SCRIPT = "scripts/docker_install.sh"
# A build context that grows past this has picked up an environment or build outputs.
MAX_CONTEXT_BYTES = 20 * 2**20


def pinned_sglang() -> str:
    pins = re.findall(r"^sglang==([^\s#]+)", (ROOT / "requirements.txt").read_text(), re.M)
    assert len(pins) == 1, f"requirements.txt must pin sglang once, found {pins}"
    return pins[0]


def dockerignore_patterns() -> list[re.Pattern]:
    """.dockerignore as regexes over context-relative paths (Docker's rules: ``*`` and ``?``
    stay inside one path component, ``**`` spans any number; a matched directory is excluded
    with everything below it). Negations are not supported by this reader."""
    patterns = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        assert not line.startswith("!"), f"negated .dockerignore pattern not supported: {line}"
        parts = re.split(r"(\*\*/|\*\*|\*|\?)", line.strip("/"))
        wildcards = {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}
        patterns.append(re.compile("".join(wildcards.get(p, re.escape(p)) for p in parts)))
    return patterns


def copy_build_context(dest: Path) -> Path:
    """Copies what ``docker build .`` sends: the repository directory minus .dockerignore."""
    patterns = dockerignore_patterns()

    def ignored(rel: str) -> bool:
        return any(p.fullmatch(rel) for p in patterns)

    total = 0
    for dirpath, dirnames, filenames in os.walk(ROOT):
        rel_dir = Path(dirpath).relative_to(ROOT)
        dirnames[:] = [d for d in dirnames if not ignored((rel_dir / d).as_posix())]
        for name in filenames:
            rel = (rel_dir / name).as_posix()
            if ignored(rel):
                continue
            total += (ROOT / rel).stat().st_size
            assert total < MAX_CONTEXT_BYTES, f"build context over {MAX_CONTEXT_BYTES} B at {rel}"
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
    return dest


def run_install(context: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, SGL_ECOSPEC_CUDA="0", MAX_JOBS="2")
    env.pop("PYTHONPATH", None)
    return subprocess.run(
        ["bash", str(context / INSTALL_SCRIPT), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


# --- Dockerfile and build context -------------------------------------------------------


def test_dockerfile_builds_on_the_pinned_sglang_image_with_the_install_script():
    text = (ROOT / "Dockerfile").read_text()
    image = f"lmsysorg/sglang:v{pinned_sglang()}"
    assert re.findall(r"^FROM\s+(\S+)", text, re.M) == [image]
    assert f'org.opencontainers.image.base.name="{image}"' in text
    runs = re.findall(r"^RUN\s+(.*)$", text, re.M)
    assert runs == ['MAX_JOBS="${MAX_JOBS}" SGL_ECOSPEC_CUDA=1 bash ' + INSTALL_SCRIPT]
    # The source tree (COPY . . into the first WORKDIR) must not be the containers' working
    # directory, or `python3 -m sglang.launch_server` imports the uncompiled sources.
    workdirs = re.findall(r"^WORKDIR\s+(\S+)", text, re.M)
    assert re.search(r"^COPY \. \.$", text, re.M) and len(workdirs) == 2
    assert not Path(workdirs[1]).is_relative_to(workdirs[0])


def test_build_context_has_the_sources_and_no_environment_or_outputs(tmp_path):
    context = copy_build_context(tmp_path)
    for needed in ["setup.py", "pyproject.toml", "requirements.txt", INSTALL_SCRIPT]:
        assert (context / needed).is_file(), needed
    for package in ["csrc", "sgl_ecospec", "python/sglang_ecospec"]:
        assert any((context / package).iterdir()), package
    copied = {p.relative_to(context).as_posix() for p in context.rglob("*")}
    for excluded in [".git", ".venv", "build", "results"]:
        assert excluded not in copied
    assert not [p for p in copied if p.endswith((".so", ".pyc")) or "egg-info" in p]


# --- building from source: against the environment's torch ------------------------------


def test_build_never_fetches_its_own_torch():
    """``pip install .`` would build in an isolated environment with whatever torch
    ``[build-system] requires`` names (unpinned: the newest), whose C++ ABI the serving torch
    does not share. torch is not a build requirement; where it cannot be imported setup.py
    says to build with ``--no-build-isolation``, and so do the docs."""
    import tomllib

    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    assert not [r for r in requires if re.match(r"torch\b", r)], requires
    no_torch = (
        "import sys; sys.modules['torch'] = None; sys.argv = ['setup.py', '--name']; "
        "exec(compile(open('setup.py').read(), 'setup.py', 'exec'))"
    )
    result = subprocess.run(
        [sys.executable, "-c", no_torch], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "`pip install --no-build-isolation .`" in result.stderr
    for doc in ["docs/sglang.md", "docs/deploy.md"]:
        commands = re.findall(r"pip3? install[^\n`]*", (ROOT / doc).read_text())
        builds = [c for c in commands if re.search(r"\s(-e\s+)?\.(\s|$)", c)]
        assert builds and all("--no-build-isolation" in c for c in builds), (doc, builds)


# --- scripts/docker_install.sh, outside Docker ------------------------------------------


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The install script run on a copy of the build context into a fresh target (CPU-only
    build of the extension, about 1.5 minutes on 2 cores)."""
    context = copy_build_context(tmp_path_factory.mktemp("context"))
    target = tmp_path_factory.mktemp("install") / "site"
    result = run_install(context, "--target", str(target))
    assert result.returncode == 0, result.stdout + result.stderr
    return context, target, result.stdout


@pytest.mark.slow  # builds the extension in a fresh environment (minutes)
def test_install_script_builds_the_extension_and_registers_the_plugin(installed):
    context, target, stdout = installed
    assert f"sglang {pinned_sglang()}" in stdout
    assert "[docker_install] ok: plugin ecospec -> CustomSpecAlgo('ECOSPEC')" in stdout
    assert list((target / "sgl_ecospec").glob("_C*.so"))
    entry_points = next(target.glob("sgl_ecospec-*.dist-info")) / "entry_points.txt"
    assert "ecospec = sglang_ecospec:register" in entry_points.read_text()
    # The in-tree build outputs are removed (they would bloat the image layer).
    assert not (context / "build").exists()
    assert not list(context.glob("*.egg-info"))


INSTALLED_CHECK = """
import json, sys
import torch
import sgl_ecospec
from sgl_ecospec import select_verify_set, topk_to_bitmap
from sgl_ecospec.synthetic import random_draft_tree
from sglang.srt.plugins import load_plugins
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

torch.set_num_threads(1)
load_plugins()
cases = []
for batch, nodes, layers, experts, top_k, budget, ties in json.loads(sys.argv[1]):
    tree = random_draft_tree(batch, nodes, layers, experts, top_k, seed=nodes, tie_levels=ties)
    ids = torch.randint(0, experts, (batch, nodes, top_k))
    same_bitmaps = torch.equal(
        topk_to_bitmap(ids, experts, impl="native"), topk_to_bitmap(ids, experts, impl="reference")
    )
    for policy in ("ecospec", "confidence"):
        picks = [
            select_verify_set(
                tree.scores, tree.parents, tree.node_experts, budget,
                root_experts=tree.root_experts, policy=policy, share_buffer=True, impl=impl,
            )
            for impl in ("native", "reference")
        ]
        cases.append(same_bitmaps and torch.equal(*picks) and picks[0].shape == (batch, budget))
print(json.dumps({
    "module": sgl_ecospec.__file__,
    "algorithm": repr(SpeculativeAlgorithm.from_string("ECOSPEC")),
    "cases": cases,
}))
"""


@pytest.mark.slow
def test_installed_extension_matches_the_reference_ops(installed, tmp_path):
    _, target, _ = installed
    # (batch, nodes, layers, experts, top_k, budget, tie levels): one or two bitmap words,
    # a single node, budget 0 and budget = all nodes, tied scores.
    cases = [
        (3, 20, 4, 128, 8, 7, 0),
        (2, 12, 2, 64, 4, 11, 0),
        (1, 1, 1, 64, 1, 1, 0),
        (2, 9, 3, 96, 4, 0, 0),
        (4, 16, 2, 128, 4, 5, 3),
    ]
    env = dict(os.environ, PYTHONPATH=str(target), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-c", INSTALLED_CHECK, json.dumps(cases)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["module"].startswith(str(target))
    assert report["algorithm"] == "CustomSpecAlgo('ECOSPEC')"
    assert report["cases"] == [True] * (2 * len(cases))


def test_install_script_refuses_an_sglang_other_than_the_pin(tmp_path):
    context = copy_build_context(tmp_path / "context")
    requirements = context / "requirements.txt"
    requirements.write_text(
        re.sub(r"^sglang==\S+", "sglang==0.0.1", requirements.read_text(), flags=re.M)
    )
    target = tmp_path / "site"
    result = run_install(context, "--target", str(target))
    assert result.returncode == 1
    assert f"has sglang {pinned_sglang()}, requirements.txt pins 0.0.1" in result.stderr
    assert not target.exists()


def test_install_script_rejects_unknown_arguments(tmp_path):
    context = copy_build_context(tmp_path)
    for args in [("--prefix", "/tmp/x"), ("--target",)]:
        result = run_install(context, *args)
        assert result.returncode == 2, args
        assert "[docker_install] error" in result.stderr


# --- commands: compose.yaml and docs/deploy.md ------------------------------------------


class _ParserError(Exception):
    pass


class _StrictParser(argparse.ArgumentParser):
    """Raises instead of exiting, so a bad command names itself in the failure."""

    def error(self, message):
        raise _ParserError(message)


def parse_launch(argv: list[str]) -> argparse.Namespace:
    """``python -m sglang.launch_server ARGV`` as the launcher parses it (same parser)."""
    parser = _StrictParser(prog="sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    try:
        return parser.parse_args(argv)
    except _ParserError as exc:
        pytest.fail(f"sglang.launch_server rejects {shlex.join(argv)}: {exc}")


def parse_bench(argv: list[str], monkeypatch) -> argparse.Namespace:
    """``python -m sglang.benchmark.serving ARGV`` up to the point where it would run."""
    from sglang.benchmark import serving

    parsed = []
    monkeypatch.setattr(serving, "run_benchmark", parsed.append)
    monkeypatch.setattr(serving, "ArgumentParser", _StrictParser)
    monkeypatch.setattr(sys, "argv", ["sglang.benchmark.serving", *argv])
    try:
        serving.cli_main()
    except _ParserError as exc:
        pytest.fail(f"sglang.benchmark.serving rejects {shlex.join(argv)}: {exc}")
    return parsed[0]


def after_module(command: list[str], module: str) -> list[str] | None:
    """The arguments after ``python3 -m MODULE`` in a command, or None."""
    for i in range(len(command) - 2):
        if command[i].startswith("python") and command[i + 1 : i + 3] == ["-m", module]:
            return command[i + 3 :]
    return None


def interpolate(value: str, environ: dict[str, str]) -> str:
    """Compose's ``${VAR}`` / ``${VAR:-default}`` substitution."""

    def substitute(match):
        name, default = match.group(1), match.group(3)
        if environ.get(name):
            return environ[name]
        assert default is not None, f"${{{name}}} has no default in compose.yaml"
        return default

    return re.sub(r"\$\{(\w+)(:-([^}]*))?\}", substitute, value)


def compose(environ: dict[str, str] | None = None) -> dict:
    text = interpolate((ROOT / "compose.yaml").read_text(), environ or {})
    return yaml.safe_load(text)["services"]


def check_ecospec_launch(args: argparse.Namespace) -> None:
    assert args.speculative_algorithm == "ECOSPEC"
    # topk 1 is SGLang's chain path, where ECOSPEC never selects (docs/sglang.md).
    assert args.speculative_eagle_topk > 1
    assert args.speculative_num_draft_tokens > args.speculative_num_steps
    assert (args.tp_size, args.ep_size) == (8, 8)
    assert args.enable_metrics


def test_compose_server_launches_ecospec_on_8_gpus_with_valid_settings():
    server = compose()["server"]
    args = parse_launch(after_module(server["command"], "sglang.launch_server"))
    check_ecospec_launch(args)
    assert (args.model_path, args.speculative_draft_model_path) == (
        "/models/Qwen3-235B-A22B",
        "/models/Qwen3-235B-A22B-EAGLE3",
    )
    (gpus,) = server["deploy"]["resources"]["reservations"]["devices"]
    assert gpus["driver"] == "nvidia" and gpus["count"] == 8 and "gpu" in gpus["capabilities"]
    assert server["ports"] == [f"{args.port}:{args.port}"]
    assert f"http://localhost:{args.port}/health" in server["healthcheck"]["test"]
    assert any(v.endswith(":/models:ro") for v in server["volumes"])
    ecospec_env = {k: str(v) for k, v in server["environment"].items() if k.startswith(ENV_PREFIX)}
    assert EcoSpecSettings.from_env(ecospec_env).policy == "ecospec"
    # The A/B switch reaches the server's environment.
    switched = compose({"SGLANG_ECOSPEC_POLICY": "confidence"})["server"]["environment"]
    switched_env = {k: str(v) for k, v in switched.items() if k.startswith(ENV_PREFIX)}
    assert EcoSpecSettings.from_env(switched_env).policy == "confidence"


def test_compose_bench_waits_for_the_server_and_targets_it(monkeypatch):
    services = compose({"TARGET_MODEL": "/models/gpt-oss-120b"})
    server = parse_launch(after_module(services["server"]["command"], "sglang.launch_server"))
    bench_service = services["bench"]
    bench = parse_bench(
        after_module(bench_service["command"], "sglang.benchmark.serving"), monkeypatch
    )
    assert bench_service["depends_on"]["server"]["condition"] == "service_healthy"
    assert (bench.backend, bench.host, bench.port) == ("sglang", "server", server.port)
    # The benchmark tokenizes with the served model; random-ids prompts need no download.
    assert bench.model == server.model_path == "/models/gpt-oss-120b"
    assert bench.dataset_name == "random-ids"
    assert bench_service["image"] == services["server"]["image"]


def doc_commands() -> list[list[str]]:
    """Every shell command in docs/deploy.md's ``bash`` blocks, continuation lines joined."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "docs/deploy.md").read_text(), re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True) for line in lines if line.strip()]


def docker_env(command: list[str]) -> dict[str, str]:
    pairs = [command[i + 1] for i, token in enumerate(command[:-1]) if token == "-e"]
    return dict(pair.split("=", 1) for pair in pairs)


def test_doc_launch_commands_parse_and_serve_both_models_with_ecospec():
    launches = {}
    for command in doc_commands():
        argv = after_module(command, "sglang.launch_server")
        if argv is None:
            continue
        args = parse_launch(argv)
        check_ecospec_launch(args)
        ecospec_env = {k: v for k, v in docker_env(command).items() if k.startswith(ENV_PREFIX)}
        EcoSpecSettings.from_env(ecospec_env)
        launches[args.model_path] = args
    assert set(launches) == {"/models/Qwen3-235B-A22B", "/models/gpt-oss-120b"}
    assert launches["/models/Qwen3-235B-A22B"].reasoning_parser == "qwen3"
    assert launches["/models/gpt-oss-120b"].reasoning_parser == "gpt-oss"


def test_documented_launches_pass_ecospecs_startup_checks(tmp_path):
    """Every documented ECOSPEC launch (docs/deploy.md, compose.yaml), resolved by SGLang as
    the worker sees it and checked by the plugin's startup checks (draft tree, parallel
    layout). The models are stand-ins of the same families (a config only) on the CPU."""
    from plugin._helpers import write_model_configs
    from sglang.srt.server_args import prepare_server_args
    from sglang_ecospec import algorithm, deployment

    models = write_model_configs(tmp_path)
    family = {"/models/Qwen3-235B-A22B": "qwen3-moe", "/models/gpt-oss-120b": "gpt-oss"}
    commands = [*doc_commands(), compose()["server"]["command"]]
    launches = [after_module(c, "sglang.launch_server") for c in commands]
    launches = [argv for argv in launches if argv is not None]
    algorithm.register_algorithm()
    for argv in launches:
        argv = list(argv)
        model = argv[argv.index("--model-path") + 1]
        for flag in ("--model-path", "--speculative-draft-model-path"):
            argv[argv.index(flag) + 1] = str(models / family[model])
        args = prepare_server_args([*argv, "--device", "cpu", "--skip-tokenizer-init"])
        args.resolve_once()
        deployment.check_startup(args)
    assert len(launches) == 3


def test_doc_bench_commands_parse(monkeypatch):
    argvs = [after_module(command, "sglang.benchmark.serving") for command in doc_commands()]
    benches = [parse_bench(argv, monkeypatch) for argv in argvs if argv is not None]
    assert [(b.backend, b.port, b.dataset_name) for b in benches] == [
        ("sglang", 30000, "random-ids")
    ]
