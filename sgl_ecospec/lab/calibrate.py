"""The ``sgl-ecospec calibrate`` command: the target's forward timed on this device under
controlled routing, the MoESD model fitted to the times, the profile file written.

Each grid point is one target forward of B requests x gamma new tokens over a prefilled
context of ``--context`` tokens per request, with every MoE layer's routing forced
(:class:`ControlledRouting`) so that the forward touches exactly U distinct experts per
layer; the experts module then really runs those U experts. The draft's step (one row per
request over the same context) and the greedy accept step (argmax over the verify logits)
are timed per batch size, so that all ten parameters are fitted. The fit and the file are
:mod:`sgl_ecospec.costmodel.calibration`'s; docs/costmodel.md, "Calibration".

Shape legend: B = requests, T = new tokens per request, C = context tokens, L = MoE
layers, K = experts per token, E = experts per layer, H = hidden size, V = vocabulary.
"""

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from sgl_ecospec.costmodel.calibration import (
    COMPUTE_DTYPE_OF,
    CalibrationGrid,
    CalibrationProfile,
    ForwardTiming,
    calibrate,
    device_name,
    device_sync,
    measure_hardware,
    median_seconds,
    time_grid,
)
from sgl_ecospec.costmodel.profiles import ModelProfile, ridge_tokens
from sgl_ecospec.lab.command_line import add_command

DEFAULT_BATCH_SIZES = "1,2,4,8,16"
DEFAULT_TOKENS = "1,2,4,8"
DEFAULT_UNIQUE_EXPERTS = "8,16,32,64"
DEFAULT_REPEATS = 5
# The CPU development server's OpenMP threads (scripts/launch_cpu.sh, ECOSPEC_CPU_THREADS).
DEFAULT_CPU_THREADS = 1
DEFAULT_CONTEXT = 32
DRAFT_TOPK = 4  # children per beam the timed draft step picks (SGLang's --speculative-eagle-topk)

HELP = "time the target on this device and fit the cost model (a calibration profile)"
DESCRIPTION = (
    "Times the target's forward (the testbed by default) on the device it runs on over a grid "
    "of batch sizes, tokens per request and unique experts per layer (routing forced), plus "
    "the draft and accept steps, fits the ten-parameter MoESD model (least squares, relative "
    "residuals) and writes the profile file the server reads (SGLANG_ECOSPEC_PROFILE=FILE)."
)


class ControlledRouting:
    """Forces every MoE layer's router to send each token to chosen experts.

    A forward hook on each MoE layer's ``mlp.gate`` (a transformers TopKRouter returning
    (logits, weights, ids)) replaces the ids (and sets equal weights 1 / K) while an
    assignment is set; it runs before any other hook, so the target's routing capture records
    the forced routing, and the experts module computes exactly the forced experts.

    Args:
        target: the :class:`sgl_ecospec.lab.engine.target.TargetModel`.
        seed: picks which experts each assignment uses.
    """

    def __init__(self, target, seed: int = 0):
        self.target = target
        self.num_experts, self.top_k = target.num_experts, target.top_k
        self.generator = torch.Generator().manual_seed(seed)
        self._ids: dict[int, torch.Tensor] = {}
        layers = target.model.model.layers
        self._handles = [
            layers[i].mlp.gate.register_forward_hook(self._hook(i), prepend=True)
            for i in target.moe_layers
        ]

    def assign(self, tokens: int, unique: int) -> None:
        """Routes the next forwards' ``tokens`` rows so that each MoE layer touches exactly
        ``unique`` experts: per layer a fresh random set of ``unique`` experts, token i taking
        the K of them at slots iK .. iK + K - 1 (mod ``unique``), so that no token repeats an
        expert and, as tokens x K >= unique, every slot is used."""
        k, e = self.top_k, self.num_experts
        if not k <= unique <= min(e, tokens * k):
            raise ValueError(
                f"{tokens} tokens of top-{k} routing can touch {k}..{min(e, tokens * k)} "
                f"experts per layer, not {unique}"
            )
        slots = (torch.arange(tokens)[:, None] * k + torch.arange(k)) % unique  # [B*T, K]
        device = self.target.device
        for layer in self.target.moe_layers:
            chosen = torch.randperm(e, generator=self.generator)[:unique]
            self._ids[layer] = chosen[slots].to(device)

    def clear(self) -> None:
        """Back to the router's own choice."""
        self._ids.clear()

    def remove(self) -> None:
        """Removes the hooks."""
        for handle in self._handles:
            handle.remove()

    def _hook(self, layer: int):
        def hook(module, inputs, output):
            forced = self._ids.get(layer)
            if forced is None:
                return None
            if not (isinstance(output, tuple) and len(output) == 3):
                raise TypeError(
                    "controlled routing needs a router returning (logits, weights, ids), got "
                    f"{type(output).__name__} from {type(module).__name__}"
                )
            logits, weights, ids = output
            if ids.shape != forced.shape:
                raise RuntimeError(
                    f"layer {layer}: the forward routes {tuple(ids.shape)} ids, the assignment "
                    f"was made for {tuple(forced.shape)}"
                )
            return logits, torch.full_like(weights, 1.0 / self.top_k), forced

        return hook


