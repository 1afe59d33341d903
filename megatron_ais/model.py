"""Hugging Face config -> megatron-core `TransformerConfig`, layer-spec choice and `GPTModel` build."""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ais import platform
from megatron_ais.errors import ArgumentValidationError
from megatron_ais.flags import FlagConfig, flag
from megatron_ais.parallel import ParallelLayout

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")
MOE_MODEL_TYPES = ("qwen3_moe",)
# transformers' config-class defaults (5.19) of the keys a config.json may omit that do not follow from the others:
# vLLM reads a config through those classes, so a missing key must mean here what it means there
HF_CONFIG_DEFAULTS = {
    "llama": dict(max_position_embeddings=2048),
    "qwen2": dict(num_key_value_heads=32, max_position_embeddings=32768),
    "qwen3": dict(num_key_value_heads=32, head_dim=128, max_position_embeddings=32768),
    "qwen3_moe": dict(num_key_value_heads=4, max_position_embeddings=32768, norm_topk_prob=False,
                      router_aux_loss_coef=0.001),
}


def with_hf_defaults(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config with transformers' defaults for the keys it omits (an explicit null keeps its own meaning)."""
    return {**HF_CONFIG_DEFAULTS.get(cfg.get("model_type"), {}), **cfg}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The architecture facts the trainer, mapping and bridge need, read once from a HF config."""

    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    num_experts: int = 0  # 0: dense MLP
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_norm_topk_prob: bool = False
    moe_aux_loss_coeff: float = 0.0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelShape":
        """Return the shape of a supported HF config (see `check_supported_hf_config`)."""
        check_supported_hf_config(cfg)
        cfg = with_hf_defaults(cfg)
        model_type = cfg["model_type"]
        heads = cfg["num_attention_heads"]
        return cls(
            model_type=model_type,
            num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"],
            ffn_hidden_size=cfg["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta(cfg),
            max_position_embeddings=cfg["max_position_embeddings"],
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2",
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            **(moe_fields(cfg) if model_type in MOE_MODEL_TYPES else {}),
        )

    def num_parameters(self, vocab_size: int | None = None) -> int:
        """The model's parameters (with the vocabulary padded to `vocab_size` when given)."""
        h, hd = self.hidden_size, self.head_dim
        qkv = hd * (self.num_attention_heads + 2 * self.num_key_value_heads)
        attention = h * qkv + hd * self.num_attention_heads * h + (qkv if self.qkv_bias else 0) \
            + (2 * hd if self.qk_norm else 0)
        mlp = self.num_experts * (3 * h * self.moe_ffn_hidden_size + h) if self.is_moe else 3 * h * self.ffn_hidden_size
        embeddings = (vocab_size or self.vocab_size) * h * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * (attention + mlp + 2 * h) + h

    def padded_vocab_size(self, divisible_by: int, tp: int) -> int:
        """Return the vocabulary padded to a multiple of divisible_by x TP, as Megatron-LM pads it."""
        multiple = divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple


def moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Return ModelShape's MoE fields of a Qwen3-MoE config (transformers 5 writes num_local_experts)."""
    return dict(num_experts=cfg.get("num_experts") or cfg["num_local_experts"], moe_topk=cfg["num_experts_per_tok"],
                moe_ffn_hidden_size=cfg["moe_intermediate_size"],
                moe_norm_topk_prob=bool(cfg["norm_topk_prob"]),
                moe_aux_loss_coeff=float(cfg["router_aux_loss_coef"]))


def rope_theta(cfg: dict[str, Any]) -> float:
    """Return RoPE's base from either config style (transformers 4 `rope_theta`, 5 `rope_parameters`)."""
    params = cfg.get("rope_parameters") or {}
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def load_hf_config(hf_dir: str) -> dict[str, Any]:
    """Return the parsed config.json of a HF model directory, with a clear error when it is missing."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ArgumentValidationError(
            f"--hf-dir {hf_dir} has no config.json; point it at a Hugging Face model directory "
            "(e.g. one made by tools/make_tiny_model.py)")
    with open(path) as f:
        return json.load(f)


def check_supported_hf_config(cfg: dict[str, Any]) -> None:
    """Raise ArgumentValidationError naming the feature when a HF config cannot be represented exactly."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ArgumentValidationError(
            f"model_type {model_type!r} in config.json is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    quantization = cfg.get("quantization_config")
    if quantization:
        raise ArgumentValidationError(
            f"config.json holds quantized weights (quantization_config, quant_method "
            f"{quantization.get('quant_method')!r}); the trainer starts from unquantized weights: give the BF16 "
            "(or FP32) checkpoint the quantized one was made from")
    heads, hidden, head_dim = cfg.get("num_attention_heads"), cfg.get("hidden_size"), cfg.get("head_dim")
    if model_type == "qwen2" and head_dim and heads and hidden and head_dim != hidden // heads:
        raise ArgumentValidationError(
            f"head_dim {head_dim} with model_type qwen2: vLLM's Qwen2 takes hidden_size / num_attention_heads = "
            f"{hidden // heads}; drop head_dim or use model_type qwen3")
    scaling = cfg.get("rope_scaling") or {}
    params = cfg.get("rope_parameters") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ArgumentValidationError(f"rope type {rope_type!r} in config.json is not supported yet (only 'default')")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ArgumentValidationError(f"hidden_act {cfg['hidden_act']!r} is not supported (SwiGLU with silu only)")
    if model_type != "qwen2" and cfg.get("attention_bias"):
        raise ArgumentValidationError(
            "attention_bias=true (bias on q/k/v and o_proj) has no megatron-core equivalent; only Qwen2's q/k/v bias is")
    if cfg.get("mlp_bias"):
        raise ArgumentValidationError("mlp_bias=true is not supported")
    if cfg.get("use_sliding_window"):
        raise ArgumentValidationError("use_sliding_window=true is not supported; set it to false")
    if model_type in MOE_MODEL_TYPES:
        if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            raise ArgumentValidationError(
                "Qwen3-MoE configs with dense layers (mlp_only_layers / decoder_sparse_step != 1) are not supported; "
                "every layer must be sparse, as in the released Qwen3-MoE models")
        if cfg.get("shared_expert_intermediate_size"):
            raise ArgumentValidationError("shared experts are not supported yet (Qwen3-MoE has none)")


def te_available() -> bool:
    """Return True when Transformer Engine imports (its layer spec is then the default)."""
    try:
        importlib.import_module("transformer_engine.pytorch")  # optional: the local spec without it
    except (ImportError, RuntimeError):  # RuntimeError: the empty TE meta package
        return False
    return True


def use_transformer_engine(transformer_impl: str) -> bool:
    """Resolve --transformer-impl: 'auto' picks TE when it imports."""
    if transformer_impl == "auto":
        return te_available()
    if transformer_impl == "transformer_engine" and not te_available():
        raise ArgumentValidationError(
            "--transformer-impl transformer_engine but Transformer Engine does not import; install it (GPU image) "
            "or use --transformer-impl local")
    return transformer_impl == "transformer_engine"


@dataclasses.dataclass(frozen=True)
class ModelConfig(FlagConfig):
    """Where the model comes from and how the trainer runs it; its shape comes from the HF config."""

    hf_dir: str | None = flag(
        None, "Hugging Face model directory (config.json, *.safetensors, tokenizer). Its config defines the "
              "architecture (llama, qwen2, qwen3, qwen3_moe); its weights initialise the run unless --load is given.",
        type=str)
    precision: str = flag("bf16", "", switches={
        "--bf16": ("bf16", "Train in BF16 through megatron's Float16Module with fp32 main weights (default)."),
        "--fp32": ("fp32", "Train in FP32 (exact comparisons, debugging).")})
    make_vocab_size_divisible_by: int = flag(
        128, "Pad the vocabulary to a multiple of this value times --tensor-model-parallel-size, as Megatron-LM "
             "does. Padded rows are added on load and trimmed on export.", at_least=1)
    transformer_impl: str = flag("auto", "Layer spec: Transformer Engine when importable ('auto'), or megatron's "
                                         "local modules.", choices=("auto", "transformer_engine", "local"))
    seq_length: int = flag(256, "Longest sequence (prompt + response) the trainer sees; also the rotary table "
                                "length.", at_least=1)



def check_model_layout(hf_config: dict[str, Any], layout: ParallelLayout, seq_length: int | None,
                       source: str = "config.json") -> None:
    """Check a model's shape (its HF config) against the parallel layout and the sequence length (None: a
    checkpoint's layout, no sequences)."""
    hf_config = with_hf_defaults(hf_config)
    tp = layout.tensor
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    if heads % tp:
        raise ArgumentValidationError(
            f"--num-attention-heads {heads} ({source}) is not divisible by --tensor-model-parallel-size {tp}; "
            f"use a TP size that divides {heads}")
    if kv_heads % tp and tp % kv_heads:
        raise ArgumentValidationError(
            f"--num-key-value-heads {kv_heads} ({source}) and --tensor-model-parallel-size {tp} must divide one "
            f"another (KV heads are split over TP, or shared by several TP ranks when fewer); use a TP size that "
            f"divides or is a multiple of {kv_heads}")
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    qkv_rows = head_dim * (heads + 2 * kv_heads)
    if qkv_rows % tp:
        raise ArgumentValidationError(
            f"the fused QKV projection has {qkv_rows} rows (head_dim {head_dim} x (heads {heads} + 2 x KV heads "
            f"{kv_heads})), not divisible by --tensor-model-parallel-size {tp}; choose a smaller TP size")
    # a Qwen3-MoE config's intermediate_size is its (unused) dense MLP's: every layer is sparse
    if hf_config.get("model_type") not in MOE_MODEL_TYPES and hf_config["intermediate_size"] % tp:
        raise ArgumentValidationError(f"--intermediate-size {hf_config['intermediate_size']} ({source}) is not "
                                      f"divisible by --tensor-model-parallel-size {tp}")
    check_moe_layout(hf_config, layout, source)
    layers = hf_config["num_hidden_layers"]
    if layers % layout.model_chunks:
        raise ArgumentValidationError(
            f"--num-layers {layers} ({source}) is not divisible by --pipeline-model-parallel-size {layout.pipeline} "
            f"x --virtual-pipeline-model-parallel-size {layout.virtual_pipeline or 1} = {layout.model_chunks}; "
            "choose sizes whose product divides the layer count")
    max_pos = hf_config.get("max_position_embeddings")
    if seq_length is not None and max_pos is not None and seq_length > max_pos:
        raise ArgumentValidationError(
            f"--seq-length {seq_length} exceeds max_position_embeddings {max_pos} ({source}); lower it")


def check_moe_layout(hf_config: dict[str, Any], layout: ParallelLayout, source: str = "config.json") -> None:
    """Check the expert-parallel sizes against the model's experts (and refuse them for a dense model)."""
    experts = hf_config.get("num_experts") or hf_config.get("num_local_experts")
    if not experts:
        if layout.expert > 1 or layout.expert_tensor:
            raise ArgumentValidationError(
                f"--expert-model-parallel-size / --expert-tensor-parallel-size need a MoE model; {source} has "
                "no experts: drop the flags")
        return
    if experts % layout.expert:
        raise ArgumentValidationError(
            f"num_experts {experts} ({source}) is not divisible by --expert-model-parallel-size {layout.expert}")
    if hf_config["moe_intermediate_size"] % layout.expert_tensor_size:
        raise ArgumentValidationError(
            f"moe_intermediate_size {hf_config['moe_intermediate_size']} ({source}) is not divisible by the expert "
            f"tensor-parallel size {layout.expert_tensor_size}")
    if layout.tensor % layout.expert_tensor_size:
        # a torch checkpoint names a rank's shard by its TP rank, and the converter places expert shards within TP
        raise ArgumentValidationError(
            f"--expert-tensor-parallel-size {layout.expert_tensor_size} does not divide --tensor-model-parallel-size "
            f"{layout.tensor}: its ranks would save and load each other's expert shards; use 1 or a divisor of TP")
    if layout.tensor > 1 and not layout.sequence_parallel:
        raise ArgumentValidationError(
            "MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel (megatron-core refuses to train "
            "the token dispatcher without it); add the flag")


@dataclasses.dataclass(frozen=True)
class ModelBuildConfig:
    """Everything `build_gpt_model` needs besides process groups: the model's shape, precision and parallel layout."""

    shape: ModelShape
    precision: str = "bf16"
    layout: ParallelLayout = ParallelLayout()
    make_vocab_size_divisible_by: int = 128
    seq_length: int = 256
    use_te: bool = False
    init_method_std: float = 0.02
    variable_seq_lengths: bool = False  # micro-batches of different lengths (pipeline stages exchange shapes)
    per_token_loss: bool = False  # megatron divides gradients by the global token count, not micro-batches x DP

    @classmethod
    def create(cls, model: ModelConfig, layout: ParallelLayout, hf_config: dict[str, Any],
               variable_seq_lengths: bool = False) -> "ModelBuildConfig":
        """Return the build config of a model config, a layout and the model's HF config."""
        return cls(shape=ModelShape.from_hf_config(hf_config), precision=model.precision, layout=layout,
                   make_vocab_size_divisible_by=model.make_vocab_size_divisible_by, seq_length=model.seq_length,
                   use_te=use_transformer_engine(model.transformer_impl),
                   init_method_std=hf_config.get("initializer_range", 0.02), variable_seq_lengths=variable_seq_lengths)

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.precision == "bf16" else torch.float32

    @property
    def padded_vocab_size(self) -> int:
        return self.shape.padded_vocab_size(self.make_vocab_size_divisible_by, self.layout.tensor)


def transformer_config(build: ModelBuildConfig):
    """Return the megatron-core TransformerConfig equivalent to the HF architecture."""
    s = build.shape
    dtype = build.params_dtype
    return TransformerConfig(
        cuda_graph_scope=[],  # the default, "full", means the same and is deprecated (a warning at every build)
        num_layers=s.num_layers,
        hidden_size=s.hidden_size,
        ffn_hidden_size=s.ffn_hidden_size,
        num_attention_heads=s.num_attention_heads,
        # fewer KV heads than TP ranks is native in megatron-core: qkv rows split evenly, activations gathered
        num_query_groups=s.num_key_value_heads,
        kv_channels=s.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=s.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=s.qkv_bias,
        qk_layernorm=s.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=build.init_method_std,
        # on CUDA megatron initialises on the GPU (RoPE frequencies, TP shards); the weights are loaded after
        use_cpu_initialization=not platform.is_cuda(),
        params_dtype=dtype,
        bf16=build.precision == "bf16",
        pipeline_dtype=dtype,
        **build.layout.megatron_sizes(),
        sequence_parallel=build.layout.sequence_parallel,
        variable_seq_lengths=build.variable_seq_lengths,
        calculate_per_token_loss=build.per_token_loss,
        # the token dispatcher of MoE layers (megatron refuses its default, allgather, with variable lengths)
        moe_token_dispatcher_type="alltoall",
        # fusions need apex / TE kernels; megatron's own dataclass defaults are already off for most
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
        cross_entropy_loss_fusion=False,
        **moe_config_kwargs(build),
    )


def moe_config_kwargs(build: ModelBuildConfig) -> dict[str, Any]:
    """Return TransformerConfig's MoE fields. Qwen3-MoE routes with softmax over all experts, top-k, then
    renormalises (norm_topk_prob): that is megatron's softmax over the top-k logits (pre_softmax=False); without
    renormalisation it is softmax first (pre_softmax=True)."""
    s = build.shape
    if not s.is_moe:
        return {}
    return dict(num_moe_experts=s.num_experts, moe_router_topk=s.moe_topk, moe_ffn_hidden_size=s.moe_ffn_hidden_size,
                moe_router_pre_softmax=not s.moe_norm_topk_prob, moe_router_score_function="softmax",
                moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=s.moe_aux_loss_coeff,
                moe_grouped_gemm=build.use_te,
                # a RouterReplay per router; it replays only in forwards given routes (routing_replay.py)
                moe_enable_routing_replay=True)


def layer_spec(build: ModelBuildConfig):
    """Return the GPT layer spec: Transformer Engine's when selected, the local one otherwise."""
    experts = build.shape.num_experts or None
    if build.use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=experts is not None, qk_layernorm=build.shape.qk_norm)
    # the local spec's experts are SequentialMLP (one GEMM per expert): what runs on CPU
    if experts is not None:
        platform.define_missing_te_general_gemm()
    return gpt_layer_specs.get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False,
                                                    qk_layernorm=build.shape.qk_norm, normalization="RMSNorm")


def build_gpt_model(build: ModelBuildConfig, pre_process: bool, post_process: bool,
                    vp_stage: int | None = None):
    """Return one GPTModel chunk for the calling rank's pipeline stage (not wrapped)."""
    kwargs = {"vp_stage": vp_stage} if vp_stage is not None else {}
    return GPTModel(
        config=transformer_config(build),
        transformer_layer_spec=layer_spec(build),
        vocab_size=build.padded_vocab_size,
        max_sequence_length=build.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=build.shape.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=build.shape.rope_theta,
        **kwargs,
    )


def build_model_chunks(build: ModelBuildConfig) -> list:
    """Return this rank's model chunks (one, or one per virtual stage), wrapped in Float16Module for BF16."""
    vpp = build.layout.virtual_pipeline
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp is not None else None
        model = build_gpt_model(
            build,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            vp_stage=stage,
        )
        if platform.is_cuda():  # as Megatron-LM's get_model: whatever megatron built on the host follows
            model.cuda(torch.cuda.current_device())
        if build.precision == "bf16":
            model = Float16Module(model.config, model)
        chunks.append(model)
    return chunks


def unwrap_model(model):
    """Return the bare GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model
