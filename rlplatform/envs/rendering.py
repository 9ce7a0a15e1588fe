"""Conversation turns to token ids, for the token sequence of an episode.

`Renderer.prompt_ids` encodes an episode's first prompt exactly as `tokenization.encode_prompts`
does. `observation_ids` gives the tokens inserted after a model turn: with a chat template, the
text the template puts between the model's last token and the next generation prompt (the end of
the model's turn the model did not write, the observation turns, the next assistant header); in
plain text, each tool turn as `<result>...</result>` and each user turn as its text. The model's
own tokens are never re-encoded, so the trained sequence is the one the model sampled. What an
observation says is text, never control: a tool that prints a special token's text (an end of turn)
gets that text as plain tokens, while the template's own control tokens around it stay special.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional

from rlplatform.tokenization import uses_chat_template

Message = Dict[str, str]
MARK = "\u27e6observation {}\u27e7"  # stands in for an observation's content while the template renders


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
        contents = [m["content"] for m in observation]
        marked = any(self._controls(content) for content in contents)
        if marked:  # rendered with stand-ins, the contents encoded apart
            observation = [{**m, "content": MARK.format(k)} for k, m in enumerate(observation)]
        if not self.chat:
            return self._encode("".join(f"<result>{m['content']}</result>" if m["role"] == "tool" else m["content"]
                                        for m in observation), contents if marked else None)
        after = self._render(history + observation, generation_prompt=True)
        written = self._render(history[:-1], generation_prompt=True) + self.tokenizer.decode(
            turn_ids, skip_special_tokens=False)
        if not after.startswith(written):  # the template rewrites the turn (strips it): append after it
            written = self._render(history, generation_prompt=False)
        if not after.startswith(written):
            raise ValueError("the chat template renders a conversation differently from its beginning (earlier "
                             "turns change as turns are added), so observations cannot be appended to an episode")
        return self._encode(after[len(written):], contents if marked else None)

    def _render(self, messages: List[Message], generation_prompt: bool) -> str:
        if not messages:
            return ""
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _ids(self, text: str, as_text: bool = False) -> List[int]:
        """`text`'s ids; with `as_text`, the text of a special token in it becomes plain tokens."""
        if not text:
            return []
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=as_text)["input_ids"])

    def _encode(self, rendered: str, contents: Optional[List[str]]) -> List[int]:
        """Ids of rendered observation text; with `contents`, its `MARK` stand-ins hold them, encoded as text."""
        if contents is None:
            return self._ids(rendered)
        pieces = re.split(MARK.format(r"(\d+)"), rendered)  # template text, then a content's index, in turns
        ids = self._ids(pieces[0])
        for index, text in zip(pieces[1::2], pieces[2::2]):
            ids += self._ids(contents[int(index)], as_text=True) + self._ids(text)
        return ids

    def _controls(self, text: str) -> bool:
        """Whether `text` holds the text of one of the tokenizer's special tokens."""
        return any(token in text for token in self.tokenizer.all_special_tokens)