def unique_experts_per_layer(routing: torch.Tensor) -> float:
    """Mean over layers of the distinct experts in ``routing`` (int64 ``[B, T, L, K]``)."""
    layers = routing.shape[2]
    counts = [routing[:, :, layer].unique().numel() for layer in range(layers)]
    return sum(counts) / layers


class TargetTimer:
    """Times target forwards under controlled routing over a prefilled context.

    Args:
        target: the ``TargetModel``.
        routing: its :class:`ControlledRouting`.
        context: C, committed tokens per request before each timed forward.
        repeats: timed forwards per point (median), after one warm-up.
        seed: input tokens.
    """

    def __init__(self, target, routing: ControlledRouting, context: int, repeats: int, seed=0):
        self.target, self.routing = target, routing
        self.context, self.repeats = context, repeats
        self.generator = torch.Generator().manual_seed(seed)
        self.sync = device_sync(target.device)
        self._caches: dict[int, object] = {}

    def _tokens(self, batch: int, rows: int) -> torch.Tensor:
        vocab = self.target.config.vocab_size
        ids = torch.randint(vocab, (batch, rows), generator=self.generator)
        return ids.to(self.target.device)

    def _cache(self, batch: int):
        """The prefilled cache of ``batch`` requests (C committed tokens each)."""
        if batch not in self._caches:
            cache = self.target.new_cache(batch)
            context, device = self.context, self.target.device
            positions = torch.arange(context, device=device).expand(batch, -1)
            causal = torch.ones(context, context, dtype=torch.bool, device=device).tril()
            self.target.forward(
                self._tokens(batch, context), positions, cache, causal.expand(batch, -1, -1)
            )
            cache.commit(torch.arange(context, device=device).expand(batch, -1))
            self._caches[batch] = cache
        return self._caches[batch]

    def __call__(self, batch: int, tokens: int, unique: int) -> ForwardTiming:
        """One grid point: median seconds of the forward, and the unique experts per layer
        its routing really had."""
        cache = self._cache(batch)
        device = self.target.device
        ids = self._tokens(batch, tokens)
        positions = (self.context + torch.arange(tokens, device=device)).expand(batch, -1)
        causal = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()
        mask = causal.expand(batch, -1, -1)
        drop_pending = torch.full((batch, 1), -1, dtype=torch.int64, device=device)
        times, measured = [], []
        for repeat in range(self.repeats + 1):  # the first forward warms up
            self.routing.assign(batch * tokens, unique)
            self.sync()
            start = time.perf_counter()
            out = self.target.forward(ids, positions, cache, mask)
            self.sync()
            elapsed = time.perf_counter() - start
            self.routing.clear()
            cache.commit(drop_pending)
            measured.append(unique_experts_per_layer(out.routing))
            if repeat:
                times.append(elapsed)
        return ForwardTiming(statistics.median(times), sum(measured) / len(measured))


def draft_timer(draft, target, context: int, repeats: int):
    """batch -> median seconds of one draft step (one row per request over C context rows,
    then its top-k children), the EAGLE-3 draft on the target's device."""
    hidden = draft.config.hidden_size
    sync = device_sync(target.device)

    def time_step(batch: int) -> float:
        device, dtype = target.device, next(draft.parameters()).dtype
        embeds = torch.randn(batch, context + 1, hidden, device=device, dtype=dtype)
        states = torch.randn(batch, context + 1, hidden, device=device, dtype=dtype)
        positions = torch.arange(context + 1, device=device).expand(batch, -1)
        with torch.no_grad():
            prefix = draft(embeds[:, :context], states[:, :context], positions[:, :context])

            def step():
                out = draft(
                    embeds[:, context:],
                    states[:, context:],
                    positions[:, context:],
                    past=(prefix.key, prefix.value),
                )
                out.logits.float().softmax(-1).topk(DRAFT_TOPK, -1)

            return median_seconds(step, repeats, sync)

    return time_step


def reject_timer(target, tokens: int, repeats: int):
    """batch -> median seconds of the greedy accept step over B x ``tokens`` verify logits
    (argmax, comparison with the drafts, accepted prefix length)."""
    sync = device_sync(target.device)
    vocab, device = target.config.vocab_size, target.device
    dtype = target.model.dtype

    def time_step(batch: int) -> float:
        logits = torch.randn(batch, tokens, vocab, device=device, dtype=dtype)
        drafts = torch.randint(vocab, (batch, tokens), device=device)

        def step():
            predicted = logits.argmax(-1)  # [B, T]
            matches = (predicted[:, :-1] == drafts[:, 1:]).long()
            matches.cumprod(1).sum(1)

        return median_seconds(step, repeats, sync)

    return time_step


