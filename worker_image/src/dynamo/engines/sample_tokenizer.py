"""`SampleTokenizer`: a tiny, deterministic byte-level tokenizer for the sample engine.

Token ids 0-2 are special (`<pad>`, `<s>`, `</s>`); every UTF-8 byte `b` is token `b + 3`.
Encoding and decoding are exact inverses, so text routes can be tested without a model.
The chat template writes each message as `<|role|>content` on its own line and, with
`add_generation_prompt`, ends with `<|assistant|>`.
"""

from __future__ import annotations

from typing import Any

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
BYTE_OFFSET = 3
VOCAB_SIZE = BYTE_OFFSET + 256
_SPECIAL_TEXT = {PAD_ID: "<pad>", BOS_ID: "<s>", EOS_ID: "</s>"}


class SampleTokenizer:
    """Byte-level tokenizer with the methods the runtime's text routes call."""

    bos_token_id = BOS_ID
    eos_token_id = EOS_ID
    pad_token_id = PAD_ID
    vocab_size = VOCAB_SIZE

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`<s>` (unless `add_special_tokens=False`) followed by one token per UTF-8 byte."""
        ids = [byte + BYTE_OFFSET for byte in text.encode("utf-8")]
        return [BOS_ID, *ids] if add_special_tokens else ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of `token_ids`; an incomplete UTF-8 sequence decodes to U+FFFD."""
        parts: list[str] = []
        pending = bytearray()
        for token in token_ids:
            if BYTE_OFFSET <= token < VOCAB_SIZE:
                pending.append(token - BYTE_OFFSET)
                continue
            if token not in _SPECIAL_TEXT:
                raise ValueError(f"token id {token} is outside the vocabulary (0-{VOCAB_SIZE - 1})")
            if not skip_special_tokens:
                parts.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
                parts.append(_SPECIAL_TEXT[token])
        parts.append(pending.decode("utf-8", errors="replace"))
        return "".join(parts)

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        *,
        tokenize: bool = False,
        add_generation_prompt: bool = True,
    ) -> Any:
        """The prompt text of `conversation` (token ids with `tokenize=True`)."""
        lines = [
            f"<|{message['role']}|>{message.get('content') or ''}\n" for message in conversation
        ]
        if add_generation_prompt:
            lines.append("<|assistant|>")
        text = "".join(lines)
        return self.encode(text, add_special_tokens=False) if tokenize else text
