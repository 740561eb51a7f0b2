"""Streaming detokenization and stop strings for the text routes.

`IncrementalDetokenizer` turns token ids into text deltas without re-decoding the whole
output each time: it decodes a short window (from a few tokens back, so merges across token
boundaries come out right) and holds back text that ends in an incomplete UTF-8 sequence.
`StopStringFilter` cuts the text at the first stop string, holding back any tail that could
still become one, so a streamed delta never shows part of a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence

from dynamo.runtime.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Decode generated tokens into text deltas."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the newly complete text (may be empty)."""
        self._ids.extend(token_ids)
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = decode(self._ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            delta = new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever text is still held back (an incomplete sequence at the very end)."""
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""


class StopStringFilter:
    """Pass text through until a stop string appears; the stop string is not emitted."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [stop for stop in stops if stop]
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Return the text that is safe to emit; sets `stopped` when a stop string matched."""
        if self.stopped:
            return ""
        if not self._stops:
            return text
        buffer = self._held + text
        cut = min((index for stop in self._stops if (index := buffer.find(stop)) >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return buffer[:cut]
        keep = self._partial_tail(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """Release the held-back tail at the end of the stream."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_tail(self, buffer: str) -> int:
        # The longest suffix of `buffer` that is a proper prefix of some stop string.
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:size]):
                    longest = size
                    break
        return longest