def target_profile(target, name: str, dtype: torch.dtype, source: str) -> ModelProfile:
    """The cost model's ``ModelProfile`` of a loaded transformers MoE target, counted from
    its parameters: routed experts apart, the input embedding left out (a step gathers rows
    of it) unless tied to the lm_head."""
    model, config = target.model, target.config
    experts = [model.model.layers[i].mlp.experts for i in target.moe_layers]
    routed = sum(p.numel() for module in experts for p in module.parameters())
    per_expert = sum(p.numel() for p in experts[0].parameters()) // target.num_experts
    embedding = model.get_input_embeddings().weight
    tied = embedding is model.get_output_embeddings().weight
    dense = sum(p.numel() for p in model.parameters()) - routed
    dense -= 0 if tied else embedding.numel()
    element = embedding.element_size()
    dtype_name = str(dtype).removeprefix("torch.")
    return ModelProfile(
        name=name,
        moe_layers=len(target.moe_layers),
        num_experts=target.num_experts,
        top_k=target.top_k,
        hidden=config.hidden_size,
        moe_intermediate=config.moe_intermediate_size,
        bytes_per_expert=per_expert * element,
        dense_params=dense,
        bytes_per_dense_param=element,
        compute_dtype=COMPUTE_DTYPE_OF[dtype_name],
        vocab_size=config.vocab_size,
        notes=f"counted from the parameters of {source} loaded in {dtype_name}",
    )


def device_slug(device: torch.device) -> str:
    """File-name form of the device: "cpu", or the GPU's name ("nvidia-h200")."""
    if device.type != "cuda":
        return device.type
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")


