"""The kubelet node, `kubelet-node-0`: the real kubelet with containerd and runc, registered
with the test bed's API server as any node is, so that what the chart puts in a pod spec
(users, a read-only root, capabilities, memory limits, Secret and token volumes) is enforced
and the images run as users run them.

What differs from a production node, and why (each found by running it on this machine):
- The kubelet, containerd and their children share one private mount namespace
  (`supervise`, started under `unshare --mount`). In it, directories of the bed's state are
  bound over `/var/lib/kubelet` (the device-plugin directory is fixed there),
  `/var/log/containers` and `/var/run/netns`, so nothing lands in the host's; and files
  holding the values the kubelet insists on are bound read-only over `vm.overcommit_memory`,
  `kernel.panic` and `kernel.panic_on_oops` (`protectKernelDefaults` makes it check instead
  of writing them): the host's own values are never changed. containerd must be in the
  kubelet's mount namespace, or memory emptyDirs, Secrets and tokens miss the containers.
- cgroup v1 (this host's hybrid layout): `failCgroupV1: false`, the cgroupfs driver, and a
  cgroup root of the bed's own (`CGROUP_ROOT`), which `stop` empties and removes.
- containerd restricts oom_score_adj: this machine lacks CAP_SYS_RESOURCE.
- No registry: images are imported into containerd (`import_images`), the sandbox image is
  the bed's own pause program, and pods use `imagePullPolicy: Never` or `IfNotPresent`.
- The pod network is the process node's (`cni_veth`), the node's address `NODE_IP` is on
  `lo` inside the guarded range, and its 8 `nvidia.com/gpu` come from a fake device plugin
  speaking the real device-plugin API (hack/testbed/node/gpu-device-plugin).
- Eviction thresholds are small absolute amounts (500Mi of disk): the machine's disk is
  shared with image builds and often fuller than a node's percentages allow, and a test
  bed must not evict its own pods over it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from . import daemons
from .layout import HACK_DIR, Layout, Ports, cache_dir, read_versions, server_url
from .pki import issue_leaf, kubeconfig_for

NODE_NAME = "kubelet-node-0"
NODE_IP = "198.18.0.2"
POD_CIDR = "198.18.3.0/24"
TAINT_KEY = "dynamo.dev/kubelet-node"
CGROUP_ROOT = "/dynamo-testbed-kubelet"
SANDBOX_IMAGE = "localhost/dynamo-testbed/pause:1"
SUPERVISOR = "kubelet-node"
# Directories of the bed's state bound over these host paths, inside the node's namespace.
BOUND = {
    "kubelet": "/var/lib/kubelet",
    "containers-log": "/var/log/containers",
    "netns": "/var/run/netns",
}
KERNEL_DEFAULTS = {"vm/overcommit_memory": "1", "kernel/panic": "10", "kernel/panic_on_oops": "1"}
CGROUP_HIERARCHIES = Path("/sys/fs/cgroup")


class NodePaths:
    """Where the kubelet node keeps its state, under the test bed's."""

    def __init__(self, layout: Layout) -> None:
        self.root = layout.root / "kubelet-node"
        self.socket = self.root / "containerd.sock"
        self.containerd_config = self.root / "containerd.toml"
        self.kubelet_config = self.root / "kubelet.yaml"
        self.kubeconfig = self.root / "node.kubeconfig"
        self.cni_conf = self.root / "cni" / "conf"
        self.cni_bin = self.root / "cni" / "bin"
        self.created_mountpoints = self.root / "created-mountpoints"
        self.bin_dir_file = self.root / "bin-dir"
        # The imported images (8 GB and minutes of importing) outlive the checkout: a second
        # checkout, or a fresh clone in CI on the same machine, finds them. Keyed by
        # containerd's version, whose store format it is.
        self.store = (
            cache_dir() / f"kubelet-node-containerd-{read_versions()['CONTAINERD_VERSION']}"
        )
        # Where the store was kept inside the checkout before.
        self.old_store = self.root / "containerd" / "root"

    def bound(self, name: str) -> Path:
        return self.root / "bound" / name


