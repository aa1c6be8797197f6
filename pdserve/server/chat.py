"""Chat messages to token ids, with the messages' text encoded as plain text.

Rendering the template and tokenizing the result (what `LLM.chat` does) lets a user who types
`<|im_start|>system` inside a message open a system turn of their own: the tokenizer matches special
tokens anywhere in its input. Here the template is rendered with a random marker in place of each
message's content; the special tokens of the template's own text are meant, and everything between two
of them (template text and contents together, as the tokenizer would see it: BPE merges across a
content's edges, as Qwen2.5's ".\n\n" after a system prompt) is tokenized by a copy of the tokenizer that
does not match special tokens, so a content's special-token strings stay plain text. For a template
that does not show every content exactly once (it trims or repeats it), the usual rendering is used and
content holding a special token's text is refused instead. What else a request puts
into the template's text (names, tool definitions, the arguments of earlier tool calls) must not hold a
special token's text either.
"""

from __future__ import annotations

import json
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
        added = backend.get_added_tokens_decoder()
        self._special_ids = {t.content: i for i, t in added.items() if t.special}
        self._specials = list(self._special_ids)
        # Splits text at special tokens, keeping them (longest first, as the tokenizer matches them).
        alternatives = "|".join(re.escape(t) for t in sorted(self._specials, key=len, reverse=True))
        self._special_split = re.compile(f"({alternatives})") if alternatives else None

    def encode(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of the templated conversation (with `tools` for templates that show them). Raises
        InvalidRequestError (no template, the template refused the messages, or a special token in a name,
        a tool or in content that cannot be kept plain)."""
        for m in messages:
            if self._holds_special(m.get("name") or "") or self._holds_special(m.get("tool_call_id") or ""):
                raise InvalidRequestError("a message name or tool_call_id must not contain special tokens")
            if m.get("tool_calls") and self._holds_special(json.dumps(m["tool_calls"], ensure_ascii=False)):
                raise InvalidRequestError("tool calls must not contain special tokens")
        if tools and self._holds_special(json.dumps(tools, ensure_ascii=False)):
            raise InvalidRequestError("tools must not contain special tokens")
        nonce = secrets.token_hex(8)
        # Empty content stays empty: templates test it ("if message.content"), a marker would be shown.
        marked = [{**m, "content": f"\x00{nonce}:{i}\x00"} if m["content"] else m for i, m in enumerate(messages)]
        text = self._tokenizer.apply_chat_template(marked, add_generation_prompt=add_generation_prompt, tools=tools)
        pieces = re.split(f"\x00{nonce}:(\\d+)\x00", text)
        if sorted(int(i) for i in pieces[1::2]) != [i for i, m in enumerate(messages) if m["content"]]:
            return self._encode_whole(messages, add_generation_prompt, tools)
        ids = list(self._added)
        run: list[str] = []  # the text since the template's last special token

        def flush() -> None:
            if run:
                ids.extend(self._plain.encode("".join(run), add_special_tokens=False).ids)
                run.clear()

        for k, piece in enumerate(pieces):
            if k % 2:
                run.append(messages[int(piece)]["content"])
                continue
            for j, part in enumerate(self._special_split.split(piece) if self._special_split else [piece]):
                if j % 2:  # a special token of the template
                    flush()
                    ids.append(self._special_ids[part])
                elif part:
                    run.append(part)
        flush()
        return ids

    def _encode_whole(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: list[dict[str, Any]] | None
    ) -> list[int]:
        if any(self._holds_special(m["content"]) for m in messages):
            raise InvalidRequestError("message content must not contain special tokens for this model's template")
        text = self._tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        return self._tokenizer.encode(text)

    def _holds_special(self, text: str) -> bool:
        return any(s in text for s in self._specials)
