"""Preference (reward) model scoring: a learned reward for batches of samples.

Consumes samples and a Hugging Face sequence-classification model directory; produces one
score per sample for `prompt + completion`: the logit of a single-label model, or the
log-odds of label 1 for a two-label one. Models are loaded once per (path, device) per process.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, List, Tuple

from rlplatform.transport.samples import Sample

if TYPE_CHECKING:  # torch and transformers load on first use: `rlp validate` stays fast
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@functools.lru_cache(maxsize=None)
def load_classifier(path: str, device: str = "cpu") -> Tuple["PreTrainedModel", "PreTrainedTokenizerBase"]:
    """The model and tokenizer at `path`, in eval mode on `device`; cached for the process."""
    from transformers import AutoModelForSequenceClassification

    from rlplatform.policy import load_tokenizer

    tokenizer = load_tokenizer(path)
    # right padding keeps every real token at the position it has unpadded: batched == one by one
    tokenizer.padding_side = "right"
    tokenizer.truncation_side = "left"  # long texts keep their end, where the completion is
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForSequenceClassification.from_pretrained(path).to(device).eval()
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


class PreferenceModel:
    """Scores texts with a sequence classifier, `batch_size` texts at a time."""

    def __init__(self, path: str, device: str = "cpu", batch_size: int = 32, max_length: int = 512) -> None:
        self.path, self.device = path, device
        self.batch_size, self.max_length = batch_size, max_length
        self.model, self.tokenizer = load_classifier(path, device)

    def logits(self, texts: List[str]) -> "torch.Tensor":
        """[len(texts), num_labels] float32 logits."""
        import torch

        chunks = []
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = self.tokenizer(texts[start:start + self.batch_size], padding=True, truncation=True,
                                       max_length=self.max_length, return_tensors="pt").to(self.device)
                chunks.append(self.model(**batch).logits.float().cpu())
        return torch.cat(chunks) if chunks else torch.empty(0, self.model.config.num_labels)

    def scores(self, texts: List[str]) -> List[float]:
        """The single label's logit, or log p(label 1) - log p(label 0) for two labels."""
        num_labels = self.model.config.num_labels
        if num_labels not in (1, 2):
            raise ValueError(f"preference model {self.path} has {num_labels} labels; "
                             "a reward model needs 1 (a score) or 2 (rejected, preferred)")
        logits = self.logits(texts)
        return (logits[:, 0] if num_labels == 1 else logits[:, 1] - logits[:, 0]).tolist()


def preference_score(samples: List[Sample], *, model_path: str, device: str = "cpu",
                     batch_size: int = 32, max_length: int = 512) -> List[float]:
    """The preference model's score of `prompt + completion` for each sample.

    model_path: a Hugging Face sequence-classification model directory (1 or 2 labels).
    device: where the model runs ("cpu", "cuda", "cuda:1").
    batch_size: texts per forward pass.
    max_length: tokens kept per text; longer texts lose their beginning.
    """
    model = PreferenceModel(model_path, device, batch_size, max_length)
    return model.scores([sample.prompt + sample.completion for sample in samples])


preference_score.batch = True