def prepare(layout: Layout, ports: Ports, bin_dir: Path) -> NodePaths:
    """Write the node's certificates, configuration and CNI set-up."""
    paths = NodePaths(layout)
    for name in BOUND:
        paths.bound(name).mkdir(parents=True, exist_ok=True)
    _move_old_store(paths)
    paths.store.mkdir(parents=True, exist_ok=True)
    for sub in (
        "sysctl",
        "pod-logs",
        "certs",
        "containerd/state",
        "containerd/opt",
        "cni/ipam",
    ):
        (paths.root / sub).mkdir(parents=True, exist_ok=True)
    for key, value in KERNEL_DEFAULTS.items():
        (paths.root / "sysctl" / key.replace("/", "_")).write_text(value + "\n")
    certs = paths.root / "certs"
    issue_leaf(layout.pki, certs / "client", f"system:node:{NODE_NAME}", "system:nodes")
    issue_leaf(layout.pki, certs / "serving", NODE_NAME, None, serves=([NODE_NAME], [NODE_IP]))
    kubeconfig_for(layout.pki, server_url(ports), certs / "client", paths.kubeconfig)
    _write_cni(paths, bin_dir)
    paths.containerd_config.write_text(_containerd_config(paths, bin_dir))
    paths.kubelet_config.write_text(json.dumps(_kubelet_config(layout, paths, ports), indent=2))
    return paths


def _move_old_store(paths: NodePaths) -> None:
    """A store an older bed kept in the checkout becomes the cache's, when the cache has none
    (a rename, on one disk); else it goes: it would hold a second copy of every image."""
    if not paths.old_store.exists():
        return
    if not paths.store.exists():
        paths.store.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):  # another disk: imported again instead
            paths.old_store.rename(paths.store)
    shutil.rmtree(paths.old_store, ignore_errors=True)


def _write_cni(paths: NodePaths, bin_dir: Path) -> None:
    paths.cni_conf.mkdir(parents=True, exist_ok=True)
    paths.cni_bin.mkdir(parents=True, exist_ok=True)
    for plugin in ("host-local", "loopback"):
        link = paths.cni_bin / plugin
        link.unlink(missing_ok=True)
        link.symlink_to(bin_dir / plugin)
    wrapper = paths.cni_bin / "dtb-veth"
    wrapper.write_text(
        f"#!/bin/sh\nPYTHONPATH={HACK_DIR} exec {sys.executable} -m testbed.cni_veth\n"
    )
    wrapper.chmod(0o755)
    conf = {
        "cniVersion": "1.0.0",
        "name": "dynamo-testbed",
        "plugins": [
            {
                "type": "dtb-veth",
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_CIDR}]],
                    "dataDir": str(paths.root / "cni" / "ipam"),
                },
            }
        ],
    }
    (paths.cni_conf / "10-dynamo-testbed.conflist").write_text(json.dumps(conf, indent=2))


def _containerd_config(paths: NodePaths, bin_dir: Path) -> str:
    state = paths.root / "containerd"
    return f"""version = 3
root = "{paths.store}"
state = "{state / "state"}"

[plugins.'io.containerd.server.v1.grpc']
  address = "{paths.socket}"

[plugins.'io.containerd.internal.v1.opt']
  path = "{state / "opt"}"

[plugins.'io.containerd.nri.v1.nri']
  disable = true

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{SANDBOX_IMAGE}"

[plugins.'io.containerd.cri.v1.runtime']
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["{paths.cni_bin}"]
    conf_dir = "{paths.cni_conf}"
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
      BinaryName = "{bin_dir / "runc"}"
      SystemdCgroup = false
"""


