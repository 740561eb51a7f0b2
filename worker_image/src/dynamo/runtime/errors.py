"""`RequestError`: a client's bad request, shared by both request planes and the engines.

The HTTP plane answers it with its `status` and an OpenAI-style error body (`param` names the
field, `code` is OpenAI's code where it has one, such as `context_length_exceeded`); the TCP
plane sends it in-band as upstream's `InvalidArgument`. Engines raise it for a request they
cannot serve as sent (their own last check), so such a request is a 400 there too, never a
500.
"""

from __future__ import annotations

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class RequestError(ValueError):
    """A bad request: HTTP `status` with an OpenAI-style error body."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code


def not_supported(param: str, engine: str) -> RequestError:
    """The 400 for a field the engine does not honour (refused, never silently dropped)."""
    return RequestError(f"'{param}' is not supported by this engine ({engine})", param=param)
