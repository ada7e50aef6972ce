"""Stage "env" of the device check: what the machine is (GPU, driver, memory, CPU cores),
the versions of torch, Triton and nvcc, which profiling tools exist, and the commit checked
(GPU_CHECK_COMMIT, since the device's copy of the tree has no .git). Writes env.json."""

import os
import shutil
import subprocess

import common
import torch


def command_output(*command: str) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=20)
        return (done.stdout + done.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable: {exc}"


def main(argv=None) -> int:
    args = common.parse_args(__doc__.splitlines()[0], argv)
    record = common.StageRecord(args.out, "env", args.dry_run)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    info = dict(
        commit=os.environ.get("GPU_CHECK_COMMIT", "unknown"),
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        triton=triton_version,
        cpu_cores=os.cpu_count(),
        nvcc=command_output("nvcc", "--version").splitlines()[-1:],
        tools={t: shutil.which(t) for t in ("nvcc", "compute-sanitizer", "ncu", "ninja")},
    )
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            gpu_memory_gib=props.total_memory / 2**30,
            multiprocessors=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
            nvidia_smi=command_output(
                "nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                "--format=csv,noheader",
            ),
        )  # fmt: skip
    elif not args.dry_run:
        record.fail("no GPU visible to torch")
    record.info(**info)
    print("\n".join(f"{k}: {v}" for k, v in info.items()))
    return record.exit_code()


if __name__ == "__main__":
    raise SystemExit(main())
