"""Per-token log-probs and entropies through the output head, a bounded number of tokens at a time.

The learner scores every completion token: log p(target) and the entropy of softmax(h W^T / T) over
the whole vocabulary. Written with autograd's stock operations, each chunk of tokens keeps its
logits, their float32 copy, the log-softmax, the probabilities and a scatter-sized gradient of the
gather (five vocabulary-wide tensors), and under autocast casts the head's weight again per chunk.
`HeadScores` does the same arithmetic as one autograd node: forward keeps only each token's
log-normaliser; backward recomputes a chunk's logits and turns them into their gradient in place
(d log p_t / d z = onehot_t - p, d H / d z = -p (log p + H)), then into the hidden states' and the
weight's gradients with two matmuls. One vocabulary-wide float32 tensor is alive at a time, and
the weight is cast to the compute dtype once per pass.

On CUDA the per-chunk arithmetic between the matmuls (`chunk_stats`, `chunk_grad`) is compiled with
`torch.compile`, which fuses its passes over the logits into a few kernels that read the matmul's output
once or twice: eagerly each pass reads and writes a float32 (chunk, vocabulary) tensor, and those passes
cost a 0.5B policy's step more GPU time than the head's matmuls. Elsewhere, or where compiling fails, the
in-place eager code below runs.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch

from rlplatform.learners.compile_guard import compiling_failed, guarded


def fused_head(head: torch.nn.Module) -> Optional[torch.Tensor]:
    """The output head's weight when `HeadScores` can stand in for calling the head: a plain linear
    layer without bias whose weight is all here (not a ZeRO-3 partition, not wrapped by adapters)."""
    if type(head) is not torch.nn.Linear or head.bias is not None or hasattr(head.weight, "ds_id"):
        return None
    return head.weight


def compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: the autocast dtype where autocast is on, else the weight's."""
    device = weight.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


class HeadScores(torch.autograd.Function):
    """(log p(target), entropy) per row of hidden (N, H) under logits = hidden @ weight^T / temperature,
    `chunk` rows at a time; the entropy carries a gradient only with `entropy_grad`."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk: int, dtype: torch.dtype, entropy_grad: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        logprobs, entropy, normalisers = score_chunks(hidden, weight, targets, temperature, chunk, dtype=dtype)
        ctx.save_for_backward(hidden, weight, targets, normalisers, entropy)
        ctx.temperature, ctx.chunk, ctx.dtype, ctx.entropy_grad = temperature, chunk, dtype, entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor, grad_entropy: Optional[torch.Tensor]):
        hidden, weight, targets, normalisers, entropy = ctx.saved_tensors
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(normalisers)
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        with torch.autocast(weight.device.type, enabled=False):
            w = weight.to(ctx.dtype)
            fused = _fused(weight.device, chunk_grad)
            dh = grad_entropy if ctx.entropy_grad else None
            for start in range(0, hidden.shape[0], ctx.chunk):
                rows = slice(start, start + ctx.chunk)
                h = hidden[rows].to(ctx.dtype)
                if fused is not None:
                    grad = fused(h @ w.t(), targets[rows], normalisers[rows], entropy[rows], grad_logprobs[rows],
                                 grad_entropy=None if dh is None else dh[rows], temperature=ctx.temperature,
                                 dtype=ctx.dtype)
                    if want_hidden:
                        grad_hidden[rows] = grad @ w
                    if want_weight:
                        grad_weight += grad.t() @ h
                    continue
                logp = _logits(h, w, ctx.temperature).sub_(normalisers[rows, None])
                grad = logp.exp()  # p, then the gradient of the chunk's logits, in place
                if ctx.entropy_grad and grad_entropy is not None:
                    logp.add_(entropy[rows, None]).mul_(grad).mul_(grad_entropy[rows, None])  # p (log p + H) dH
                    grad.mul_(-grad_logprobs[rows, None]).sub_(logp)
                else:
                    grad.mul_(-grad_logprobs[rows, None])
                del logp
                grad.scatter_add_(-1, targets[rows, None], grad_logprobs[rows, None].to(grad.dtype))
                if _scaled(ctx.temperature):
                    grad.div_(ctx.temperature)
                grad = grad.to(ctx.dtype)
                if want_hidden:
                    grad_hidden[rows] = grad @ w
                if want_weight:
                    grad_weight += grad.t() @ h
        return (grad_hidden, grad_weight.to(weight.dtype) if want_weight else None,
                None, None, None, None, None)


def score_chunks(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                 chunk: int, *, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-probs, entropies, log-normalisers), each (N,) in float32, without a graph."""
    n = hidden.shape[0]
    logprobs, entropy, normalisers = (torch.empty(n, dtype=torch.float32, device=hidden.device) for _ in range(3))
    with torch.no_grad(), torch.autocast(weight.device.type, enabled=False):
        w = weight.to(dtype)
        fused = _fused(weight.device, chunk_stats)
        for start in range(0, n, chunk):
            rows = slice(start, start + chunk)
            if fused is not None:
                logprobs[rows], entropy[rows], normalisers[rows] = fused(hidden[rows].to(dtype) @ w.t(), targets[rows],
                                                                         temperature)
                continue
            logits = _logits(hidden[rows].to(dtype), w, temperature)
            normaliser = torch.logsumexp(logits, dim=-1)
            normalisers[rows] = normaliser
            logp = logits.sub_(normaliser[:, None])
            logprobs[rows] = logp.gather(-1, targets[rows, None]).squeeze(-1)
            entropy[rows] = -(logp.exp() * logp).sum(-1)
    return logprobs, entropy, normalisers


