"""Forward-pass metrics publisher: a ZMQ PUB socket at `DYN_FORWARDPASS_METRIC_PORT`.

Each message is three frames, as `python -m dynamo.common.recv_forward_pass_metrics` and
upstream's relay read them: the topic, an 8-byte big-endian sequence number (per publisher,
from 0) and the msgpack payload (`dynamo.common.forward_pass_metrics.encode`).

Engines receive `publish` as their sink through `attach_forward_pass_metrics_sink(sink)`
(optional: an engine without that method publishes nothing). `publish` may be called from
any thread; it never blocks (a slow subscriber loses messages, as with any PUB socket).
"""

from __future__ import annotations

import logging
import threading

import msgspec
import zmq

from dynamo.common.forward_pass_metrics import ForwardPassMetrics, encode

logger = logging.getLogger(__name__)

FPM_TOPIC = b"forward-pass-metrics"


class ForwardPassPublisher:
    """Publishes `ForwardPassMetrics` on a bound ZMQ PUB socket."""

    def __init__(self, host: str, port: int, *, worker_id: str = "") -> None:
        """Bind `tcp://host:port` (port 0 picks a free one; see `endpoint`). Messages whose
        `worker_id` is empty get `worker_id` stamped in."""
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 100_000)
        address = f"tcp://{host}:*" if port == 0 else f"tcp://{host}:{port}"
        try:
            self._socket.bind(address)
        except zmq.ZMQError as exc:
            self._socket.close()
            self._context.term()
            raise OSError(
                f"cannot bind the forward-pass metrics socket at {address}: {exc}; set "
                "DYN_FORWARDPASS_METRIC_PORT to a free port (or unset it to disable FPM)"
            ) from exc
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._worker_id = worker_id
        self._sequence = 0
        self._lock = threading.Lock()
        self._closed = False

    def publish(self, metrics: ForwardPassMetrics) -> None:
        """Send one message (dropped silently when closed or when subscribers lag)."""
        if not metrics.worker_id and self._worker_id:
            metrics = msgspec.structs.replace(metrics, worker_id=self._worker_id)
        payload = encode(metrics)
        with self._lock:
            if self._closed:
                return
            sequence = self._sequence
            self._sequence += 1
            try:
                self._socket.send_multipart(
                    [FPM_TOPIC, sequence.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK
                )
            except zmq.Again:
                pass
            except zmq.ZMQError:
                logger.exception("publishing forward-pass metrics failed")

    def close(self) -> None:
        """Close the socket (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._socket.close()
            self._context.term()
