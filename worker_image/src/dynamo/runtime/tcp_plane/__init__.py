"""Upstream Dynamo's TCP request plane, so that upstream's own frontend routes to this worker.

* `codec`: the byte framing (request frames, ACKs, two-part messages, payload codecs);
* `messages`: the control message and the response-stream items (data, errors, end);
* `callhome`: one request's call-home response stream to the frontend;
* `server`: the listener that ACKs requests and streams the engine's output;
* `address`: bind and advertised addresses, the endpoint path.

Served unless `DYN_REQUEST_PLANE=http` (`--request-plane`; upstream's default, `tcp`, is
ours). The Endpoint record then advertises, with `request_plane_codec: "msgpack"`,
`{"tcp": "<ip>:<port>/<instance id hex>/<namespace>/<component>/<endpoint>"}`. The worker's
own HTTP routes stay.
"""

from dynamo.runtime.tcp_plane.server import TcpRequestPlane

__all__ = ["TcpRequestPlane"]
