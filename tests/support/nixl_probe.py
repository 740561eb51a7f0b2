"""A raw NIXL transfer between two processes, the way vLLM's NixlConnector moves a KV cache:
the serving side registers DRAM blocks and answers one metadata request on a ZMQ side channel;
the reading side fetches the metadata, then READs every block over UCX and checks the bytes.
It runs in the venv `hack/vllm-venv` makes (NIXL is there), as two processes:

    python -m support.nixl_probe serve --host IP --port 5600 --blocks 256 --block-bytes 32768
    python -m support.nixl_probe read --host IP --port 5600 --rounds 5

`read` prints one JSON line: bytes per round, the best round's seconds and GiB/s. It is the
baseline of tests/bench/bench_disagg.py (the raw rate between the same two endpoints) and a
probe of whether NIXL gets through between two network namespaces at all.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import zmq

PATTERN_SEED = 7


def blocks(count: int, block_bytes: int) -> np.ndarray:
    """The served bytes: a fixed pseudo-random pattern, so the reader can check what arrived."""
    return np.random.default_rng(PATTERN_SEED).integers(
        0, 256, size=(count, block_bytes), dtype=np.uint8
    )


def register(agent: object, data: np.ndarray) -> object:
    """Register `data` as one DRAM region; its rows as the transfer descriptors."""
    agent.register_memory([(data.ctypes.data, data.nbytes, 0, "")], "DRAM")  # type: ignore[attr-defined]
    rows = [(data.ctypes.data + i * data.shape[1], data.shape[1], 0) for i in range(data.shape[0])]
    return agent.get_xfer_descs(rows, "DRAM")  # type: ignore[attr-defined]


def serve(host: str, port: int, count: int, block_bytes: int, timeout: float) -> None:
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("serve", nixl_agent_config(backends=["UCX"]))
    data = blocks(count, block_bytes)
    descs = agent.get_serialized_descs(register(agent, data))
    socket = zmq.Context().socket(zmq.REP)
    socket.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
    socket.bind(f"tcp://{host}:{port}")
    print(json.dumps({"serving": f"{host}:{port}", "blocks": count}), flush=True)
    socket.recv()
    socket.send_multipart(
        [agent.get_agent_metadata(), descs, json.dumps([count, block_bytes]).encode()]
    )
    # Stay up while the reader reads (it says when it is done).
    socket.recv()
    socket.send(b"bye")


def read(host: str, port: int, rounds: int, timeout: float) -> dict[str, float]:
    from nixl._api import nixl_agent, nixl_agent_config

    socket = zmq.Context().socket(zmq.REQ)
    socket.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
    socket.connect(f"tcp://{host}:{port}")
    socket.send(b"meta")
    metadata, remote, shape = socket.recv_multipart()
    count, block_bytes = json.loads(shape)
    agent = nixl_agent("read", nixl_agent_config(backends=["UCX"]))
    local = np.zeros((count, block_bytes), dtype=np.uint8)
    local_descs = register(agent, local)
    peer = agent.add_remote_agent(metadata)
    remote_descs = agent.deserialize_descs(remote)
    best = float("inf")
    for _ in range(rounds):
        local[:] = 0
        started = time.perf_counter()
        handle = agent.initialize_xfer("READ", local_descs, remote_descs, peer, b"")
        state = agent.transfer(handle)
        deadline = started + timeout
        while state not in ("DONE", "ERR"):
            if time.perf_counter() > deadline:
                raise TimeoutError(f"NIXL READ from {host}:{port} still {state} after {timeout} s")
            state = agent.check_xfer_state(handle)
        best = min(best, time.perf_counter() - started)
        agent.release_xfer_handle(handle)
        if state == "ERR":
            raise RuntimeError(f"NIXL READ from {host}:{port} failed")
        if not np.array_equal(local, blocks(count, block_bytes)):
            raise AssertionError("the bytes read differ from the bytes served")
    socket.send(b"done")
    socket.recv()
    total = count * block_bytes
    return {"bytes": total, "seconds": best, "gib_per_s": total / best / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(prog="nixl_probe")
    parser.add_argument("role", choices=("serve", "read"))
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, default=5600)
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--block-bytes", type=int, default=32768)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    if args.role == "serve":
        serve(args.host, args.port, args.blocks, args.block_bytes, args.timeout)
    else:
        print(json.dumps(read(args.host, args.port, args.rounds, args.timeout)), flush=True)


if __name__ == "__main__":
    main()
