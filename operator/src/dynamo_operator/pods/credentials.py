"""The operator's identity towards worker pods: a projected service-account token.

Workers admit changes (`POST`/`DELETE /v1/loras`, `/engine/*`) only from callers whose token
a TokenReview accepts for the audience `WORKER_ADMIN_AUDIENCE` and whom a SubjectAccessReview
allows `update` on `dynamoworkers/admin` (the worker's `dynamo.runtime.system.auth`). The
chart mounts such a token at `DEFAULT_TOKEN_FILE` as a projected volume; the kubelet rotates
it, so the file is read again for every request (a small local read next to an HTTP call).
"""

from __future__ import annotations

import logging
from pathlib import Path

import aiohttp

logger = logging.getLogger(__name__)

WORKER_ADMIN_AUDIENCE = "dynamo.dev/worker-admin"
DEFAULT_TOKEN_FILE = Path("/var/run/secrets/dynamo.dev/worker-admin/token")


class BearerToken:
    """An aiohttp client middleware adding `Authorization: Bearer <token file>`.

    Without the file the request goes out bare (the worker answers 401 and says why), and
    the missing file is logged once, so a worker without admin auth still works.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._warned = False

    def token(self) -> str | None:
        """The current token, or None when the file is missing or empty."""
        try:
            token = self._path.read_text().strip()
        except OSError as exc:
            if not self._warned:
                logger.warning(
                    "no worker-admin token at %s (%s): requests to worker pods carry no "
                    "token, and workers with admin auth refuse them", self._path, exc,
                )  # fmt: skip
                self._warned = True
            return None
        return token or None

    async def __call__(
        self, request: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType
    ) -> aiohttp.ClientResponse:
        token = self.token()
        if token is not None:
            request.headers["Authorization"] = f"Bearer {token}"
        return await handler(request)
