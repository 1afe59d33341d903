"""Code that runs inside vLLM's worker: applying one complete, verified set of weights.

`WeightSyncExtension` is mixed into vLLM's worker class (`worker_extension_cls`), so a separate-process engine
receives weights through `collective_rpc` with no pickled callables or tensors in its arguments: either the bridge's
staging arena (shared memory, or GPU memory by CUDA IPC), already verified by the receiver, is mapped and applied
(`megatron_ais_apply_shared`), or the
sync arrives over the bridge's feed group and is verified here (`megatron_ais_receive_broadcast`), or a
safetensors file in shared memory is checked tensor by tensor against its manifest and applied
(`megatron_ais_apply_weights`).
"""
from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from megatron_ais.bridge.arena import arena_views, decode_ref, entry_views
from megatron_ais.bridge.buckets import ManifestEntry, verify_bucket, verify_tensors
from megatron_ais.distributed import receive_bytes
from megatron_ais.engine.feeds.broadcast import device_uuid, feed_device, join_weight_group
from megatron_ais.engine.vllm_compat import attention_kv_scales, attention_layers, moe_routers, reload_weights, \
    set_attention_kv_scales, set_router_capture, worker_model, worker_rank


def to_wire(tensor: torch.Tensor) -> tuple:
    """A CPU tensor as (shape, dtype name, raw bytes): what survives a separate engine's RPC serialisation (NumPy
    arrays come back as something else)."""
    return tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), tensor.contiguous().numpy().tobytes()


def from_wire(message: tuple) -> torch.Tensor:
    """The tensor `to_wire` sent."""
    shape, dtype, data = message
    return torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype)).view(*shape)


def set_kv_cache_scales(model, scales: list) -> int:
    """Install per-layer (q, k, v) FP8 KV-cache scales in every attention layer, where every attention backend reads
    them (`vllm_compat.set_attention_kv_scales`). Return how many layers."""
    layers = attention_layers(model)
    if sorted(layers) != list(range(len(scales))):
        raise ValueError(f"{len(scales)} KV-cache scales for an engine with attention layers {sorted(layers)}")
    for index, (q, k, v) in enumerate(scales):
        set_attention_kv_scales(layers[index], q, k, v)
    return len(scales)


def kv_cache_scales_of(model) -> list[tuple[float, float, float]]:
    """The (q, k, v) scales the engine's attention layers use now, by layer index."""
    layers = attention_layers(model)
    return [attention_kv_scales(layers[i]) for i in sorted(layers)]


def apply_weights_in_worker(worker, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
    """Apply one complete set of HF-named tensors via vLLM's layer-wise reload; return how many."""
    reload_weights(worker, named_tensors)
    return len(named_tensors)


class LayerStateCapture:
    """Forward hooks on the engine's decoder layers that keep each layer's output residual stream (vLLM layers
    return (mlp_out, residual); their sum is what the HF / Megatron layer returns) for the next forward only."""

    def __init__(self, model):
        self.layers = list(model.model.layers)
        self.states: dict[int, torch.Tensor] = {}
        self.handles = [layer.register_forward_hook(self._hook(i)) for i, layer in enumerate(self.layers)]

    def _hook(self, index: int):
        def hook(module, inputs, output):
            if index in self.states:
                return
            if isinstance(output, tuple):
                hidden, residual = output[0], output[1] if len(output) > 1 else None
                output = hidden if residual is None else hidden + residual
            self.states[index] = output.detach().float().cpu().clone()
        return hook

    def collect(self) -> list:
        """Remove the hooks; return each layer's [tokens, hidden] fp32 output (`to_wire`), None if it did not run."""
        for handle in self.handles:
            handle.remove()
        return [to_wire(self.states[i]) if i in self.states else None for i in range(len(self.layers))]


class RoutingCapture:
    """The top-k expert ids every MoE layer's router picks in the next forwards (vLLM's own capture hook on its
    routers, the one `enable_return_routed_experts` uses; that option needs Model Runner V2, which needs Triton, so it
    is refused on CPU)."""

    def __init__(self, model):
        self.routers = moe_routers(model)
        self.calls: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(self.routers))}
        for index, router in enumerate(self.routers):
            set_router_capture(router, self._capture(index))

    def _capture(self, index: int):
        def capture(topk_ids):
            self.calls[index].append(topk_ids.detach().to("cpu", torch.int16, copy=True))
        return capture

    def collect(self) -> list:
        """Remove the hooks; return per MoE layer, per forward, the [rows, k] int16 expert ids (`to_wire`)."""
        for router in self.routers:
            set_router_capture(router, None)
        return [[to_wire(ids) for ids in self.calls[i]] for i in range(len(self.routers))]


