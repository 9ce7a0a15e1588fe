"""A reward shipped as a package: `pip install ./examples/reward_plugin` makes `shouting` usable by name."""


def shouting(sample, penalty: float = 1.0) -> float:
    """-penalty when the completion is written in capitals, else 0."""
    text = sample.completion.strip()
    return -penalty if text.isalpha() and text.isupper() else 0.0