def _sizes(flag: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values) or len(set(values)) != len(values):
        raise ValueError(f"{flag} must hold distinct integers >= 1, got {text!r}")
    return values


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Registers ``calibrate`` on ``subparsers`` (from ``ArgumentParser.add_subparsers``)."""
    parser = add_command(subparsers, "calibrate", run, HELP, DESCRIPTION)
    models = parser.add_argument_group("model")
    models.add_argument(
        "--small", action="store_true", help="time the small testbed (default: the full one)"
    )
    models.add_argument("--target", metavar="DIR", help="a target checkpoint instead")
    models.add_argument(
        "--draft", metavar="DIR", help="its EAGLE-3 draft (default: the testbed's; none: no draft)"
    )
    models.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    models.add_argument("--dtype", choices=sorted(COMPUTE_DTYPE_OF), default="float32")
    models.add_argument(
        "--threads",
        type=int,
        help=f"torch CPU threads (default: {DEFAULT_CPU_THREADS} on the CPU, as the CPU server "
        "runs, else torch's)",
    )
    grid = parser.add_argument_group("grid")
    grid.add_argument("--batch-sizes", default=DEFAULT_BATCH_SIZES, help="requests per forward")
    grid.add_argument("--tokens", default=DEFAULT_TOKENS, help="new tokens per request (gamma)")
    grid.add_argument(
        "--unique-experts",
        default=DEFAULT_UNIQUE_EXPERTS,
        help="distinct experts per MoE layer the routing is forced to (clamped per point)",
    )
    grid.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, help="timed runs per point")
    grid.add_argument(
        "--context", type=int, default=DEFAULT_CONTEXT, help="prefilled tokens per request"
    )
    grid.add_argument("--seed", type=int, default=0, help="input tokens and expert choice")
    parser.add_argument(
        "--out", metavar="FILE", help="profile file (default results/calibration/<device>.json)"
    )
    return parser


def _device(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(f"--device {text!r} is not a torch device (cpu, cuda, cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {text}: no CUDA device is visible; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda[:N], got {text!r}")
    return device


def _models(args) -> tuple[str, str | None, str]:
    """(target dir, draft dir or None, model name) from the flags; the testbed is built
    first when missing (announced, as ``bench`` does)."""
    if args.target is not None:
        if not Path(args.target).is_dir():
            raise FileNotFoundError(f"--target {args.target!r} is not a directory")
        draft = None if args.draft in (None, "none") else args.draft
        # A testbed's target/ folder is named by its build folder as well.
        return args.target, draft, "/".join(Path(args.target).resolve().parts[-2:])
    from sgl_ecospec.lab.config import testbed_models

    target, draft = testbed_models(args.small)
    if args.draft is not None:
        draft = None if args.draft == "none" else args.draft
    return target, draft, f"testbed-{'small' if args.small else 'full'}"


def run(args: argparse.Namespace) -> int:
    """Times, fits, prints the fit table and writes the profile file. Returns 0."""
    started = time.perf_counter()
    grid = CalibrationGrid(
        _sizes("--batch-sizes", args.batch_sizes),
        _sizes("--tokens", args.tokens),
        _sizes("--unique-experts", args.unique_experts),
        args.repeats,
    )
    if args.context < 1:
        raise ValueError(f"--context must be >= 1, got {args.context}")
    device, dtype = _device(args.device), getattr(torch, args.dtype)
    threads = args.threads
    if threads is None and device.type == "cpu":
        threads = DEFAULT_CPU_THREADS
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    target_dir, draft_dir, name = _models(args)
    if draft_dir is not None and not Path(draft_dir).is_dir():
        raise FileNotFoundError(f"--draft {draft_dir!r} is not a directory")
    from sgl_ecospec.lab.eagle3 import Eagle3Draft
    from sgl_ecospec.lab.engine.target import TargetModel

    target = TargetModel(target_dir, device=device, dtype=dtype)
    model = target_profile(target, name, dtype, target_dir)
    points = grid.target_points(model.num_experts, model.top_k)  # checks --unique-experts
    label = device_name(device)
    _log(f"[calibrate] {name} ({args.dtype}) on {label}: measuring the device")
    hardware = measure_hardware(device, dtype, f"measured {device_slug(device)}")
    _log(
        f"[calibrate] {hardware.memory_bandwidth / 1e9:.1f} GB/s copy, "
        f"{hardware.peak_bf16_flops / 1e9:.1f} GFLOP/s matmul, ridge "
        f"{ridge_tokens(model, hardware):.1f} tokens; timing {len(points)} target points"
    )
    routing = ControlledRouting(target, seed=args.seed)
    timer = TargetTimer(target, routing, args.context, args.repeats, seed=args.seed)
    time_draft = None
    if draft_dir is not None:
        draft = Eagle3Draft.from_pretrained(draft_dir, dtype=dtype, device=device).eval()
        time_draft = draft_timer(draft, target, args.context, args.repeats)
    time_reject = reject_timer(target, max(grid.tokens_per_request), args.repeats)

    def progress(done: int, total: int, point) -> None:
        union = "" if point.unique_experts is None else f" U={point.unique_experts:g}"
        _log(
            f"[calibrate {done}/{total} {time.perf_counter() - started:.0f}s] {point.kind} "
            f"B={point.batch} gamma={point.gamma}{union}: {point.seconds * 1e3:.3f} ms"
        )

    with torch.no_grad():
        timed = time_grid(
            grid,
            model.num_experts,
            model.top_k,
            timer,
            time_draft=time_draft,
            time_reject=time_reject,
            progress=progress,
        )
    command = "sgl-ecospec " + " ".join(sys.argv[1:]) if sys.argv[1:] else ""
    profile = calibrate(
        timed, model, hardware, device=label, dtype=args.dtype, grid=grid, command=command
    )
    out = Path(args.out or f"results/calibration/{device_slug(device)}.json")
    profile.save(out)
    print(format_fit(profile))
    print(f"wrote {out} ({time.perf_counter() - started:.0f} s)")
    return 0


def format_fit(profile: CalibrationProfile) -> str:
    """The fit table: parameters, then every point's measured and predicted time."""
    p = profile.params
    lines = [
        f"calibration: {profile.model.name} ({profile.dtype}) on {profile.device}",
        f"  knee lam x RP = {p.lam * ridge_tokens(profile.model, profile.hardware):.1f} tokens",
        "param          value",
    ]
    units = {"lam": "", "s": ""}
    for key, value in p.as_dict().items():
        held = "  (held: not timed)" if key in profile.fixed else ""
        unit = units.get(key, " ms")
        shown = value if key in units else value * 1e3
        lines.append(f"{key:<12} {shown:>12.5g}{unit}{held}")
    lines.append("kind    batch gamma unique  measured_ms predicted_ms residual")
    predicted, residuals = profile.predicted_seconds(), profile.residuals()
    for point, pred, res in zip(profile.points, predicted, residuals, strict=True):
        union = "-" if point.unique_experts is None else f"{point.unique_experts:.1f}"
        lines.append(
            f"{point.kind:<7} {point.batch:>5} {point.gamma:>5} {union:>6} "
            f"{point.seconds * 1e3:>12.3f} {pred * 1e3:>12.3f} {res:>+8.1%}"
        )
    lines.append(
        f"residuals: rms {profile.rms_residual:.1%}, max {profile.max_abs_residual:.1%} "
        f"over {len(profile.points)} points"
    )
    return "\n".join(lines)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
