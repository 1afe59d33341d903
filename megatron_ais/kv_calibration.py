"""FP8 KV-cache scales recalibrated from the trainer at every weight sync.

An FP8 (e4m3) KV cache stores K / k_scale and V / v_scale, so one per-tensor scale per attention layer decides
what saturates at ±448 and what falls into e4m3's subnormals. vLLM takes the scales from the checkpoint (else
1.0) and, since 0.11, no longer measures them itself; RL changes the weights every step, so a fixed scale drifts
away from the activations it was meant for. As NeMo-RL does, the trainer measures them: a forward pass of the
policy being synced over recent rollout sequences records each layer's largest |Q|, |K|, |V| as attention sees
them (after the QK norms and RoPE, i.e. what the engine caches), over real tokens only; the maxima are reduced
over every rank (TP ranks hold different heads, PP stages different layers, DP ranks different sequences), and
scale = amax x margin / 448 (the margin absorbs the next step's drift and the prompts the calibration did not see).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron_ais.errors import NonFiniteInputError
from megatron_ais.flags import FlagConfig, flag
from megatron_ais.forward import compute_logprobs, split_micro_batches
from megatron_ais.model import unwrap_model

FP8_E4M3_MAX = 448.0
QKV = ("q", "k", "v")


@dataclasses.dataclass(frozen=True)
class KVCacheScales:
    """Per decoder layer (global index): the (q, k, v) dequantization scales of an FP8 KV cache."""

    scales: tuple[tuple[float, float, float], ...]

    @classmethod
    def from_amax(cls, amax: torch.Tensor, margin: float) -> "KVCacheScales":
        """scale = max(amax, tiny) x margin / 448 for amax [layers, 3]; a layer no token reached keeps 1.0, and a
        non-finite amax is refused (NonFiniteInputError)."""
        if margin < 1.0:
            raise ValueError(f"--rollout-kv-cache-scale-margin {margin} must be at least 1 (below 1 the largest "
                             "calibrated values already saturate)")
        layers = sorted({int(i) for i in (~torch.isfinite(amax)).nonzero()[:, 0]})
        if layers:
            raise NonFiniteInputError(f"the FP8 KV-cache calibration's forward gave non-finite Q/K/V in decoder "
                                      f"layer(s) {layers}: the policy being synced holds NaN/Inf")
        scale = amax.double().clamp(min=1e-12) * margin / FP8_E4M3_MAX
        scale = torch.where(amax > 0, scale, torch.ones_like(scale))
        return cls(tuple(tuple(float(x) for x in row) for row in scale.tolist()))


@dataclasses.dataclass(frozen=True)
class KVCacheCalibrationConfig(FlagConfig):
    """How the trainer measures the FP8 KV-cache scales at every sync (with --rollout-kv-cache-dtype fp8)."""

    scale_margin: float = flag(
        2.0, "With --rollout-kv-cache-dtype fp8: KV-cache scale = measured max |K| (|V|) x this / 448, re-measured by "
             "the trainer at every weight sync; the headroom covers the next step's drift and prompts the calibration "
             "did not see (e4m3's relative precision does not depend on the scale, so headroom costs little).",
        name="--rollout-kv-cache-scale-margin",
        at_least=1, bound_note="below 1 the largest calibrated K/V values already saturate")
    sequences: int = flag(16, "Sequences of the latest rollout batch (before the first rollout: the first step's "
                              "prompts) whose forward pass measures the KV-cache scales, split over data-parallel "
                              "ranks.", name="--rollout-kv-cache-calibration-sequences", at_least=1)



class AttentionAmax:
    """Forward pre-hooks on every decoder layer's core attention that keep the running max |Q|, |K|, |V| per global
    layer, over the real tokens of the micro-batches given by `valid` ([batch, seq] masks, in the order the
    pipeline schedule runs them: each model chunk sees its micro-batches in order in a forward-only pass)."""

    def __init__(self, ddp_chunks: list, num_layers: int, valid: list[torch.Tensor]):
        self.num_layers, self.valid = num_layers, valid
        self.calls: dict[int, int] = {}
        self.maxima: dict[int, torch.Tensor] = {}  # on the activations' device: no host sync per layer
        layers = [layer for chunk in ddp_chunks for layer in unwrap_model(chunk).decoder.layers]
        self.handles = [layer.self_attention.core_attention.register_forward_pre_hook(
            self._hook(layer.layer_number - 1)) for layer in layers]

    def _hook(self, index: int):
        def record(module, inputs):
            call = self.calls.get(index, 0)
            self.calls[index] = call + 1
            valid = self.valid[call]
            if not bool(valid.any()):
                return
            mask = valid.t().reshape(-1).to(inputs[0].device)  # megatron's [s, b] order
            value = torch.stack([t.detach().reshape(mask.numel(), -1)[mask].abs().amax().float() for t in inputs[:3]])
            previous = self.maxima.get(index)
            self.maxima[index] = value if previous is None else torch.maximum(previous, value)
        return record

    @property
    def amax(self) -> torch.Tensor:
        """[num_layers, 3] max |q|, |k|, |v| of this rank's layers (zeros elsewhere)."""
        amax = torch.zeros(self.num_layers, 3, dtype=torch.float32)
        for index, value in self.maxima.items():
            amax[index] = value.cpu()
        return amax

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def attention_amax(ddp_chunks: list, sequences: list[list[int]], seq_length: int, micro_batch_size: int, groups,
                   vocab_size: int, num_layers: int, rows: int | None = None) -> torch.Tensor:
    """Run `sequences` (every rank of a model-parallel group passes the same ones), padded with token-less rows to
    `rows` (default: as many as there are sequences) and to whole micro-batches, through the policy's forward;
    return this rank's [num_layers, 3] max |q|, |k|, |v| over their tokens (zeros for layers it does not hold)."""
    count = max(len(sequences), rows or 0)
    count = -(-count // micro_batch_size) * micro_batch_size
    if count == 0:
        return torch.zeros(num_layers, 3)
    tokens = torch.zeros(count, seq_length, dtype=torch.long)
    valid = torch.zeros(count, seq_length, dtype=torch.bool)
    for row, ids in enumerate(sequences):
        ids = ids[:seq_length]
        tokens[row, :len(ids)] = torch.tensor(ids)
        valid[row, :len(ids)] = True
    micro_batches = split_micro_batches({"tokens": tokens, "labels": tokens}, micro_batch_size)
    capture = AttentionAmax(ddp_chunks, num_layers, list(valid.split(micro_batch_size)))
    try:
        compute_logprobs(ddp_chunks, micro_batches, seq_length, micro_batch_size, groups, vocab_size)
    finally:
        capture.close()
    return capture.amax


def calibrate_kv_cache_scales(ddp_chunks: list, sequences: list[list[int]], seq_length: int, micro_batch_size: int,
                              groups, vocab_size: int, num_layers: int, margin: float, group=None) -> KVCacheScales:
    """The FP8 KV-cache scales of every layer for the policy's current weights, measured on `sequences` (the same
    list on every rank; each data-parallel rank runs its share, all shares padded to one length because MoE layers
    exchange tokens across data-parallel ranks in every micro-batch) and the same on every rank of `group`
    (default: the world, whose maximum covers every TP head, PP layer and DP rank's sequences)."""
    share = sequences[groups.data_parallel_rank::groups.data_parallel_size]
    rows = -(-len(sequences) // groups.data_parallel_size)
    amax = attention_amax(ddp_chunks, share, seq_length, micro_batch_size, groups, vocab_size, num_layers, rows)
    # NaN may be lost in a MAX reduction, infinity is not: every rank then refuses the scales
    amax = torch.where(torch.isfinite(amax), amax, torch.full_like(amax, float("inf")))
    if dist.is_initialized():
        amax = amax.cuda() if torch.cuda.is_available() else amax  # NCCL reduces device tensors
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return KVCacheScales.from_amax(amax.cpu(), margin)