def _kubelet_config(layout: Layout, paths: NodePaths, ports: Ports) -> dict[str, object]:
    certs = paths.root / "certs"
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": NODE_IP,
        "port": ports.kubelet_node,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": ports.kubelet_node_healthz,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(layout.pki / "ca.crt")},
        },
        "authorization": {"mode": "Webhook"},
        "tlsCertFile": str(certs / "serving.crt"),
        "tlsPrivateKeyFile": str(certs / "serving.key"),
        "containerRuntimeEndpoint": f"unix://{paths.socket}",
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": CGROUP_ROOT,
        "failCgroupV1": False,
        "failSwapOn": False,
        "protectKernelDefaults": True,
        "podLogsDir": str(paths.root / "pod-logs"),
        "resolvConf": "",
        "registerWithTaints": [{"key": TAINT_KEY, "value": "true", "effect": "NoSchedule"}],
        # Absolute and small: the machine's disk is shared with image builds and imports
        # that dip it for seconds, and a pressure taint outlives them by this period.
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "500Mi",
            "imagefs.available": "500Mi",
            "nodefs.inodesFree": "1%",
        },
        "evictionPressureTransitionPeriod": "10s",
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "maxPods": 32,
        "shutdownGracePeriod": "0s",
    }


def start(layout: Layout, ports: Ports, bin_dir: Path) -> None:
    """Start the node's supervisor in a private mount namespace; returns at once (containerd's
    socket and the node's readiness are the caller's to await)."""
    paths = prepare(layout, ports, bin_dir)
    paths.bin_dir_file.write_text(str(bin_dir))
    # A socket left by a killed containerd would pass the caller's wait for the new one.
    paths.socket.unlink(missing_ok=True)
    _add_node_ip()
    created = [p for p in BOUND.values() if not Path(p).exists()]
    for mountpoint in created:
        Path(mountpoint).mkdir(parents=True)
    if created:
        paths.created_mountpoints.write_text("\n".join(created))
    daemons.start(
        layout,
        SUPERVISOR,
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "--",
            sys.executable,
            "-m",
            "testbed.kubelet_node",
            "supervise",
            f"--bin-dir={bin_dir}",
        ],
        env={"PYTHONPATH": str(HACK_DIR), "DYNAMO_TESTBED_DIR": str(layout.root)},
    )


def stop(layout: Layout) -> None:
    """Stop the supervisor (it stops the kubelet, the containers and containerd), then remove
    what is left: cgroups, the node's address, the mount points made for it."""
    daemons.stop(layout, SUPERVISOR, timeout=60.0)
    paths = NodePaths(layout)
    _kill_cgroup_processes()
    _remove_cgroups()
    _kill_shims(paths)
    _delete_node_ip()
    # The node's state goes; containerd's store stays (the imported images, in the cache).
    for name in BOUND:
        shutil.rmtree(paths.bound(name), ignore_errors=True)
    shutil.rmtree(paths.root / "containerd" / "state", ignore_errors=True)
    if paths.created_mountpoints.exists():
        for mountpoint in paths.created_mountpoints.read_text().split():
            with contextlib.suppress(OSError):
                os.rmdir(mountpoint)
        paths.created_mountpoints.unlink()


def ctr(paths: NodePaths, bin_dir: Path, *args: str, stdin: bytes | None = None) -> str:
    """containerd's own client, in the namespace the CRI uses (`k8s.io`)."""
    result = subprocess.run(
        [*_ctr_argv(paths, bin_dir), *args],
        input=stdin,
        capture_output=True,
        check=False,
    )
    if result.returncode != 0:
        raise SystemExit(f"ctr {' '.join(args)} failed: {result.stderr.decode()[-2000:]}")
    return result.stdout.decode()


def _ctr_argv(paths: NodePaths, bin_dir: Path) -> list[str]:
    return [str(bin_dir / "ctr"), f"--address={paths.socket}", "--namespace=k8s.io"]


