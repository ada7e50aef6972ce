"""Model and hardware numbers the cost model needs, with where each one comes from.

Model numbers come from the public Hugging Face ``config.json`` of each checkpoint;
``dense_params`` is computed below with one formula per model (norms, biases, attention
sinks and rotary buffers are left out: each is under 0.1% of the total). The input embedding
is left out too: a decode step gathers B rows of it, it does not stream the whole matrix.

Hardware numbers are the vendor's dense (no 2:4 sparsity) peaks for one SXM GPU. A name
like ``8xh200`` gives the aggregate of 8 GPUs (bandwidth and FLOP/s times 8), the right
first-order view of a tensor/expert-parallel deployment; it ignores communication.
"""

import dataclasses
import re

# fp32: a model run in float32, e.g. the testbed on a CPU (``calibration``).
COMPUTE_DTYPES = ("bf16", "fp8", "fp32")
# Bytes of one weight stored in the compute dtype: sets the ridge point in tokens.
_DTYPE_BYTES = {"bf16": 2, "fp8": 1, "fp32": 4}


@dataclasses.dataclass(frozen=True)
class ModelProfile:
    """One MoE target model, as a decode step sees it.

    Attributes:
        name: lower-case id, e.g. "qwen3-235b-a22b".
        moe_layers: layers with routed experts.
        num_experts: E, routed experts per MoE layer (shared experts count as dense).
        top_k: K, routed experts per token.
        hidden: model hidden size.
        moe_intermediate: intermediate size of one routed expert (gate, up: hidden x
            moe_intermediate; down: moe_intermediate x hidden).
        bytes_per_expert: bytes of one routed expert's weights in the checkpoint format,
            quantization scales included.
        dense_params: parameters read in full at every decode step outside the routed
            experts: attention, shared experts, dense FFN layers, routers, lm_head.
        bytes_per_dense_param: bytes per dense parameter in the checkpoint.
        compute_dtype: "bf16" or "fp8": the tensor-core dtype the GEMMs run in on Hopper
            ("fp32" for a model run in float32); picks the peak FLOP/s and the ridge point.
        vocab_size: lm_head rows.
        notes: where the numbers come from, and what was simplified.
    """

    name: str
    moe_layers: int
    num_experts: int
    top_k: int
    hidden: int
    moe_intermediate: int
    bytes_per_expert: float
    dense_params: float
    bytes_per_dense_param: float
    compute_dtype: str
    vocab_size: int
    notes: str = ""

    def __post_init__(self):
        for field in ("moe_layers", "num_experts", "hidden", "moe_intermediate", "vocab_size"):
            if getattr(self, field) < 1:
                raise ValueError(f"{self.name}: {field} must be >= 1, got {getattr(self, field)}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(
                f"{self.name}: top_k must be in [1, num_experts={self.num_experts}], "
                f"got {self.top_k}"
            )
        for field in ("bytes_per_expert", "dense_params", "bytes_per_dense_param"):
            if not getattr(self, field) > 0:
                raise ValueError(f"{self.name}: {field} must be > 0, got {getattr(self, field)}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"{self.name}: compute_dtype must be one of {COMPUTE_DTYPES}, "
                f"got {self.compute_dtype!r}"
            )

    @property
    def rho(self) -> float:
        """Sparsity K / E."""
        return self.top_k / self.num_experts

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert: gate, up and down projections."""
        return 3 * self.hidden * self.moe_intermediate

    @property
    def dense_bytes(self) -> float:
        """Bytes of the dense part, read once per decode step."""
        return self.dense_params * self.bytes_per_dense_param


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """One accelerator (or an aggregate of several, see the module docstring).

    Attributes:
        name: lower-case id, e.g. "h200" or "8xh200".
        memory_bandwidth: HBM bandwidth, bytes/s.
        peak_bf16_flops: dense bf16 tensor-core peak, FLOP/s.
        peak_fp8_flops: dense fp8 tensor-core peak, FLOP/s.
        peak_fp32_flops: dense fp32 peak, FLOP/s, or None where not needed (a measured
            device profile has it when its model runs in float32).
    """

    name: str
    memory_bandwidth: float
    peak_bf16_flops: float
    peak_fp8_flops: float
    peak_fp32_flops: float | None = None

    def __post_init__(self):
        for field in ("memory_bandwidth", "peak_bf16_flops", "peak_fp8_flops", "peak_fp32_flops"):
            value = getattr(self, field)
            if not (value is None and field == "peak_fp32_flops") and not value > 0:
                raise ValueError(f"{self.name}: {field} must be > 0, got {value}")

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype`` ("bf16", "fp8" or "fp32")."""
        if dtype not in COMPUTE_DTYPES:
            raise ValueError(f"dtype must be one of {COMPUTE_DTYPES}, got {dtype!r}")
        if dtype == "fp32" and self.peak_fp32_flops is None:
            raise ValueError(f"{self.name}: no fp32 peak FLOP/s in this hardware profile")
        peaks = {"bf16": self.peak_bf16_flops, "fp8": self.peak_fp8_flops}
        return peaks.get(dtype, self.peak_fp32_flops)


