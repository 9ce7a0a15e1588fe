"""torch.compile for the learner's decoder layers (`learner.compile`).

Between its matmuls a decoder layer is elementwise work (norms, rotary embeddings, the gated activation,
residual adds, casts under autocast) that eager PyTorch runs as one kernel per operation, each reading
and writing whole activations; on a GPU that costs a 0.5B policy's step more time than its matmuls.
Compiled, each stretch of it becomes a few fused kernels. Every layer of the model shares one compiled
graph for each way layers are called (with or without gradients; with a mask or without), made the first
time it is met (a learner meets its training passes as it starts: `WARM_UP_BATCHES`), with the batch's
sizes dynamic so that later batches reuse it. Calls with a KV cache run
eagerly: the cache is indexed by the layer's number, which would make each layer a graph of its own; so a
model with compiled layers is scored in grouped or packed rows, not on a shared prompt's cache. Where
compiling fails the layers run eagerly (`compile_guard`). The output head is not a layer here:
`head_scores` compiles its own arithmetic on CUDA.
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch

from rlplatform.learners.compile_guard import guarded


def layers_compiled(setting: Optional[bool], device: torch.device, zero_stage: int) -> bool:
    """`learner.compile` resolved: unset, on for a CUDA learner under ZeRO 0-2 (ZeRO-3 gathers each layer's
    weights in hooks that would break the graph; on CPU compiling takes seconds per process and per way the
    layers are called, for an RL step about 0.83x as long on the demo policy)."""
    return (device.type == "cuda" and zero_stage != 3) if setting is None else setting


def decoder_layers(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The model's repeated blocks: its modules of the classes Hugging Face lists in `_no_split_modules`
    (the decoder layers of a causal LM, found through a LoRA wrapper too)."""
    classes = set()
    for module in model.modules():
        classes.update(getattr(module, "_no_split_modules", None) or [])
    return [module for module in model.modules() if type(module).__name__ in classes]


# (prompts, completions) of the training passes a learner compiles as it starts (`LearnerRank._compile_ahead`): two
# prompts with two completions each, in a grouped row each; three distinct prompts, in packed rows of one each
WARM_UP_BATCHES = (([[3, 4, 5]] * 2 + [[6, 7, 8]] * 2, [[5, 6], [7, 8]] * 2),
                   ([[3 + i % 5 for i in range(k, k + 20)] for k in range(3)], [[4, 5, 6] * 5] * 3))

CACHE_KEYWORDS = ("cache", "past_key_values", "past_key_value")  # a layer's KV cache, as transformers versions name it


def compile_layers(model: torch.nn.Module) -> int:
    """Compile each decoder layer's forward in place (see the module's docstring); returns how many."""
    layers = decoder_layers(model)
    for layer in layers:
        eager = layer.forward
        layer.forward = _without_cache(guarded(torch.compile(eager), eager, "the decoder layers", _batch_dynamic),
                                       eager)
    return len(layers)


def _without_cache(compiled: Callable, eager: Callable) -> Callable:
    """`compiled` for calls without a KV cache; `eager` for those with one (a shared prompt's passes). A cache
    is indexed by the layer's number, which would make each layer a graph of its own."""
    def forward(*args, **kwargs):
        if any(kwargs.get(name) is not None for name in CACHE_KEYWORDS):
            return eager(*args, **kwargs)
        return compiled(*args, **kwargs)
    forward.compiled_layer = True
    return forward


def has_compiled_layers(model: torch.nn.Module) -> bool:
    """Whether `compile_layers` compiled the layers of `model` (bare, or inside DeepSpeed or peft)."""
    return any(getattr(module.forward, "compiled_layer", False) for module in model.modules())


def _batch_dynamic(args: tuple, kwargs: dict) -> None:
    """Mark the sizes that vary from batch to batch as dynamic before a compiled call: every dimension of a
    mask or of positions, every one but the last of a floating-point tensor (hidden states, rotary tables),
    whose last is a width of the model, kept static so that reductions over it are generated for its length."""
    tensors = [*args, *kwargs.values()]
    tensors += [t for value in kwargs.values() if isinstance(value, tuple) for t in value]  # (cos, sin)
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            dims = tensor.dim() - 1 if tensor.is_floating_point() else tensor.dim()
            for dim in range(dims):
                torch._dynamo.maybe_mark_dynamic(tensor, dim)
