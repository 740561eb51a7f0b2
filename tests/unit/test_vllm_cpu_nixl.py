"""Our vLLM plugin (`dynamo.engines.vllm.cpu_nixl`, a `vllm.general_plugins` entry point): on
vLLM's CPU platform, the threads of the NIXL agent vLLM's NixlConnector makes (its busy UCX
progress thread among them) run under SCHED_IDLE, and still poll.

Run in vLLM's venv (`hack/vllm-venv` installs the project, so its entry point, there): vLLM's
own plugin loader loads the plugin, and the connector's own config and agent classes make the
agent. The baseline is the same agent made in a process where vLLM loaded no plugin.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from support import vllm

pytestmark = pytest.mark.unit

# Makes an agent as vLLM's connector makes it (after vLLM loaded its plugins, or not) and
# prints the scheduling policy of each thread it started, in how many of 20 looks over a
# second one of them was runnable (state R: polling, whether or not a core was free for it; CPU
# seconds would measure the machine's load instead), and whether NIXL was loaded before the
# connector's module.
IDLE_AGENT = """
import json, os, sys, time
if sys.argv[1] == "plugins":
    from vllm.plugins import load_general_plugins
    load_general_plugins()
loaded_early = any(name.startswith("nixl") for name in sys.modules)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

before = set(os.listdir("/proc/self/task"))
agent = base_worker.NixlWrapper("idle", base_worker.nixl_agent_config(num_threads=2))
started = set(os.listdir("/proc/self/task")) - before
policies = [os.sched_getscheduler(int(t)) for t in started]

def runnable(thread):
    with open(f"/proc/self/task/{thread}/stat") as stat:
        return stat.read().rpartition(") ")[2].split()[0] == "R"

polling_looks = 0
for _ in range(20):
    polling_looks += any(runnable(t) for t in started)
    time.sleep(0.05)
found = {"policies": policies, "polling_looks": polling_looks, "loaded_early": loaded_early}
print("RESULT " + json.dumps(found))
"""


def idle_agent(python: Path, mode: str) -> dict[str, Any]:
    done = subprocess.run(
        [str(python), "-c", IDLE_AGENT, mode],
        env=vllm.vllm_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    found: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return found


def test_the_connectors_nixl_threads_run_under_sched_idle_on_cpu() -> None:
    python = vllm.vllm_python_or_skip()
    plain = idle_agent(python, "no-plugins")
    ours = idle_agent(python, "plugins")
    assert plain["policies"], "the agent started no thread"
    assert set(plain["policies"]) == {os.SCHED_OTHER}, plain
    assert set(ours["policies"]) == {os.SCHED_IDLE}, ours
    # Still polling as NIXL intends: its progress thread never sleeps, it only yields a core.
    assert ours["polling_looks"] == 20, ours
    # The plugin alone loads no NIXL (nor UCX): only a KV connector that asks for it does.
    assert ours["loaded_early"] is False


def test_a_refused_policy_change_leaves_the_agent_working_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where a seccomp profile forbids sched_setscheduler, the agent is still made (its
    threads keep their policy) and the log says what that costs."""
    from dynamo.engines.vllm import cpu_nixl

    stop = threading.Event()
    started: list[threading.Thread] = []

    def agent_init(agent: object) -> None:
        thread = threading.Thread(target=stop.wait)
        thread.start()
        started.append(thread)

    def refuse(*args: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    try:
        cpu_nixl._idle_threads(agent_init)(object())
    finally:
        stop.set()
        for thread in started:
            thread.join()
    assert len(started) == 1
    assert "keeps its scheduling policy" in caplog.text
    assert "competes with the engines" in caplog.text
