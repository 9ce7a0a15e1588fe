"""How many tokens one learner forward/backward may hold: the default `learner.micro_batch_tokens`.

No pass the learner makes (policy update, proximal and reference scoring, SFT) runs more tokens at
once than this budget; a larger minibatch accumulates gradients over several micro-batches. Unless
the user sets it, the budget comes from the memory the rank's device has left once the model is in
place and the activations one token keeps alive for the backward pass in each decoder layer; where
that memory holds too few tokens, each layer recomputes its activations in backward instead of keeping
them (activation checkpointing), unless the user says otherwise.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

MEMORY_FRACTION = 0.5  # of the free memory, for one micro-batch's activations (the rest: fragmentation, passes in flight)
OPTIMIZER_BYTES = 12  # per trainable parameter not yet allocated at set-up: float32 gradient and AdamW's two moments
MIN_TOKENS = 1024  # never less, however little memory is reported
ROUND_TO = 1024
# unset learner.activation_checkpointing: on where memory holds fewer tokens' activations than this without it
# (fewer, shorter passes leave the device idle between kernels; a long sequence may not fit at all)
CHECKPOINTING_BELOW_TOKENS = 8192


def activation_bytes_per_token(config, compute_bytes: int, checkpointing: bool) -> int:
    """Bytes of activations one token keeps for backward through a Hugging Face decoder (`config`: its
    PretrainedConfig). Per layer: the attention block's inputs and outputs (about 8 hidden-wide tensors,
    attention itself through SDPA keeps no sequence-squared scores) and the gated MLP's 4 intermediate-wide
    ones; with activation checkpointing only each layer's input, plus one layer recomputed at a time."""
    per_layer = compute_bytes * (8 * config.hidden_size + 4 * config.intermediate_size)
    if checkpointing:
        return config.num_hidden_layers * config.hidden_size * compute_bytes + per_layer
    return config.num_hidden_layers * per_layer


def micro_batch_tokens(free_bytes: int, trainable_params: int, config, compute_bytes: int,
                       checkpointing: bool) -> int:
    """The token budget of one forward/backward given `free_bytes` on the device after the model is loaded:
    half of what the optimizer state still to come leaves, over the activation bytes per token, rounded
    down to a multiple of 1024 and at least 1024."""
    room = MEMORY_FRACTION * max(0, free_bytes - OPTIMIZER_BYTES * trainable_params)
    tokens = int(room // activation_bytes_per_token(config, compute_bytes, checkpointing))
    return max(MIN_TOKENS, tokens // ROUND_TO * ROUND_TO)


def plan_micro_batches(free_bytes: int, trainable_params: int, config, compute_bytes: int,
                       tokens: Optional[int], *, checkpointing: Optional[bool]) -> Tuple[int, bool]:
    """(tokens per forward/backward, whether each layer recomputes its activations in backward): `tokens` and
    `checkpointing` where set (learner.micro_batch_tokens, learner.activation_checkpointing). Unset, checkpointing
    is on exactly when memory holds fewer tokens' activations without it than a micro-batch needs (`tokens`, else
    CHECKPOINTING_BELOW_TOKENS), and the token budget comes from memory under that choice."""
    if checkpointing is None:
        without = micro_batch_tokens(free_bytes, trainable_params, config, compute_bytes, checkpointing=False)
        checkpointing = without < (tokens or CHECKPOINTING_BELOW_TOKENS)
    return tokens or micro_batch_tokens(free_bytes, trainable_params, config, compute_bytes, checkpointing), \
        checkpointing


def free_device_bytes(device: torch.device, ranks_on_host: int, gpu_share: Optional[float]) -> int:
    """Memory this rank may count on: the GPU's free memory (with a fraction of a GPU, at most that fraction
    of it less what this process holds: the GPU's other tenants take the rest), or on CPU an even share
    of the host's available memory among the learner ranks."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        if gpu_share is not None and gpu_share < 1:
            free = min(free, int(gpu_share * total) - torch.cuda.memory_reserved(device))
        return max(0, free)
    import psutil

    return psutil.virtual_memory().available // max(1, ranks_on_host)
