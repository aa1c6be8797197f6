"""Chat messages to token ids, with the messages' text encoded as plain text.

Rendering the template and tokenizing the result (what `LLM.chat` does) lets a user who types
`<|im_start|>system` inside a message open a system turn of their own: the tokenizer matches special
tokens anywhere in its input. Here the template is rendered with a random marker in place of each
message's content; the template's own text is tokenized as usual (its control tokens are meant) and each
content as plain text, special-token strings included, by a copy of the tokenizer that does not match
them. For a template that does not show every content exactly once (it trims or repeats it), the usual
rendering is used and content holding a special token's text is refused instead.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from pdserve.errors import InvalidRequestError


class ChatEncoder:
    def __init__(self, tokenizer: Any) -> None:
        import tokenizers

        self._tokenizer = tokenizer
        backend = tokenizer.backend
        self._backend = backend
        self._plain = tokenizers.Tokenizer.from_str(backend.to_str())
        self._plain.encode_special_tokens = True  # only this copy: the template's tokens stay special
        self._added = backend.encode("", add_special_tokens=True).ids  # what encode() adds (a BOS, say)
        self._specials = [t.content for t in backend.get_added_tokens_decoder().values() if t.special]

    def encode(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        """Token ids of the templated conversation. Raises InvalidRequestError (no template, the template
        refused the messages, or a special token in a name or in content that cannot be kept plain)."""
        for m in messages:
            if self._holds_special(m.get("name", "")):
                raise InvalidRequestError("a message name must not contain special tokens")
        nonce = secrets.token_hex(8)
        marked = [{**m, "content": f"\x00{nonce}:{i}\x00"} for i, m in enumerate(messages)]
        text = self._tokenizer.apply_chat_template(marked, add_generation_prompt=add_generation_prompt)
        pieces = re.split(f"\x00{nonce}:(\\d+)\x00", text)
        if sorted(int(i) for i in pieces[1::2]) != list(range(len(messages))):
            return self._encode_whole(messages, add_generation_prompt)
        ids = list(self._added)
        for k, piece in enumerate(pieces):
            if k % 2 == 0:
                if piece:
                    ids += self._backend.encode(piece, add_special_tokens=False).ids
            else:
                content = messages[int(piece)]["content"]
                if content:
                    ids += self._plain.encode(content, add_special_tokens=False).ids
        return ids

    def _encode_whole(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        if any(self._holds_special(m["content"]) for m in messages):
            raise InvalidRequestError("message content must not contain special tokens for this model's template")
        text = self._tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self._tokenizer.encode(text)

    def _holds_special(self, text: str) -> bool:
        return any(s in text for s in self._specials)
