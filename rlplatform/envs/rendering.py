"""Conversation turns to token ids, for the token sequence of an episode.

`Renderer.prompt_ids` encodes an episode's first prompt exactly as `tokenization.encode_prompts`
does. `observation_ids` gives the tokens inserted after a model turn: with a chat template, the
text the template puts between the model's last token and the next generation prompt (the end of
the model's turn the model did not write, the observation turns, the next assistant header); in
plain text, each tool turn as `<result>...</result>` and each user turn as its text. The model's
own tokens are never re-encoded, so the trained sequence is the one the model sampled. What an
observation says is text, never control: a tool that prints a special token's text (an end of turn)
gets that text as plain tokens, while the template's own control tokens around it stay special.
`first_mismatch` checks a finished episode against its whole conversation rendered at once, as a
trainer that re-tokenizes conversations would see it.
"""

from __future__ import annotations

from typing import Dict, List, Optional

from rlplatform.tokenization import CONTENT_MARK, encode_marked, holds_control_text, uses_chat_template

Message = Dict[str, str]


class Renderer:
    def __init__(self, tokenizer, chat_template: str) -> None:
        self.tokenizer = tokenizer
        self.chat = uses_chat_template(tokenizer, chat_template)

    def prompt_ids(self, messages: List[Message]) -> List[int]:
        if self.chat:
            return encode_marked(self.tokenizer, self._render(messages, generation_prompt=True), [])
        if len(messages) != 1 or messages[0]["role"] != "user":
            raise ValueError("without a chat template an episode's first prompt must be one user turn; "
                             "use a tokenizer with a chat template (data.chat_template: auto)")
        return list(self.tokenizer(messages[0]["content"])["input_ids"])

    def observation_ids(self, history: List[Message], turn_ids: List[int], observation: List[Message]) -> List[int]:
        """Tokens following the model turn `turn_ids` (the last message of `history`) that show `observation`
        and open the model's next turn."""
        contents = [m["content"] for m in observation]
        if any(holds_control_text(self.tokenizer, content) for content in contents):  # stand-ins, encoded apart
            observation = [{**m, "content": CONTENT_MARK.format(k)} for k, m in enumerate(observation)]
        if not self.chat:
            return encode_marked(self.tokenizer, "".join(f"<result>{m['content']}</result>" if m["role"] == "tool"
                                                         else m["content"] for m in observation), contents)
        after = self._render(history + observation, generation_prompt=True)
        written = self._render(history[:-1], generation_prompt=True) + self.tokenizer.decode(
            turn_ids, skip_special_tokens=False)
        if not after.startswith(written):  # the template rewrites the turn (strips it): append after it
            written = self._render(history, generation_prompt=False)
        if not after.startswith(written):
            raise ValueError("the chat template renders a conversation differently from its beginning (earlier "
                             "turns change as turns are added), so observations cannot be appended to an episode")
        return encode_marked(self.tokenizer, after[len(written):], contents)

    def first_mismatch(self, messages: List[Message], prompt_turns: int, ids: List[int]) -> Optional[int]:
        """The first position where `ids` (an episode's prompt and completion tokens) departs from `messages`
        (its conversation, the first `prompt_turns` its prompt) rendered whole by the chat template and
        encoded as the episode encodes each part; None when `ids` is a prefix of that rendering (the template
        may close the last turn after the model's end token), or without a chat template (nothing to compare)."""
        if not self.chat:
            return None
        marked, contents = list(messages[:prompt_turns]), []
        for message in messages[prompt_turns:]:  # observations that hold control text: plain text, as encoded
            if message["role"] != "assistant" and holds_control_text(self.tokenizer, message["content"]):
                marked.append({**message, "content": CONTENT_MARK.format(len(contents))})
                contents.append(message["content"])
            else:
                marked.append(message)
        rendered = encode_marked(self.tokenizer, self._render(marked, generation_prompt=False), contents)
        position = next((i for i, (got, want) in enumerate(zip(ids, rendered)) if got != want), None)
        if position is None and len(ids) > len(rendered):
            return len(rendered)
        return position

    def _render(self, messages: List[Message], generation_prompt: bool) -> str:
        if not messages:
            return ""
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
