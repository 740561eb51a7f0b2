"""The worker's own HTTP request plane (`DYN_HTTP_HOST:DYN_HTTP_PORT`).

* `server`: the aiohttp routes (`/v1/generate`, `/v1/completions`, `/v1/chat/completions`,
  `/v1/models`) over the shared `dynamo.runtime.serving.Serving`;
* `openai`: OpenAI request parsing and response shapes (pure);
* `detokenize`: incremental detokenization and stop strings for the text routes;
* `coalesce`: streamed chunks that come out close together share one write.
"""

from dynamo.runtime.http_plane.server import RequestPlane

__all__ = ["RequestPlane"]
