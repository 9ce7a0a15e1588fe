"""Conversation turns to token ids, for the token sequence of an episode.

`Renderer.prompt_ids` encodes an episode's first prompt exactly as `tokenization.encode_prompts`
does. `observation_ids` gives the tokens inserted after a model turn: with a chat template, the
text the template puts between the model's last token and the next generation prompt (the end of
the model's turn the model did not write, the observation turns, the next assistant header); in
plain text, each tool turn as `<result>...</result>` and each user turn as its text. The model's
own tokens are never re-encoded, so the trained sequence is the one the model sampled.
"""

from __future__ import annotations

from typing import Dict, List

from rlplatform.tokenization import uses_chat_template

Message = Dict[str, str]


class Renderer:
    def __init__(self, tokenizer, chat_template: str) -> None:
        self.tokenizer = tokenizer
        self.chat = uses_chat_template(tokenizer, chat_template)

    def prompt_ids(self, messages: List[Message]) -> List[int]:
        if self.chat:
            return self._ids(self._render(messages, generation_prompt=True))
        if len(messages) != 1 or messages[0]["role"] != "user":
            raise ValueError("without a chat template an episode's first prompt must be one user turn; "
                             "use a tokenizer with a chat template (data.chat_template: auto)")
        return list(self.tokenizer(messages[0]["content"])["input_ids"])

    def observation_ids(self, history: List[Message], turn_ids: List[int], observation: List[Message]) -> List[int]:
        """Tokens following the model turn `turn_ids` (the last message of `history`) that show `observation`
        and open the model's next turn."""
        if not self.chat:
            return self._ids("".join(f"<result>{m['content']}</result>" if m["role"] == "tool" else m["content"]
                                     for m in observation))
        after = self._render(history + observation, generation_prompt=True)
        written = self._render(history[:-1], generation_prompt=True) + self.tokenizer.decode(
            turn_ids, skip_special_tokens=False)
        if not after.startswith(written):  # the template rewrites the turn (strips it): append after it
            written = self._render(history, generation_prompt=False)
        if not after.startswith(written):
            raise ValueError("the chat template renders a conversation differently from its beginning (earlier "
                             "turns change as turns are added), so observations cannot be appended to an episode")
        return self._ids(after[len(written):])

    def _render(self, messages: List[Message], generation_prompt: bool) -> str:
        if not messages:
            return ""
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _ids(self, text: str) -> List[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