def _logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = (hidden @ weight.t()).float()
    return logits.div_(temperature) if _scaled(temperature) else logits


def _scaled(temperature: float) -> bool:
    """Whether logits are divided by the temperature (0 stands for greedy, scored at temperature 1)."""
    return temperature > 0 and temperature != 1.0


def chunk_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log p(target), entropy, log-normaliser) in float32 of one chunk's logits, as one expression
    for the compiler."""
    z = logits.float()
    if _scaled(temperature):
        z = z / temperature
    normaliser = torch.logsumexp(z, dim=-1)
    logp = z - normaliser[:, None]
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(torch.exp(logp) * logp).sum(-1), normaliser


def chunk_grad(logits: torch.Tensor, targets: torch.Tensor, normaliser: torch.Tensor, entropy: torch.Tensor,
               grad_logprobs: torch.Tensor, *, grad_entropy: Optional[torch.Tensor], temperature: float,
               dtype: torch.dtype) -> torch.Tensor:
    """The gradient of one chunk's logits in `dtype`, as one expression for the compiler: HeadScores.backward's
    arithmetic (onehot_t - p) dlogp - p (log p + H) dH, over the temperature."""
    z = logits.float()
    if _scaled(temperature):
        z = z / temperature
    logp = z - normaliser[:, None]
    p = torch.exp(logp)
    grad = -p * grad_logprobs[:, None]
    if grad_entropy is not None:
        grad = grad - p * (logp + entropy[:, None]) * grad_entropy[:, None]
    hit = torch.arange(z.shape[-1], device=z.device)[None] == targets[:, None]
    grad = grad + hit * grad_logprobs[:, None]
    if _scaled(temperature):
        grad = grad / temperature
    return grad.to(dtype)


_COMPILED: Dict[str, Callable] = {}


def _fused(device: torch.device, fn: Callable) -> Optional[Callable]:
    """`fn` (`chunk_stats` or `chunk_grad`) compiled for a CUDA device, once per process; None elsewhere or
    after compiling failed in this process (the eager code runs instead; `compile_guard`).
    The rows of a chunk vary (a pass's last chunk is shorter), the vocabulary does not: only the rows are
    compiled as a dynamic size, so the reduction over the vocabulary is generated for its known length."""
    if device.type != "cuda" or compiling_failed():
        return None
    if fn.__name__ not in _COMPILED:
        _COMPILED[fn.__name__] = guarded(torch.compile(fn), fn, "the output head's arithmetic", _rows_dynamic)
    return _COMPILED[fn.__name__]


def _rows_dynamic(args: tuple, kwargs: dict) -> None:
    for arg in args:
        if isinstance(arg, torch.Tensor):
            torch._dynamo.maybe_mark_dynamic(arg, 0)