class WeightSyncExtension:
    """Worker methods callable through collective_rpc by name."""

    def megatron_ais_capture_layer_states(self) -> int:
        """Record every decoder layer's output during the next forward; return the number of layers."""
        self._megatron_ais_capture = LayerStateCapture(worker_model(self))
        return len(self._megatron_ais_capture.layers)

    def megatron_ais_collect_layer_states(self) -> list:
        """Return what `megatron_ais_capture_layer_states` recorded."""
        capture, self._megatron_ais_capture = self._megatron_ais_capture, None
        return capture.collect()

    def megatron_ais_capture_routing(self) -> int:
        """Record every MoE layer's top-k expert ids during the next forward; return the number of MoE layers."""
        self._megatron_ais_routing = RoutingCapture(worker_model(self))
        return len(self._megatron_ais_routing.routers)

    def megatron_ais_collect_routing(self) -> list:
        """Return what `megatron_ais_capture_routing` recorded."""
        capture, self._megatron_ais_routing = self._megatron_ais_routing, None
        return capture.collect()

    def megatron_ais_set_kv_cache_scales(self, scales: list) -> int:
        """Install per-layer (q, k, v) FP8 KV-cache scales; return the number of layers."""
        return set_kv_cache_scales(worker_model(self), scales)

    def megatron_ais_kv_cache_scales(self) -> list:
        """Return the (q, k, v) KV-cache scales of every attention layer."""
        return kv_cache_scales_of(worker_model(self))

    def megatron_ais_apply_weights(self, path: str, manifest_json: str) -> int:
        """Apply a safetensors file of weights after checking every tensor against its manifest."""
        manifest = [ManifestEntry.from_dict(e) for e in json.loads(manifest_json)]
        tensors = load_file(path)
        ordered = [(entry.name, tensors[entry.name]) for entry in manifest if entry.name in tensors]
        verify_bucket(ordered, manifest)  # raises before the model is touched
        return apply_weights_in_worker(self, ordered)

    def megatron_ais_apply_shared(self, ref: str, entries_json: str) -> int:
        """Apply the tensors the bridge's receiver verified in its staging arena, mapped in place (not copied): a
        shared-memory file, or GPU memory behind a CUDA IPC handle (`encode_ref`)."""
        entries = [ManifestEntry.from_dict(e) for e in json.loads(entries_json)]
        return apply_weights_in_worker(self, arena_views(decode_ref(ref), entries))

    def megatron_ais_device_uuid(self) -> str | None:
        """The physical GPU of this worker (None on CPU), for the choice of the feed group's backend."""
        return device_uuid()

    def megatron_ais_join_weight_group(self, host: str, port: int, world: int, backend: str) -> int:
        """Join the bridge's feed group as member 1 + this worker's engine-TP rank; return that rank."""
        rank = 1 + worker_rank(self)
        self._megatron_ais_group = join_weight_group(host, port, rank, world, backend)
        self._megatron_ais_feed_device = feed_device(backend)
        self._megatron_ais_feed_buffer = None
        return rank

    def megatron_ais_receive_broadcast(self, entries_json: str, nbytes: int, chunk_bytes: int) -> int:
        """Receive a sync's bytes from the feed group's root, verify every tensor against its manifest entry and
        apply them all; a mismatch raises before the model is touched."""
        buffer = self._megatron_ais_feed_buffer
        if buffer is None or buffer.numel() < nbytes:
            buffer = self._megatron_ais_feed_buffer = torch.empty(nbytes, dtype=torch.uint8,
                                                                  device=self._megatron_ais_feed_device)
        receive_bytes(self._megatron_ais_group, buffer[:nbytes], chunk_bytes)
        entries = [ManifestEntry.from_dict(e) for e in json.loads(entries_json)]
        named = entry_views(buffer[:nbytes], entries)
        verify_tensors([(entry, tensor) for entry, (_, tensor) in zip(entries, named)])
        return apply_weights_in_worker(self, named)
