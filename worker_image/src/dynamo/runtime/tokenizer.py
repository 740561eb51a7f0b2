"""The tokenizer surface the request plane uses for text routes.

An engine that serves `/v1/completions` and `/v1/chat/completions` exposes a `tokenizer`
attribute after `start()`. A Hugging Face `PreTrainedTokenizerBase` with a chat template
satisfies this protocol; `dynamo.engines.sample.SampleTokenizer` is a tiny one for tests.
The runtime calls exactly these methods, always with keyword arguments as shown.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    """encode / decode / apply_chat_template, as the runtime calls them."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (`add_special_tokens=False` for chat-templated text)."""
        ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`; called on growing windows for incremental detokenization."""
        ...

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        *,
        tokenize: bool = False,
        add_generation_prompt: bool = True,
    ) -> Any:
        """The prompt text for a chat (`tokenize=False` returns a str)."""
        ...
