"""`RequestError`: a client's bad request, shared by both request planes.

The HTTP plane answers it with its `status` and an OpenAI-style error body; the TCP plane
sends it in-band as upstream's `InvalidArgument`.
"""

from __future__ import annotations


class RequestError(ValueError):
    """A bad request: HTTP `status` with an OpenAI-style error body."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
