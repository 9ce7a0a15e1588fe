"""torch.compile for the learner's decoder layers (`learner.compile`).

Between its matmuls a decoder layer is elementwise work (norms, rotary embeddings, the gated activation,
residual adds, casts under autocast) that eager PyTorch runs as one kernel per operation, each reading
and writing whole activations; on a GPU that costs a 0.5B policy's step more time than its matmuls.
Compiled, each stretch of it becomes a few fused kernels. Every layer of the model shares one compiled
graph for each way layers are called (with or without gradients; with a mask, a KV cache or neither),
made the first time it is met, with dynamic sizes so that later batch shapes reuse it. Where compiling
fails the layers run eagerly (`compile_guard`). The output head is not a layer here: `head_scores`
compiles its own arithmetic on CUDA.
"""

from __future__ import annotations

from typing import List, Optional

import torch


def layers_compiled(setting: Optional[bool], device: torch.device, zero_stage: int) -> bool:
    """`learner.compile` resolved: unset, on for a CUDA learner under ZeRO 0-2 (ZeRO-3 gathers each layer's
    weights in hooks that would break the graph; on CPU compiling takes seconds per process and per way the
    layers are called, for a step some 10% shorter on the demo policy)."""
    return (device.type == "cuda" and zero_stage != 3) if setting is None else setting


def decoder_layers(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The model's repeated blocks: its modules of the classes Hugging Face lists in `_no_split_modules`
    (the decoder layers of a causal LM, found through a LoRA wrapper too)."""
    classes = set()
    for module in model.modules():
        classes.update(getattr(module, "_no_split_modules", None) or [])
    return [module for module in model.modules() if type(module).__name__ in classes]


def compile_layers(model: torch.nn.Module) -> int:
    """Compile each decoder layer's forward in place (see the module's docstring); returns how many."""
    from rlplatform.learners.compile_guard import guarded

    layers = decoder_layers(model)
    for layer in layers:
        layer.forward = guarded(torch.compile(layer.forward, dynamic=True), layer.forward, "the decoder layers")
    return len(layers)
