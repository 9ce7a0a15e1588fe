"""Agent episodes as one token sequence: the trajectories the OpenAI bridge records.

Each chat request of an episode is rendered as the job renders prompts (the chat template, or the
messages' text); when it extends the previous request's prompt and the reply sampled for it, that
reply's sampled tokens are kept exactly and only the new text is tokenised, as observation tokens.
A finished episode becomes a `Sample` of its `TokenTrace` (model tokens with their behaviour
log-probs and versions, observation tokens masked out), the record environment episodes keep too.
"""

from __future__ import annotations

import re
from dataclasses import KW_ONLY, dataclass, field
from typing import Dict, List

from rlplatform.actors.completions import Completion
from rlplatform.actors.token_trace import TokenTrace
from rlplatform.tokenization import CONTENT_MARK, encode_marked, holds_control_text, uses_chat_template
from rlplatform.transport.samples import Sample


class ExtensionError(ValueError):
    """A request of an episode whose messages do not continue the episode's conversation."""


class ChatRenderer:
    """Messages to prompt text and token ids, the way `encode_prompts` encodes data rows. What the agent's
    messages say is text, never control: a user, system or tool content holding a special token's text
    (an end of turn) is rendered as a stand-in and encoded as plain tokens; without a template every
    character is the agent's. Assistant contents are the episode's replies as answered, rendered as they are."""

    def __init__(self, tokenizer, chat_template: str) -> None:
        self.tokenizer = tokenizer
        self.templated = uses_chat_template(tokenizer, chat_template)

    def text(self, messages: List[Dict[str, str]]) -> str:
        """The prompt a reply to `messages` continues: the rendered template (with stand-ins), else the contents
        joined."""
        if self.templated:
            marked = [{**m, "content": CONTENT_MARK.format(k)} if self._is_marked(m) else m
                      for k, m in enumerate(messages)]
            return self.tokenizer.apply_chat_template(marked, tokenize=False, add_generation_prompt=True)
        return "".join(m["content"] for m in messages)

    def plain(self, text: str, messages: List[Dict[str, str]]) -> str:
        """`text` of `messages` with each stand-in replaced by its content."""
        return re.sub(CONTENT_MARK.format(r"(\d+)"), lambda found: messages[int(found.group(1))]["content"], text)

    def prompt_ids(self, text: str, messages: List[Dict[str, str]]) -> List[int]:
        """A first prompt's ids (the tokenizer's special tokens, such as a BOS, only without a template)."""
        if self.templated:
            return encode_marked(self.tokenizer, text, [m["content"] for m in messages])
        return self.tokenizer(text, split_special_tokens=True)["input_ids"]

    def observation_ids(self, text: str, messages: List[Dict[str, str]]) -> List[int]:
        """Ids of `text`, the part of `messages`' rendering that follows the episode's newest reply."""
        if self.templated:
            return encode_marked(self.tokenizer, text, [m["content"] for m in messages])
        return self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"] if text else []

    def decode(self, ids: List[int], special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=not special_tokens, clean_up_tokenization_spaces=False)

    def _is_marked(self, message: Dict[str, str]) -> bool:
        return message["role"] != "assistant" and holds_control_text(self.tokenizer, message["content"])


@dataclass
class Episode:
    """One agent episode so far: its first prompt, then every token after it."""
    prompt_text: str  # the first request's prompt
    prompt_ids: List[int]
    text: str  # the newest request's prompt text (with the renderer's stand-ins): what its reply continues
    reply_text: str = ""  # the newest reply as answered to the agent (special tokens removed)
    reply_model_text: str = ""  # the same reply with its special tokens
    _: KW_ONLY
    trace: TokenTrace = field(default_factory=TokenTrace)  # every token after the first prompt

    @classmethod
    def start(cls, renderer: ChatRenderer, messages: List[Dict[str, str]]) -> "Episode":
        text = renderer.text(messages)
        return cls(prompt_text=renderer.plain(text, messages), prompt_ids=renderer.prompt_ids(text, messages),
                   text=text)

    @property
    def ids(self) -> List[int]:
        """The whole sequence: what the next reply is sampled after."""
        return self.prompt_ids + self.trace.ids

    def extend(self, renderer: ChatRenderer, messages: List[Dict[str, str]]) -> None:
        """Append the text `messages` add after the newest reply as observation tokens."""
        text = renderer.text(messages)
        self.trace.add_observation(renderer.observation_ids(self._observation_text(text), messages))
        self.text = text

    def _observation_text(self, text: str) -> str:
        """What `text` adds after the newest prompt and its reply; the reply's own stop token is not
        repeated where the template writes the same text after the reply."""
        if text.startswith(self.text):
            after = text[len(self.text):]
            for written in (self.reply_model_text, self.reply_text):
                if after.startswith(written):
                    return after[len(written):]
        raise ExtensionError("the messages do not continue this episode: they must repeat its earlier messages "
                             "and the assistant replies exactly as answered, then add new ones; use a new "
                             "episode id for another conversation")

    def add_reply(self, renderer: ChatRenderer, reply: Completion) -> None:
        self.trace.add_model_tokens(reply)
        self.reply_text = reply.text
        self.reply_model_text = renderer.decode(reply.completion_ids, special_tokens=True)

    def sample(self, renderer: ChatRenderer, sample_id: str, group_id: str, policy: str, row: Dict,
               *, now: float, position: int) -> Sample:
        """`position`: the prompt ledger's position of the group's prompt (-1: none, an agent's own group)."""
        return Sample(sample_id=sample_id, group_id=group_id, policy=policy, prompt=self.prompt_text,
                      completion=renderer.decode(self.trace.ids), prompt_ids=self.prompt_ids,
                      completion_ids=self.trace.ids, behaviour_logprobs=self.trace.logprobs,
                      token_versions=self.trace.versions, completion_mask=self.trace.mask, row=row, created_at=now,
                      prompt_position=position)