def _gqa_attention_params(hidden: int, q_dim: int, kv_dim: int) -> int:
    """q (hidden x q_dim), k and v (hidden x kv_dim each), o (q_dim x hidden)."""
    return hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden


def _deepseek_v3_dense_params() -> int:
    """MLA attention in all 61 layers, 3 dense FFN layers, 58 shared experts, lm_head, routers.

    MLA: q_a 7168x1536, q_b 1536x(128 heads x 192), kv_a 7168x(512 + 64 rope),
    kv_b 512x(128 x (128 + 128)), o (128 x 128)x7168. The MTP layer is not counted.
    """
    mla = 7168 * 1536 + 1536 * (128 * 192) + 7168 * 576 + 512 * (128 * 256) + 16384 * 7168
    dense_ffn = 3 * (3 * 7168 * 18432)
    shared_experts = 58 * (3 * 7168 * 2048)
    return 61 * mla + dense_ffn + shared_experts + 129280 * 7168 + 58 * 256 * 7168


def _qwen3_moe(name: str, layers: int, hidden: int, intermediate: int, q_dim: int, repo: str):
    """A Qwen3 MoE config: every layer MoE, 128 experts top-8, 4 kv heads of 128, vocabulary
    151936, bf16 weights and compute."""
    return ModelProfile(
        name=name,
        moe_layers=layers,
        num_experts=128,
        top_k=8,
        hidden=hidden,
        moe_intermediate=intermediate,
        bytes_per_expert=3 * hidden * intermediate * 2,
        dense_params=layers * _gqa_attention_params(hidden, q_dim, 512)
        + 151936 * hidden
        + layers * 128 * hidden,
        bytes_per_dense_param=2,
        compute_dtype="bf16",
        vocab_size=151936,
        notes=f"{repo} config.json; all {layers} layers are MoE; bf16.",
    )


