"""The kubelet node's CNI plugin: the process node's pod network (`network.wire_pod`: a veth
pair, the pod's /32 and a route both ways), with CNI's own host-local plugin for addresses.
CNI's `ptp` plugin would do the same but turns on forwarding for the whole machine, which
the test bed must not touch.

containerd runs it as CNI specifies: the command in CNI_COMMAND (ADD, DEL, CHECK, VERSION),
the pod's network namespace in CNI_NETNS, the network's configuration on stdin, the result
as JSON on stdout, an error as JSON with a non-zero exit.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from . import network
from .layout import GATEWAY_IP, GUARDED_RANGE, VETH_PREFIX

CNI_VERSION = "1.0.0"
SUPPORTED = ["0.4.0", "1.0.0", "1.1.0"]


def host_veth(container_id: str) -> str:
    return VETH_PREFIX + "k" + hashlib.sha1(container_id.encode()).hexdigest()[:9]


def _ipam(config: dict[str, Any], command: str) -> dict[str, Any]:
    """Run the configured IPAM plugin (host-local) as CNI does: same environment and stdin."""
    plugin = Path(os.environ["CNI_PATH"].split(":")[0]) / config["ipam"]["type"]
    env = {**os.environ, "CNI_COMMAND": command}
    result = subprocess.run(
        [str(plugin)], input=json.dumps(config), env=env, capture_output=True, text=True
    )
    if result.returncode != 0:
        raise RuntimeError(f"IPAM {command} failed: {result.stdout or result.stderr}")
    return json.loads(result.stdout) if result.stdout.strip() else {}


def add(config: dict[str, Any]) -> dict[str, Any]:
    netns = os.environ["CNI_NETNS"]
    if Path(netns).parent != Path("/var/run/netns") and Path(netns).parent != Path("/run/netns"):
        raise RuntimeError(f"CNI_NETNS {netns} is not under /var/run/netns")
    allocated = _ipam(config, "ADD")
    pod_ip = allocated["ips"][0]["address"].split("/")[0]
    veth = host_veth(os.environ["CNI_CONTAINERID"])
    network.delete_link(veth)
    network.wire_pod(Path(netns).name, veth, pod_ip)
    return {
        "cniVersion": config.get("cniVersion", CNI_VERSION),
        "interfaces": [{"name": veth}, {"name": "eth0", "sandbox": netns}],
        "ips": [{"address": f"{pod_ip}/32", "gateway": GATEWAY_IP, "interface": 1}],
        "routes": [{"dst": str(GUARDED_RANGE), "gw": GATEWAY_IP}],
    }


def delete(config: dict[str, Any]) -> None:
    network.delete_link(host_veth(os.environ["CNI_CONTAINERID"]))
    _ipam(config, "DEL")


def main() -> int:
    command = os.environ.get("CNI_COMMAND", "")
    try:
        if command == "VERSION":
            print(json.dumps({"cniVersion": CNI_VERSION, "supportedVersions": SUPPORTED}))
            return 0
        config = json.load(sys.stdin)
        if command == "ADD":
            print(json.dumps(add(config)))
        elif command == "DEL":
            delete(config)
        elif command in ("CHECK", "GC", "STATUS"):
            pass
        else:
            raise RuntimeError(f"unknown CNI_COMMAND {command!r}")
    except Exception as err:
        print(json.dumps({"cniVersion": CNI_VERSION, "code": 999, "msg": str(err)}))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
