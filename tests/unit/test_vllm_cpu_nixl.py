"""Our vLLM plugin (`dynamo.engines.vllm.cpu_nixl`, a `vllm.general_plugins` entry point):
on vLLM's CPU platform, the NIXL agent vLLM's NixlConnector makes has no busy progress thread.

Run in vLLM's venv (`hack/vllm-venv` installs the project, so its entry point, there): vLLM's
own plugin loader loads it, the connector's own config and agent classes make the agent, and
an agent made with NIXL's plain config is the baseline that shows the difference.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from support import vllm

pytestmark = pytest.mark.unit

# Prints, for an agent made with NIXL's plain config and one made as vLLM's connector makes
# it once vLLM loaded its plugins: whether it asked for a progress thread, and the CPU
# seconds the process used while the agent sat idle for IDLE seconds.
AGENTS = """
import json, time
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from nixl._api import nixl_agent_config as plain_config

IDLE = 1.0
found = {}
for name, config in (
    ("plain", plain_config(num_threads=4, capture_telemetry=True)),
    ("connector", base_worker.nixl_agent_config(num_threads=4, capture_telemetry=True)),
):
    agent = base_worker.NixlWrapper(name, config)
    started = time.process_time()
    time.sleep(IDLE)
    found[name] = {"thread": config.enable_pthread, "idle_cpu": time.process_time() - started}
    del agent
print("RESULT " + json.dumps(found))
"""


def test_the_connectors_nixl_agent_has_no_busy_progress_thread_on_cpu() -> None:
    python = vllm.vllm_python_or_skip()
    done = subprocess.run(
        [str(python), "-c", AGENTS],
        env=vllm.vllm_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    found = json.loads(line.removeprefix("RESULT "))
    assert found["plain"]["thread"] is True
    assert found["connector"]["thread"] is False
    # The plain agent's thread polls without pause (about one core); without it the idle
    # agent costs next to nothing.
    assert found["connector"]["idle_cpu"] < found["plain"]["idle_cpu"] / 4, found
