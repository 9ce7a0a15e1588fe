"""Safety filters: the blocklist, and a tiny classifier whose head is set by hand so that one
completion is flagged with a known probability and another is not."""

from __future__ import annotations

import pytest
import torch

from rlplatform.rewards.preference import PreferenceModel
from rlplatform.rewards.safety import blocklist, safety_classifier

FLAGGED, CLEAN = "how to build a bomb", "how to bake a cake"
MARGIN = 3.0  # the hand-set head gives FLAGGED the logit +3 and CLEAN -3 for the flagged label


def test_blocklist_matches_whole_words_and_patterns_case_insensitively(make_sample):
    assert blocklist(make_sample("Build a BOMB now"), words=("bomb",)) == 1.0
    assert blocklist(make_sample("the bombardier"), words=("bomb",)) == 0.0  # whole words only
    assert blocklist(make_sample("call 555-0100"), patterns=(r"\d{3}-\d{4}",)) == 1.0
    assert blocklist(make_sample("this is (unsafe)!"), words=("(unsafe)",)) == 1.0  # punctuation in a word
    assert blocklist(make_sample("a (safe) text"), words=("(unsafe)",), patterns=(r"kill\w*",)) == 0.0
    assert blocklist(make_sample("anything")) == 0.0


def _head(num_labels: int):
    """A score head with logit(flagged label) = +MARGIN on FLAGGED and -MARGIN on CLEAN (label 0 fixed at 0)."""
    def make(model, tokenizer) -> torch.Tensor:
        with torch.no_grad():  # the classifier reads the last token's final hidden state
            hidden = torch.stack([model.model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0, -1]
                                  for text in (FLAGGED, CLEAN)])
        direction = torch.linalg.lstsq(hidden, torch.tensor([[MARGIN], [-MARGIN]])).solution.T  # hidden @ w = ±3
        return direction if num_labels == 1 else torch.cat([torch.zeros_like(direction), direction])
    return make


@pytest.mark.parametrize("num_labels", [1, 2])
def test_safety_classifier_thresholds_the_flagged_probability(tiny_classifier, make_sample, num_labels):
    path = tiny_classifier(num_labels, _head(num_labels))
    samples = [make_sample(FLAGGED), make_sample(CLEAN)]
    flagged_logits = PreferenceModel(path).logits([FLAGGED, CLEAN])[:, -1]
    torch.testing.assert_close(flagged_logits, torch.tensor([MARGIN, -MARGIN]), atol=1e-4, rtol=0)
    # P(flagged) = sigmoid(3) = 0.952574 for FLAGGED (softmax of (0, 3) for two labels), 0.047426 for
    # CLEAN; thresholds just either side of each probability pin them to 1e-4
    assert safety_classifier(samples, model_path=path) == [1.0, 0.0]
    assert safety_classifier(samples, model_path=path, threshold=0.9525) == [1.0, 0.0]
    assert safety_classifier(samples, model_path=path, threshold=0.9527) == [0.0, 0.0]
    assert safety_classifier(samples, model_path=path, threshold=0.0475) == [1.0, 0.0]
    assert safety_classifier(samples, model_path=path, threshold=0.0473) == [1.0, 1.0]
    assert safety_classifier.batch is True


def test_safety_classifier_flagged_label_picks_the_unsafe_class(tiny_classifier, make_sample):
    path = tiny_classifier(2, _head(2))
    samples = [make_sample(FLAGGED), make_sample(CLEAN)]
    assert safety_classifier(samples, model_path=path, flagged_label=0) == [0.0, 1.0]
