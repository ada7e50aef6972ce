"""Whether the serving benchmark's servers fit in memory side by side (``--servers auto``)."""

import json
from pathlib import Path

# A CPU-mode server's memory besides its weights (SGLang's runtime in the launcher,
# scheduler and detokenizer processes, the small KV pool). Measured on the bandwidth
# testbed (2026-12-04): the scheduler's resident set 8.1 GB with 6.5 GB of float32 weights,
# the launcher and the detokenizer 0.8 GB each; with the weights at the served dtype, the
# estimate of --servers auto.
SERVER_OVERHEAD_BYTES = 3 * 2**30


def served_weight_bytes(cfg: dict) -> int:
    """The bytes of the target's and draft's weights at the dtype the servers load them in
    (``--dtype`` among the server flags; the checkpoint's own otherwise)."""
    sizes = {"float32": 4, "float16": 2, "bfloat16": 2, "half": 2, "float": 4}
    served = None
    flags = cfg["server_args"]
    for i, flag in enumerate(flags):
        if flag == "--dtype" and i + 1 < len(flags):
            served = flags[i + 1]
        elif flag.startswith("--dtype="):
            served = flag.split("=", 1)[1]
    total = 0
    for key in ("model_path", "draft_model_path"):
        if cfg[key] is None:
            continue
        directory = Path(cfg[key])
        stored = "bfloat16"
        config_file = directory / "config.json"
        if config_file.is_file():
            config = json.loads(config_file.read_text())
            stored = config.get("torch_dtype") or config.get("dtype") or stored
        scale = sizes.get(served, sizes.get(stored, 2)) / sizes.get(stored, 2)
        total += int(scale * sum(f.stat().st_size for f in directory.glob("*.safetensors")))
    return total


def resolve_server_mode(cfg: dict, log=print) -> str:
    """``cfg["servers"]`` made concrete: "auto" is "together" only on the CPU and when every
    server's estimated memory fits in the available memory with a quarter to spare; on a GPU
    each server would claim its ``--mem-fraction-static`` of one device."""
    if cfg["servers"] != "auto":
        return cfg["servers"]
    per_server = served_weight_bytes(cfg) + SERVER_OVERHEAD_BYTES
    need = per_server * len(cfg["algorithms"])
    available = _available_memory_bytes()
    if cfg["cpu"] and available is not None and need <= 0.75 * available:
        return "together"
    why = (
        "a GPU serves one at a time"
        if not cfg["cpu"]
        else f"{len(cfg['algorithms'])} servers need about {need / 2**30:.1f} GiB, "
        f"{(available or 0) / 2**30:.1f} GiB available"
    )
    log(f"[bench_serving] servers one at a time ({why})")
    return "one-at-a-time"


def _available_memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
