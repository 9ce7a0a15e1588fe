"""The transformers engine's fast decode loop: a static KV cache in slots, each step a CUDA graph on a GPU.

Hugging Face's decode forward launches a few hundred small kernels per token from Python: on a GPU the
host, not the device, bounds a step (a 0.5B policy with 512 rows spent 4x more host time than GPU time
per step). `SlotDecoder` keeps one slot per sequence in a preallocated cache (slot s holds its sequence's
keys and values at columns 0..position) and computes a decode step as one fixed-shape function of the
slots' newest tokens and positions, through the model's own modules and weights. On CUDA each batch-size
bucket's step is captured once as a CUDA graph and replayed; elsewhere it runs eagerly, the same
arithmetic, so its tokens can be checked against `DecodeBatch` on a CPU.

`StaticDecodeBatch` is `DecodeBatch` with its cache in the decoder's slots: prompts still prefill through
the model (`prefill`, chunked) and their keys and values move into free slots. Weights load in place
(`load_state_dict` copies into the parameters), so a captured step always reads the version loaded.
The architectures it knows are the Llama-style decoders (`STATIC_MODEL_TYPES`) without sliding windows
or adapters; `rollout.kv_cache` chooses (`static_decoding`).
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Dict, Iterable, List, Optional, Set, Tuple

import torch
from transformers import DynamicCache

from rlplatform.actors.completions import Row
from rlplatform.actors.decode_batch import DecodeBatch

if TYPE_CHECKING:
    from rlplatform.actors.engine import TransformersEngine

logger = logging.getLogger(__name__)

STATIC_MODEL_TYPES = ("qwen2", "llama")  # decoders whose layers are attention (q/k/v/o, rotary) + MLP with pre-norms
LENGTH_STEP = 64  # the cache's columns grow in multiples of this
WIDTH_STEP = 16  # an eager step attends to the columns in use, rounded up to a multiple of this


def unsupported(model: torch.nn.Module) -> Optional[str]:
    """Why `SlotDecoder` cannot run `model`, or None when it can."""
    config = model.config
    if config.model_type not in STATIC_MODEL_TYPES:
        return f"model type {config.model_type!r} is not one of {', '.join(STATIC_MODEL_TYPES)}"
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        return "the model has no decoder layers at model.layers (LoRA adapters?)"
    if any(getattr(layer.self_attn, "sliding_window", None) for layer in layers):
        return "the model uses sliding-window attention"
    if getattr(model.model.rotary_emb, "rope_type", "default") == "dynamic":
        return "the model's rotary embedding is dynamic (its frequencies depend on the sequence length)"
    return None


def static_decoding(kv_cache: str, model: torch.nn.Module, adapters: bool) -> bool:
    """`rollout.kv_cache` made concrete: `auto` is static for a model the slot decoder runs, `static` insists
    (a clear error when it cannot), `dynamic` never."""
    if kv_cache == "dynamic":
        return False
    reason = "LoRA adapters need the dynamic loop" if adapters else unsupported(model)
    if kv_cache == "static" and reason:
        raise ValueError(f"rollout.kv_cache: static cannot run this policy: {reason}; use auto or dynamic")
    return reason is None


class SlotDecoder:
    """A model's decode step over a static KV cache of `slots` sequences x `length` positions.

    Slots are handed out lowest first (`reserve`) and a step runs over the smallest bucket (a power of two)
    holding the highest slot in use, so the captured graphs are few. The cache grows (and the graphs are
    captured again) when more slots or longer sequences are asked for than it holds.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model, self.device = model, device
        config = model.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.dtype = model.model.embed_tokens.weight.dtype
        self.graphs = device.type == "cuda"
        self.captured: Dict[int, Tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.free: Set[int] = set()
        self.lengths: List[int] = []
        self.slots, self.length = 0, 0
        self._allocate(0, 0)

    def reserve(self, count: int, length: int) -> List[int]:
        """`count` free slots for sequences of up to `length` positions (prompt and completion)."""
        if count > len(self.free) or length > self.length:
            in_use = self.slots - len(self.free)
            slots = self.slots if count <= len(self.free) else max(8, 1 << (in_use + count - 1).bit_length())
            self._allocate(slots, max(self.length, -(-length // LENGTH_STEP) * LENGTH_STEP))
        taken = sorted(self.free)[:count]
        self.free.difference_update(taken)
        return taken

    def release(self, slots: Iterable[int]) -> None:
        """Give slots back; their position returns to 0, so a bucket's idle slots read one valid column."""
        slots = list(slots)
        if slots:
            self.positions[torch.tensor(slots, device=self.device)] = 0
            self.free.update(slots)
            for slot in slots:
                self.lengths[slot] = 1

    def load(self, slots: List[int], cache: DynamicCache, attention: torch.Tensor, owner: torch.Tensor,
             prompt_lengths: List[int]) -> None:
        """Move prefilled prompts into `slots`: the cache and mask hold distinct prompts left-padded, slot i
        takes prompt `owner[i]`'s keys and values at columns 0.. and the position of its last prompt token
        (`prompt_lengths[i]` tokens long, kept host-side so no step reads them back from the device)."""
        for slot, length in zip(slots, prompt_lengths):
            self.lengths[slot] = length
        index_of_slots = torch.tensor(slots, device=self.device)
        width = attention.shape[1]
        filled = attention.sum(-1)  # each prefilled prompt's tokens, on the device
        columns = (torch.arange(width, device=self.device)[None] + (width - filled)[:, None]).clamp(max=width - 1)
        index = columns[:, None, :, None].expand(-1, self.kv_heads, -1, self.head_dim)
        for layer, keys, values in zip(cache.layers, self.keys, self.values):
            keys[:, :, :width].index_copy_(0, index_of_slots, layer.keys.gather(2, index)[owner].to(self.dtype))
            values[:, :, :width].index_copy_(0, index_of_slots, layer.values.gather(2, index)[owner].to(self.dtype))
        self.positions[index_of_slots] = filled[owner] - 1

    def feed(self, slots: List[int], active: torch.Tensor, tokens: torch.Tensor) -> None:
        """The slots' next tokens (`active`: the slots on the device), each one position after the slot's last."""
        self.tokens.index_copy_(0, active, tokens)
        self.positions.index_add_(0, active, torch.ones_like(active))
        for slot in slots:
            self.lengths[slot] += 1

    def move(self, sources: List[int], targets: List[int]) -> None:
        """Slot `sources[i]`'s sequence (cache, fed token, position) into slot `targets[i]`, whose sequence ended."""
        source, target = torch.tensor(sources, device=self.device), torch.tensor(targets, device=self.device)
        for buffer in (*self.keys, *self.values, self.tokens, self.positions):
            buffer.index_copy_(0, target, buffer.index_select(0, source))
        for s, t in zip(sources, targets):
            self.lengths[t] = self.lengths[s]

    def step(self, highest: int) -> torch.Tensor:
        """Next-token logits of slots 0..b-1 (b: on CUDA the bucket holding slot `highest`, eagerly `highest` + 1):
        their fed tokens go into the cache and through the model."""
        if not self.graphs:  # eagerly: only the columns some of these slots attend to
            width = -(-max(self.lengths[:highest + 1]) // WIDTH_STEP) * WIDTH_STEP
            return self._forward(highest + 1, min(width, self.length))
        bucket = min(1 << highest.bit_length(), self.slots)
        if bucket not in self.captured:
            try:
                self.captured[bucket] = self._capture(bucket)
            except RuntimeError as error:  # a model module that cannot be captured: the same step, eagerly
                logger.warning("decode steps run without CUDA graphs: capturing one failed: %s", error)
                self.graphs = False
                return self._forward(bucket)
        graph, logits = self.captured[bucket]
        graph.replay()
        return logits

    def _capture(self, bucket: int) -> Tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The bucket's step recorded as a CUDA graph, after a warm-up on a side stream. Both passes write the
        fed tokens' keys and values at their positions, as the replay does: the same values in the same places."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(bucket, self.length)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a weight receiver's thread that touches CUDA meanwhile does not invalidate the capture
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            logits = self._forward(bucket, self.length)
        return graph, logits

    def _forward(self, bucket: int, width: int) -> torch.Tensor:
        """One decode step of slots 0..bucket-1 through the model's modules, over the cache's first `width` columns
        (every column a slot attends to): fixed shapes, no host reads."""
        decoder, b = self.model.model, bucket
        tokens, positions = self.tokens[:b], self.positions[:b]
        groups = self.heads // self.kv_heads
        cos, sin = self.cos[positions][:, None, None], self.sin[positions][:, None, None]
        hidden_mask = self.columns[None, :width] > positions[:, None]  # columns a slot does not attend to
        bias = torch.zeros(hidden_mask.shape, dtype=torch.float32, device=self.device).masked_fill(
            hidden_mask, float("-inf"))[:, None, None]
        index = positions.view(b, 1, 1, 1).expand(b, self.kv_heads, 1, self.head_dim)
        hidden = decoder.embed_tokens(tokens)
        for layer, layer_keys, layer_values in zip(decoder.layers, self.keys, self.values):
            keys, values, attention = layer_keys[:, :, :width], layer_values[:, :, :width], layer.self_attn
            x = layer.input_layernorm(hidden)
            q = _rotate(attention.q_proj(x).view(b, self.kv_heads, groups, self.head_dim), cos, sin)
            k = _rotate(attention.k_proj(x).view(b, self.kv_heads, 1, self.head_dim), cos, sin)
            keys[:b].scatter_(2, index, k)
            values[:b].scatter_(2, index, attention.v_proj(x).view(b, self.kv_heads, 1, self.head_dim))
            scores = torch.matmul(q, keys[:b].transpose(-1, -2)).float() * attention.scaling + bias
            mixed = torch.matmul(scores.softmax(-1).to(values.dtype), values[:b])
            hidden = hidden + attention.o_proj(mixed.reshape(b, self.heads * self.head_dim))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.model.lm_head(decoder.norm(hidden))

    def _allocate(self, slots: int, length: int) -> None:
        """Buffers for `slots` x `length`, keeping what the old ones held; captured graphs are dropped."""
        self.captured.clear()
        shape = (slots, self.kv_heads, length, self.head_dim)
        keys, values = [], []
        for layer in range(len(self.model.model.layers)):
            keys.append(torch.zeros(shape, dtype=self.dtype, device=self.device))
            values.append(torch.zeros(shape, dtype=self.dtype, device=self.device))
            if self.slots:
                keys[-1][:self.slots, :, :self.length] = self.keys[layer]
                values[-1][:self.slots, :, :self.length] = self.values[layer]
        tokens = torch.zeros(slots, dtype=torch.long, device=self.device)
        positions = torch.zeros(slots, dtype=torch.long, device=self.device)
        if self.slots:
            tokens[:self.slots], positions[:self.slots] = self.tokens, self.positions
        self.keys, self.values, self.tokens, self.positions = keys, values, tokens, positions
        self.lengths = self.lengths[:self.slots] + [1] * (slots - self.slots)  # columns each slot uses (host side)
        self.columns = torch.arange(length, device=self.device)
        probe = torch.zeros(1, dtype=self.dtype, device=self.device)
        cos, sin = self.model.model.rotary_emb(probe, self.columns[None])
        self.cos, self.sin = cos[0], sin[0]
        self.free.update(range(self.slots, slots))
        self.slots, self.length = slots, length
        if self.graphs:
            torch.cuda.empty_cache()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding, as Hugging Face's `apply_rotary_pos_emb` computes it."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class StaticDecodeBatch(DecodeBatch):
    """`DecodeBatch` whose rows live in the engine's `SlotDecoder` slots; slots a dropped batch still
    held go back to the decoder."""

    def __init__(self, engine: TransformersEngine, max_new_tokens: int, temperature: float) -> None:
        super().__init__(engine, max_new_tokens, temperature)
        self.decoder: SlotDecoder = engine.slot_decoder
        self.slots: List[int] = []  # each row's slot, in row order (changed in place: the finalizer holds it)
        self.active = torch.zeros(0, dtype=torch.long, device=self.device)
        weakref.finalize(self, self.decoder.release, self.slots)

    def _decode(self) -> torch.Tensor:
        return self.decoder.step(max(self.slots))[self.active]

    def _join(self, new_rows: List[Row], cache: DynamicCache, attention: torch.Tensor, owner: torch.Tensor) -> None:
        slots = self.decoder.reserve(len(new_rows), max(len(r.prompt_ids) + r.max_new_tokens for r in new_rows))
        self.decoder.load(slots, cache, attention, owner, [len(r.prompt_ids) for r in new_rows])
        self.slots += slots
        self.active = torch.tensor(self.slots, device=self.device)

    def _keep(self, finished: List[bool], token: torch.Tensor) -> None:
        """Feed the new tokens; finished rows give their slots back, into which the batch's highest remaining rows
        move, so that its slots stay the lowest and its steps run over the fewest slots (one slot's cache copied
        per row moved, where the dynamic loop copies the whole cache)."""
        self.decoder.feed(self.slots, self.active, token)
        if not any(finished):
            return
        kept = [slot for slot, f in zip(self.slots, finished) if not f]
        freed = sorted(slot for slot, f in zip(self.slots, finished) if f)
        moves = [(high, low) for high, low in zip(sorted(kept, reverse=True), freed) if high > low]
        if moves:
            self.decoder.move([high for high, _ in moves], [low for _, low in moves])
            moved, filled = dict(moves), {low for _, low in moves}
            kept = [moved.get(slot, slot) for slot in kept]
            freed = [slot for slot in freed if slot not in filled] + list(moved)
        self.decoder.release(freed)
        self.rows = [row for row, f in zip(self.rows, finished) if not f]
        self.slots[:] = kept
        self.active = torch.tensor(self.slots, dtype=torch.long, device=self.device)
