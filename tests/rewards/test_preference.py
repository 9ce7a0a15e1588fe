"""Preference model scorer on tiny Qwen2 classifiers built from config: batched scores equal
one-by-one scores and the model's own logits, and one load per model directory."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from rlplatform.policy import demo_tokenizer
from rlplatform.rewards.preference import PreferenceModel, preference_score

TEXTS = ["12+30=42", "the answer is 7", "x", "what is 5*6? it is 30.", "(1+2)*3=9, so nine"]


def test_batched_scores_equal_one_by_one_scores(tiny_classifier):
    path = tiny_classifier(num_labels=1)
    batched = PreferenceModel(path, batch_size=4).scores(TEXTS)  # two batches, padded to different lengths
    single = [PreferenceModel(path, batch_size=1).scores([text])[0] for text in TEXTS]
    torch.testing.assert_close(torch.tensor(batched), torch.tensor(single), atol=1e-5, rtol=0)
    assert max(batched) - min(batched) > 1e-2  # the inputs get different scores


def test_single_label_score_is_the_models_logit(tiny_classifier):
    path = tiny_classifier(num_labels=1)
    model = AutoModelForSequenceClassification.from_pretrained(path)
    inputs = demo_tokenizer()(TEXTS[1], return_tensors="pt")  # the tokenizer the model was saved with
    with torch.no_grad():
        expected = model(**inputs).logits[0, 0].item()
    assert PreferenceModel(path).scores([TEXTS[1]]) == pytest.approx([expected], abs=1e-5)


def test_two_label_score_is_the_log_odds_of_label_one(tiny_classifier):
    model = PreferenceModel(tiny_classifier(num_labels=2))
    logits = model.logits(TEXTS)
    log_probs = logits.log_softmax(-1)
    torch.testing.assert_close(torch.tensor(model.scores(TEXTS)), log_probs[:, 1] - log_probs[:, 0], atol=1e-5, rtol=0)


def test_more_than_two_labels_is_refused(tiny_classifier):
    path = tiny_classifier(num_labels=3)
    with pytest.raises(ValueError, match="has 3 labels; a reward model needs 1"):
        PreferenceModel(path).scores(TEXTS)


def test_preference_score_batch_reward(tiny_classifier, make_sample):
    path = tiny_classifier(num_labels=1)
    samples = [make_sample("=42", prompt="12+30"), make_sample(" is 7", prompt="the answer")]
    assert preference_score.batch is True
    expected = PreferenceModel(path).scores(["12+30=42", "the answer is 7"])  # prompt + completion
    assert preference_score(samples, model_path=path, batch_size=2) == pytest.approx(expected, abs=1e-6)
    assert PreferenceModel(path).model is PreferenceModel(path, batch_size=8).model  # loaded once per path
