"""Our vLLM plugin (`dynamo.engines.vllm.cpu_nixl`, a `vllm.general_plugins` entry point): on
vLLM's CPU platform, the progress thread of each NIXL agent vLLM's NixlConnector makes sleeps
between polls instead of spinning, and transfers still complete.

Run in vLLM's venv (`hack/vllm-venv` installs the project, so its entry point, there): vLLM's
own plugin loader loads the plugin, and the connector's own config and agent classes make the
agent. The baseline is the same agent made in a process where vLLM loaded no plugin.
"""

from __future__ import annotations

import json
import logging
import subprocess
import types
from pathlib import Path
from typing import Any

import pytest

from support import vllm

pytestmark = pytest.mark.unit

# Makes an agent as vLLM's connector makes it (after vLLM loaded its plugins, or not) and
# prints, for each thread it started, in how many of 20 looks over a second it was runnable
# (state R) and how often it went to sleep of its own accord (voluntary context switches): a
# spinning thread is runnable in every look and never sleeps, whatever else the machine runs,
# while CPU seconds would measure the machine's load. Then a second agent reads a buffer of
# the first over UCX's TCP transport (the way between pods), which needs both agents' progress
# threads, and the script prints whether the bytes arrived, and whether NIXL was loaded before
# the connector's module.
IDLE_AGENT = """
import json, os, sys, time
if sys.argv[1] == "plugins":
    from vllm.plugins import load_general_plugins
    load_general_plugins()
loaded_early = any(name.startswith("nixl") for name in sys.modules)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

def make_agent(name):
    return base_worker.NixlWrapper(name, base_worker.nixl_agent_config(num_threads=2))

def sleeps(thread):
    with open(f"/proc/self/task/{thread}/status") as status:
        for line in status:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])

def runnable(thread):
    with open(f"/proc/self/task/{thread}/stat") as stat:
        return stat.read().rpartition(") ")[2].split()[0] == "R"

before = set(os.listdir("/proc/self/task"))
source_agent = make_agent("source")
started = sorted(set(os.listdir("/proc/self/task")) - before)
slept = {t: sleeps(t) for t in started}
runnable_looks = {t: 0 for t in started}
for _ in range(20):
    for t in started:
        runnable_looks[t] += runnable(t)
    time.sleep(0.05)
threads = [{"runnable_looks": runnable_looks[t], "sleeps": sleeps(t) - slept[t]} for t in started]

reader = make_agent("reader")
source = bytearray(os.urandom(1 << 20))
copy = bytearray(len(source))
def where(buffer):
    import ctypes
    return ctypes.addressof((ctypes.c_char * len(buffer)).from_buffer(buffer)), len(buffer), 0
source_agent.register_memory([(*where(source), "")], "DRAM")
reader.register_memory([(*where(copy), "")], "DRAM")
reader.add_remote_agent(source_agent.get_agent_metadata())
read = reader.initialize_xfer(
    "READ", reader.get_xfer_descs([where(copy)], "DRAM"),
    source_agent.get_xfer_descs([where(source)], "DRAM"), "source", b"done",
)
reader.transfer(read)
while reader.check_xfer_state(read) == "PROC":
    time.sleep(0.001)
found = {
    "threads": threads,
    "read": reader.check_xfer_state(read) == "DONE" and copy == source,
    "loaded_early": loaded_early,
}
print("RESULT " + json.dumps(found))
"""


def idle_agent(python: Path, mode: str) -> dict[str, Any]:
    done = subprocess.run(
        [str(python), "-c", IDLE_AGENT, mode],
        env=vllm.vllm_env(UCX_TLS="tcp", UCX_NET_DEVICES="lo"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    found: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return found


def test_the_connectors_nixl_progress_thread_sleeps_between_polls_on_cpu() -> None:
    python = vllm.vllm_python_or_skip()
    plain = idle_agent(python, "no-plugins")
    ours = idle_agent(python, "plugins")
    assert plain["threads"], "the agent started no thread"
    # The baseline: NIXL's progress thread spins, runnable in every look, never asleep.
    assert any(t["runnable_looks"] == 20 and t["sleeps"] < 10 for t in plain["threads"]), plain
    # Ours sleeps between polls (measured: about 850 times a second on a busy machine).
    assert max(t["sleeps"] for t in ours["threads"]) >= 10, ours
    # Both move the bytes.
    assert plain["read"] is True
    assert ours["read"] is True
    # The plugin alone loads no NIXL (nor UCX): only a KV connector that asks for it does.
    assert ours["loaded_early"] is False


def test_an_api_without_the_native_module_it_expects_is_left_alone_and_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A later NIXL whose API no longer reaches its native module as `nixlBind`: vLLM's
    connector still gets a working agent (spinning as NIXL makes it), and the log says why."""
    from dynamo.engines.vllm import cpu_nixl

    api = types.ModuleType("nixl_later._api")
    with caplog.at_level(logging.WARNING):
        cpu_nixl._pause_agents_of(api)
    assert not hasattr(api, "nixlBind")
    assert "progress threads spin" in caplog.text