def import_sandbox_image(paths: NodePaths, bin_dir: Path) -> None:
    """The pause program as the OCI image `SANDBOX_IMAGE`, imported into containerd."""
    ctr(paths, bin_dir, "images", "import", "--local", "-", stdin=_pause_archive(bin_dir))


def import_images(layout: Layout, refs: list[str], docker: str) -> list[str]:
    """Import each image `docker` has (`name:tag`) into the node's containerd under the name
    the kubelet expands it to (`docker.io/library/name:tag`), unless it is there already;
    returns those imported. Unpacked layers leave the content store: one copy on disk."""
    paths = NodePaths(layout)
    bin_dir = Path(paths.bin_dir_file.read_text().strip())
    present = set(ctr(paths, bin_dir, "images", "ls", "--quiet").split())
    imported = []
    for ref in refs:
        if _kubelet_name(ref) in present:
            continue
        _check_room_for(ref, docker, paths.root)
        save = subprocess.Popen([docker, "save", ref], stdout=subprocess.PIPE)
        result = subprocess.run(
            [
                *_ctr_argv(paths, bin_dir),
                "images",
                "import",
                "--local",
                "--discard-unpacked-layers",
                "-",
            ],
            stdin=save.stdout,
            capture_output=True,
            check=False,
        )
        if save.wait() != 0 or result.returncode != 0:
            free = shutil.disk_usage(paths.root).free / 2**30
            raise SystemExit(
                f"importing {ref} failed ({free:.1f} GiB free on the disk of {paths.root}): "
                f"{result.stderr.decode()[-2000:]}"
            )
        imported.append(ref)
        # Older builds of the same image go, as hack/build-images removes them from docker.
        repository = _kubelet_name(ref).rsplit(":", 1)[0]
        older = [p for p in present if p.rsplit(":", 1)[0] == repository]
        if older:
            ctr(paths, bin_dir, "images", "rm", *older)
    _remove_unnamed_images(paths, bin_dir)
    return imported


def _check_room_for(ref: str, docker: str, root: Path) -> None:
    """Exit naming the shortfall unless the disk can hold the image twice: all its layers
    arrive before they are unpacked (measured here: the worker image's import took twice its
    size at its peak), and a full disk mid-import says only "no space left"."""
    inspected = subprocess.run(
        [docker, "image", "inspect", "--format", "{{.Size}}", ref],
        capture_output=True,
        text=True,
        check=False,
    )
    if inspected.returncode != 0:
        raise SystemExit(f"importing {ref} failed: {inspected.stderr.strip()}")
    needed = 2 * int(inspected.stdout)
    free = shutil.disk_usage(root).free
    if free < needed:
        raise SystemExit(
            f"importing {ref} needs {needed / 2**30:.1f} GiB free on the disk of {root}, "
            f"which has {free / 2**30:.1f} GiB: free some (docker's build cache, for one: "
            "`docker builder prune`)"
        )


def _remove_unnamed_images(paths: NodePaths, bin_dir: Path) -> None:
    """Remove the CRI's `sha256:<image id>` records of images no name points to any more.

    The CRI adds such a record for each image it sees, and removing the image's name leaves
    it: each older worker build then kept its 6 GiB of layers, until the disk filled."""
    rows = [line.split() for line in ctr(paths, bin_dir, "images", "ls").splitlines()[1:]]
    named = {row[2] for row in rows if not row[0].startswith("sha256:")}
    unnamed = [row[0] for row in rows if row[0].startswith("sha256:") and row[2] not in named]
    if unnamed:
        # --sync: containerd's collector has freed the layers when this returns.
        ctr(paths, bin_dir, "images", "rm", "--sync", *unnamed)


def _kubelet_name(ref: str) -> str:
    """The fully qualified name the kubelet (and ctr's import) give a short image name."""
    first = ref.split("/", 1)[0]
    if "/" in ref and ("." in first or ":" in first or first == "localhost"):
        return ref
    return f"docker.io/{ref}" if "/" in ref else f"docker.io/library/{ref}"