MODELS: dict[str, ModelProfile] = {
    m.name: m
    for m in (
        # 64 q heads (8192) and 4 kv heads of 128; lm_head 151936 x 4096; routers 128 x 4096.
        _qwen3_moe("qwen3-235b-a22b", 94, 4096, 1536, 8192, "Qwen/Qwen3-235B-A22B"),
        # 32 q heads (4096) and 4 kv heads of 128; lm_head 151936 x 2048; routers 128 x 2048.
        _qwen3_moe("qwen3-30b-a3b", 48, 2048, 768, 4096, "Qwen/Qwen3-30B-A3B"),
        ModelProfile(
            name="gpt-oss-120b",
            moe_layers=36,
            num_experts=128,
            top_k=4,
            hidden=2880,
            moe_intermediate=2880,
            # MXFP4: 4 bits per weight + one 8-bit scale per 32 weights; bf16 biases on
            # gate_up (2 x 2880) and down (2880).
            bytes_per_expert=3 * 2880 * 2880 * (0.5 + 1 / 32) + (2 * 2880 + 2880) * 2,
            # 64 q heads and 8 kv heads of 64; lm_head 201088 x 2880; routers 128 x 2880.
            dense_params=36 * _gqa_attention_params(2880, 4096, 512)
            + 201088 * 2880
            + 36 * 128 * 2880,
            bytes_per_dense_param=2,
            # Hopper has no fp4 tensor cores: the MoE kernels dequantize MXFP4 to bf16.
            compute_dtype="bf16",
            vocab_size=201088,
            notes="openai/gpt-oss-120b config.json; experts MXFP4, everything else bf16.",
        ),
        ModelProfile(
            name="deepseek-v3",
            moe_layers=58,
            num_experts=256,
            top_k=8,
            hidden=7168,
            moe_intermediate=2048,
            # fp8 e4m3; the 128x128-block fp32 scales (0.02%) are left out.
            bytes_per_expert=3 * 7168 * 2048,
            dense_params=_deepseek_v3_dense_params(),
            bytes_per_dense_param=1,
            compute_dtype="fp8",
            vocab_size=129280,
            notes=(
                "deepseek-ai/DeepSeek-V3 config.json (V3.1 has the same shapes); 58 of 61 "
                "layers are MoE, 1 shared expert each. All dense weights counted as fp8, "
                "though lm_head and routers ship in bf16 (about 6% more dense bytes)."
            ),
        ),
    )
}

HARDWARE: dict[str, HardwareProfile] = {
    h.name: h
    for h in (
        HardwareProfile("h100", 3.35e12, 989.4e12, 1978.9e12),
        HardwareProfile("h200", 4.8e12, 989.4e12, 1978.9e12),
    )
}


def get_model(name: str) -> ModelProfile:
    """The profile named ``name`` (case-insensitive); ValueError lists the valid names."""
    try:
        return MODELS[name.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(MODELS)}") from None


def get_hardware(name: str) -> HardwareProfile:
    """The profile named ``name`` (case-insensitive), optionally as ``<n>x<name>``.

    ``8xh200`` is 8 H200s seen as one device: bandwidth and FLOP/s times 8.
    """
    match = re.fullmatch(r"(?:(\d+)\s*x\s*)?([a-z0-9]+)", name.strip().lower())
    base = HARDWARE.get(match.group(2)) if match else None
    count = int(match.group(1)) if match and match.group(1) else 1
    if base is None or count < 1:
        raise ValueError(
            f"unknown hardware {name!r}; valid: {', '.join(HARDWARE)}, "
            "optionally as <n>x<name> for n GPUs (e.g. 8xh200)"
        )
    if count == 1:
        return base
    return HardwareProfile(
        name=f"{count}x{base.name}",
        memory_bandwidth=count * base.memory_bandwidth,
        peak_bf16_flops=count * base.peak_bf16_flops,
        peak_fp8_flops=count * base.peak_fp8_flops,
        peak_fp32_flops=None if base.peak_fp32_flops is None else count * base.peak_fp32_flops,
    )


def dense_load_time(model: ModelProfile, hardware: HardwareProfile) -> float:
    """Seconds to stream the dense weights once: the floor of any decode step."""
    return model.dense_bytes / hardware.memory_bandwidth


def expert_load_time(model: ModelProfile, hardware: HardwareProfile) -> float:
    """Seconds to stream one routed expert in every MoE layer.

    This is the cost of one more unique expert per layer: moe_layers x bytes_per_expert /
    memory_bandwidth.
    """
    return model.moe_layers * model.bytes_per_expert / hardware.memory_bandwidth


def ridge_tokens(model: ModelProfile, hardware: HardwareProfile) -> float:
    """Hardware ridge point in tokens for the model's compute dtype.

    A GEMM over weights stored in the compute dtype does 2 FLOP per weight per token and
    reads the weight once, so it turns compute-bound above
    peak_flops x bytes_per_weight / (2 x memory_bandwidth) tokens (about 206 on H200 and
    295 on H100, for bf16 and fp8 alike).
    """
    dtype = model.compute_dtype
    return hardware.peak_flops(dtype) * _DTYPE_BYTES[dtype] / (2 * hardware.memory_bandwidth)
