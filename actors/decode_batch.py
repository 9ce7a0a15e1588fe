"""The transformers engine's dynamic decode loop: a continuous batch over a Hugging Face KV cache.

`DecodeBatch` keeps its rows left-padded in a `DynamicCache` that grows by one column per step and is
cut when rows leave; `prefill` runs waiting prompts through the model in chunks of at most
`rollout.prefill_tokens` padded tokens. It serves every model transformers loads, with or without LoRA
adapters, and records a mixture-of-experts policy's routing for each row (`RoutingRecorder`); `rlplatform.actors.static_decode` is the faster loop for the architectures it knows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Hashable, List, Optional, Sequence, Tuple

import torch
from transformers import DynamicCache

from rlplatform.actors.completions import Completion, Row, completion, sample
from rlplatform.actors.routing_record import RoutingRecorder
from rlplatform.token_budget import micro_batches

if TYPE_CHECKING:
    from rlplatform.actors.engine import TransformersEngine


class DecodeBatch:
    """Sequences decoded together, one token each per `step` (continuous batching).

    New prompts may join before any step; a sequence leaves the batch the step it emits a stop id or
    reaches `max_new_tokens`, so short completions free their slot for new work instead of
    waiting for the longest one. The rows stay left-padded: joining rows are padded to the
    batch's length (or the batch to theirs), and columns no row attends to any more are cut.
    Each step's logits come from the weights loaded at that step, which are the version its
    tokens record: weights may change between steps.

    The row bookkeeping and sampling (`add`, `step`) are every transformers decode loop's; where the KV
    cache lives is this class's (`_decode`, `_join`, `_keep`), which `StaticDecodeBatch` replaces.
    """

    def __init__(self, engine: TransformersEngine, max_new_tokens: int, temperature: float) -> None:
        self.model, self.engine = engine.model, engine
        self.stop_ids = torch.tensor(engine.stop_ids, dtype=torch.long, device=engine.device)
        self.pad_id = engine.tokenizer.pad_token_id
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.rows: List[Row] = []
        self.waiting: List[Tuple[List[int], Hashable, int, float]] = []  # (prompt ids, key, limit, temperature)
        self.cache: Optional[DynamicCache] = None
        self.device = engine.device
        self.recorder = engine.recorder  # a mixture-of-experts policy's routing record (None: dense)
        # (rows, cache length + 1 when rows have a token to feed)
        self.attention = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(0, 1, dtype=torch.long, device=self.device)  # each row's next token position
        self.last_tokens = torch.zeros(0, dtype=torch.long, device=self.device)  # newest tokens, not yet in the cache

    def __len__(self) -> int:
        return len(self.rows) + len(self.waiting)

    def add(self, prompts: List[List[int]], keys: List[Hashable], max_new_tokens: Optional[int] = None,
            temperature: Optional[float] = None) -> None:
        """Queue prompts (token ids) to join at the next step; each finished completion comes back with its key.
        `max_new_tokens` and `temperature` apply to these rows only (unset: the batch's)."""
        limit = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        temperature = self.temperature if temperature is None else temperature
        self.waiting.extend((prompt, key, limit, temperature) for prompt, key in zip(prompts, keys))

    @torch.no_grad()
    def step(self) -> List[Tuple[Hashable, Completion]]:
        """Sample one token for every sequence; returns the sequences that finished, with their keys."""
        logits = []
        if self.rows:
            logits.append(self._decode())
        if self.waiting:
            logits.append(self._prefill_waiting())
        if not logits:
            return []
        temperatures = [r.temperature for r in self.rows]
        token, logprob = sample(torch.cat(logits).float(), torch.tensor(temperatures, device=self.device),
                                any(t > 0 for t in temperatures))
        stopped = torch.isin(token, self.stop_ids)
        # one transfer from the device per step: each row's token, its log-prob and whether it is a stop id
        tokens, logprobs, stops = torch.stack([token.double(), logprob.double(), stopped.double()]).tolist()
        finished = []
        for row, t, lp, stop in zip(self.rows, tokens, logprobs, stops):
            row.tokens.append(int(t))
            row.logprobs.append(lp)
            row.versions.append(self.engine.version)
            finished.append(bool(stop) or len(row.tokens) >= row.max_new_tokens)
        done = [(row.key, completion(row, self.engine.tokenizer)) for row, f in zip(self.rows, finished) if f]
        self._keep(finished, token)
        return done

    def _prefill_waiting(self) -> torch.Tensor:
        """Run the waiting prompts through the model and add them to the batch; their last logits.
        Each distinct prompt runs once: rows of the same prompt (a group's completions) share its cache."""
        prompts, keys, limits, temperatures = zip(*self.waiting)
        self.waiting = []
        distinct: Dict[Tuple[int, ...], int] = {}
        owner = torch.tensor([distinct.setdefault(tuple(p), len(distinct)) for p in prompts], device=self.device)
        cache, attention, logits, routed = prefill(self.model, [list(p) for p in distinct], self.pad_id, self.device,
                                                   self.engine.prefill_tokens, cache_keyword=self.engine.cache_keyword,
                                                   recorder=self.recorder)
        new_rows = [Row(key, list(prompt), limit, temperature)
                    for key, prompt, limit, temperature in zip(keys, prompts, limits, temperatures)]
        for row, prompt in zip(new_rows, owner.tolist() if routed else []):
            row.routed.append(routed[prompt])
        self._join(new_rows, cache, attention, owner)
        self.rows += new_rows
        return logits[owner]

    def _decode(self) -> torch.Tensor:
        """The rows' next-token logits: their newest tokens through the model on the cache."""
        out = self.model(input_ids=self.last_tokens[:, None], attention_mask=self.attention,
                         position_ids=self.positions, use_cache=True, **{self.engine.cache_keyword: self.cache})
        if self.recorder is not None:
            for row, experts in zip(self.rows, self.recorder.take(len(self.rows), 1)):
                row.routed.append(experts)
        return out.logits[:, -1]

    def _join(self, new_rows: List[Row], cache: DynamicCache, attention: torch.Tensor, owner: torch.Tensor) -> None:
        """Merge the prefilled prompts' cache (distinct prompts, left-padded; row i's is `owner[i]`'s) into the
        batch's, after the rows already there."""
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        if len(owner) > attention.shape[0]:
            cache = DynamicCache(ddp_cache_data=[(layer.keys[owner], layer.values[owner]) for layer in cache.layers])
            attention, positions = attention[owner], positions[owner]
        if self.rows:
            # the old rows' newest tokens are in their cache now; both parts are `width` columns long, left-padded
            width = max(attention.shape[1], self.attention.shape[1])
            cache = _merge_caches([self.cache, cache], width)
            attention = torch.cat([_pad_left(self.attention, width), _pad_left(attention, width)])
            positions = torch.cat([self.positions, positions[:, -1:]])
        else:
            positions = positions[:, -1:]
        self.cache, self.attention, self.positions = cache, attention, positions

    def _keep(self, finished: List[bool], token: torch.Tensor) -> None:
        """Drop finished rows, and columns no remaining row attends to; the rest get their new token.
        A step where no row finished touches neither the cache nor the host."""
        if not any(finished):
            self.attention = torch.cat([self.attention, torch.ones_like(self.attention[:, :1])], dim=1)
            self.positions = self.positions + 1
            self.last_tokens = token
            return
        self.rows = [row for row, f in zip(self.rows, finished) if not f]
        if not self.rows:
            self.cache, self.attention = None, self.attention[:0]
            return
        index = torch.tensor([i for i, f in enumerate(finished) if not f], device=self.device)
        attention = self.attention[index]
        first = int(attention.any(0).float().argmax())
        for layer in self.cache.layers:
            layer.keys = layer.keys[index, :, first:]
            layer.values = layer.values[index, :, first:]
        self.attention = torch.cat([attention[:, first:], torch.ones_like(attention[:, :1])], dim=1)
        self.positions = self.positions[index] + 1
        self.last_tokens = token[index]


def prefill(model: torch.nn.Module, prompts: List[List[int]], pad_id: int, device: torch.device, prefill_tokens: int,
            *, cache_keyword: str, recorder: Optional[RoutingRecorder] = None
            ) -> Tuple[DynamicCache, torch.Tensor, torch.Tensor, List[torch.Tensor]]:
    """(KV cache, attention mask, last-position logits, with `recorder` each prompt's routing (positions, layers,
    k)) of prompts left-padded to the longest, computed in chunks of consecutive prompts of at most
    `prefill_tokens` padded tokens each (a longer prompt alone), so no forward holds more; only the last position
    goes through the output head."""
    chunks = micro_batches([len(p) for p in prompts], prefill_tokens, padded=True)
    caches, masks, logits, routed = [], [], [], []
    for chunk in chunks:
        ids, attention = _left_padded([prompts[i] for i in chunk], pad_id, device)
        cache = DynamicCache()
        logits.append(model(input_ids=ids, attention_mask=attention, use_cache=True, logits_to_keep=1,
                            position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
                            **{cache_keyword: cache}).logits[:, -1])
        if recorder is not None:
            experts = recorder.take(*ids.shape)
            routed += [experts[row, ids.shape[1] - len(prompts[i]):] for row, i in enumerate(chunk)]
        caches.append(cache)
        masks.append(attention)
    if len(chunks) == 1:
        return caches[0], masks[0], logits[0], routed
    width = max(mask.shape[1] for mask in masks)
    return (_merge_caches(caches, width), torch.cat([_pad_left(mask, width) for mask in masks]),
            torch.cat(logits), routed)


def _left_padded(prompts: Sequence[List[int]], pad_id: int, device: torch.device
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of token-id prompts, left-padded to the longest."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        attention[i, width - len(prompt):] = 1
    return ids.to(device), attention.to(device)


def _pad_left(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Zero columns on the left of a (rows, length) mask up to `width`."""
    return torch.nn.functional.pad(tensor, (width - tensor.shape[1], 0))


def _merge_caches(caches: List[DynamicCache], width: int) -> DynamicCache:
    """One cache holding each cache's rows in turn, each left-padded with zeros to `width` positions."""
    pad = lambda t: torch.nn.functional.pad(t, (0, 0, width - t.shape[2], 0))  # noqa: E731
    return DynamicCache(ddp_cache_data=[(torch.cat([pad(layer.keys) for layer in layers]),
                                         torch.cat([pad(layer.values) for layer in layers]))
                                        for layers in zip(*(cache.layers for cache in caches))])