def _pause_archive(bin_dir: Path) -> bytes:
    """An OCI image archive (image layout in a tar) of one layer holding /pause."""
    layer_buf = io.BytesIO()
    with tarfile.open(fileobj=layer_buf, mode="w") as layer:
        info = layer.gettarinfo(str(bin_dir / "pause"), arcname="pause")
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        with (bin_dir / "pause").open("rb") as f:
            layer.addfile(info, f)
    layer_bytes = layer_buf.getvalue()
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": ["/pause"], "User": "65535:65535"},
        "rootfs": {"type": "layers", "diff_ids": [_digest(layer_bytes)]},
    }
    config_bytes = json.dumps(config).encode()
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": _descriptor("application/vnd.oci.image.config.v1+json", config_bytes),
        "layers": [_descriptor("application/vnd.oci.image.layer.v1.tar", layer_bytes)],
    }
    manifest_bytes = json.dumps(manifest).encode()
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                **_descriptor("application/vnd.oci.image.manifest.v1+json", manifest_bytes),
                "annotations": {
                    "io.containerd.image.name": SANDBOX_IMAGE,
                    "org.opencontainers.image.ref.name": "1",
                },
            }
        ],
    }
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as archive:
        files = {
            "oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
            "index.json": json.dumps(index).encode(),
        }
        for blob in (layer_bytes, config_bytes, manifest_bytes):
            files[f"blobs/sha256/{_digest(blob).split(':')[1]}"] = blob
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _descriptor(media_type: str, data: bytes) -> dict[str, object]:
    return {"mediaType": media_type, "digest": _digest(data), "size": len(data)}


def leftovers(layout: Layout) -> list[str]:
    """What of the kubelet node exists now (empty after `stop`)."""
    found = [f"cgroup {d}" for d in _cgroup_dirs()]
    found += [f"process {pid} (containerd shim)" for pid in _shims(NodePaths(layout))]
    if NODE_IP in _lo_addresses():
        found.append(f"address {NODE_IP} on lo")
    return found


# -- inside the private mount namespace ------------------------------------------------------


def supervise(layout: Layout, bin_dir: Path) -> None:
    """Bind the node's directories and the kernel-default files, then run containerd, the
    kubelet and the device plugin until SIGTERM; then stop them in order."""
    paths = NodePaths(layout)
    for name, target in BOUND.items():
        _mount("--bind", str(paths.bound(name)), target)
    for key in KERNEL_DEFAULTS:
        target = f"/proc/sys/{key}"
        _mount("--bind", str(paths.root / "sysctl" / key.replace("/", "_")), target)
        _mount("-o", "remount,bind,ro", target)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    logs = layout.logs
    stopping = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    _create_cgroup_root()
    containerd = _spawn(
        [str(bin_dir / "containerd"), f"--config={paths.containerd_config}"],
        logs / "containerd.log",
        env,
    )
    while not paths.socket.exists() and containerd.poll() is None and not stopping:
        time.sleep(0.1)
    kubelet = _spawn(
        [
            str(bin_dir / "kubelet"),
            f"--config={paths.kubelet_config}",
            f"--kubeconfig={paths.kubeconfig}",
            f"--hostname-override={NODE_NAME}",
            f"--node-ip={NODE_IP}",
            "--root-dir=/var/lib/kubelet",
            f"--cert-dir={paths.root / 'certs'}",
            "--node-labels=dynamo.dev/node-kind=kubelet,nvidia.com/gpu.present=true",
            "--v=1",
        ],
        logs / "kubelet.log",
        env,
    )
    plugin: subprocess.Popen[bytes] | None = None
    registration = Path(BOUND["kubelet"]) / "device-plugins" / "kubelet.sock"
    while not stopping and kubelet.poll() is None and containerd.poll() is None:
        # The plugin exits when the kubelet forgets it (a kubelet restart): start it again.
        if (plugin is None or plugin.poll() is not None) and registration.exists():
            plugin = _spawn(
                [str(bin_dir / "gpu-device-plugin")], logs / "gpu-device-plugin.log", env
            )
        time.sleep(0.5)
    for proc in (plugin, kubelet):
        _terminate(proc)
    _kill_cgroup_processes()
    _terminate(containerd)
    _kill_shims(paths)
    _remove_cgroups()


