"""Hub downloads check every redirect hop with the media URL policy (lora.hub_redirects):
the real `huggingface_hub` client against the local Hub imitation, redirected to a second
loopback server that counts what reaches it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dynamo.common.http.url_validator import UrlValidationPolicy
from dynamo.common.lora import LoRAManager
from dynamo.common.lora.errors import REASON_UNSAFE, LoRADownloadError
from dynamo.common.lora.hub_redirects import check_hop
from support.fake_hf_hub import FakeHub, running_hub
from support.lora_adapters import adapter_files, lora_env

pytestmark = pytest.mark.unit
__all__ = ["lora_env"]


class Target:
    """A server on 127.0.0.2 (loopback: a private address to the policy) serving `content`."""

    def __init__(self, content: bytes) -> None:
        self.hits = 0
        target = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                target.hits += 1
                self.send_response(200)
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

        self.server = ThreadingHTTPServer(("127.0.0.2", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.2:{self.server.server_port}/blob"


@pytest.fixture
def hub(lora_env: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    with running_hub() as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        yield fake


@pytest.fixture
def target() -> Iterator[Target]:
    files = adapter_files()
    server = Target(files["adapter_model.safetensors"])
    yield server
    server.server.shutdown()
    server.server.server_close()


async def test_a_redirect_to_a_private_address_is_refused_before_it_is_fetched(
    hub: FakeHub, target: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DYN_MM_ALLOW_INTERNAL", raising=False)
    hub.add_commit("org/a", adapter_files())
    hub.redirects["adapter_model.safetensors"] = target.url
    result = await LoRAManager().download_lora("hf://org/a")
    assert result["status"] == "error"
    assert result["reason"] == REASON_UNSAFE
    assert f"refusing a Hub request to '{target.url}'" in result["message"]
    assert target.hits == 0


async def test_the_same_redirect_is_followed_when_internal_urls_are_allowed(
    hub: FakeHub, target: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The media policy's own switch applies: the hook refuses by policy, not always."""
    monkeypatch.setenv("DYN_MM_ALLOW_INTERNAL", "1")
    hub.add_commit("org/b", adapter_files())
    hub.redirects["adapter_model.safetensors"] = target.url
    result = await LoRAManager().download_lora("hf://org/b")
    assert result["status"] == "success"
    assert target.hits == 1


@pytest.mark.parametrize(
    ("url", "refused"),
    [
        ("http://127.0.0.1:8000/org/a/resolve/main/x", False),  # the configured Hub itself
        ("http://169.254.169.254/latest/meta-data/", True),
        ("https://10.0.0.1/blob", True),
        ("http://203.0.113.9/blob", True),  # plain http off the Hub
        ("http://127.0.0.1:9999/blob", True),  # the Hub's host, another port
    ],
)
def test_each_hop_off_the_hub_passes_the_media_policy(url: str, refused: bool) -> None:
    policy = UrlValidationPolicy()
    if refused:
        with pytest.raises(LoRADownloadError, match="refusing a Hub request"):
            check_hop(url, "http://127.0.0.1:8000", policy)
    else:
        check_hop(url, "http://127.0.0.1:8000", policy)