def _spawn(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def _terminate(proc: subprocess.Popen[bytes] | None, within: float = 10.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(within)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True)


# -- cgroups, shims, addresses ---------------------------------------------------------------


def _hierarchies() -> list[Path]:
    """The mounted cgroup hierarchies: the one unified (v2) tree, or each v1 controller's
    (and, on a hybrid host, the unified one beside them)."""
    if (CGROUP_HIERARCHIES / "cgroup.controllers").exists():
        return [CGROUP_HIERARCHIES]
    return [d for d in CGROUP_HIERARCHIES.iterdir() if (d / "cgroup.procs").exists()]


def _cgroup_dirs() -> list[Path]:
    """The node's cgroups in every hierarchy, deepest first."""
    found: list[Path] = []
    for hierarchy in _hierarchies():
        top = hierarchy / CGROUP_ROOT.lstrip("/")
        if top.is_dir():
            found.extend(p for p in top.rglob("*") if p.is_dir())
            found.append(top)
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def _create_cgroup_root() -> None:
    """The kubelet wants its cgroup root in every hierarchy before it starts; a v1 cpuset
    cgroup serves no task until it has CPUs and memory nodes, its parent's here."""
    for hierarchy in _hierarchies():
        top = hierarchy / CGROUP_ROOT.lstrip("/")
        top.mkdir(exist_ok=True)
        for knob in ("cpuset.cpus", "cpuset.mems"):
            if (hierarchy / knob).exists() and not (top / knob).read_text().strip():
                (top / knob).write_text((hierarchy / knob).read_text())


def _kill_cgroup_processes() -> None:
    for _ in range(20):
        pids: set[int] = set()
        for cgroup in _cgroup_dirs():
            with contextlib.suppress(OSError):
                pids.update(int(p) for p in (cgroup / "cgroup.procs").read_text().split())
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


def _remove_cgroups() -> None:
    for cgroup in _cgroup_dirs():
        with contextlib.suppress(OSError):
            cgroup.rmdir()


def _shims(paths: NodePaths) -> list[int]:
    """containerd's runc shims of this node (they outlive containerd by design)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            ours = str(paths.socket).encode() in cmdline
            if cmdline[0].endswith(b"containerd-shim-runc-v2") and ours:
                found.append(int(proc.name))
    return found


def _kill_shims(paths: NodePaths) -> None:
    for pid in _shims(paths):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _lo_addresses() -> list[str]:
    out = subprocess.run(
        ["ip", "-4", "-o", "addr", "show", "dev", "lo"], capture_output=True, text=True, check=False
    ).stdout
    return [line.split()[3].split("/")[0] for line in out.splitlines() if " inet " in line]


def _add_node_ip() -> None:
    if NODE_IP not in _lo_addresses():
        subprocess.run(["ip", "addr", "add", f"{NODE_IP}/32", "dev", "lo"], check=True)


def _delete_node_ip() -> None:
    subprocess.run(
        ["ip", "addr", "del", f"{NODE_IP}/32", "dev", "lo"], capture_output=True, check=False
    )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m testbed.kubelet_node")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("supervise", help="(inside `unshare --mount`) run the node")
    run.add_argument("--bin-dir", type=Path, required=True)
    args = parser.parse_args()
    supervise(Layout.from_env(), args.bin_dir)


if __name__ == "__main__":
    main()
