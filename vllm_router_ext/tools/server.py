"""Start `vllm serve` on 127.0.0.1, query it, stop it. Used by the demo (why it ships), the tests
and the end-to-end benchmark."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def omp_threads_bind(workers: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``workers`` CPU workers (one per TP / DP rank): each bound to
    a core this process may run on, round-robin (the ids are the host's, not 0, 1, ...)."""
    cores = sorted(os.sched_getaffinity(0))
    return "|".join(str(cores[i % len(cores)]) for i in range(workers))


#: vLLM's cache of what each model class supports, shared by every run (its entries are keyed by
#: the model file's hash): a miss imports vLLM in one more process, ~10 s on a 2-core CPU.
MODELINFO_CACHE = Path(tempfile.gettempdir()) / f"vllm-router-ext-modelinfos-{os.getuid()}"


def cpu_env(workdir: Path) -> dict[str, str]:
    """Environment for a CPU vLLM run whose caches and sockets stay in ``workdir``, except the
    model-class cache (:data:`MODELINFO_CACHE`)."""
    env = dict(os.environ)
    tmp = workdir / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    MODELINFO_CACHE.mkdir(parents=True, exist_ok=True)
    modelinfos = workdir / "vllm-cache" / "modelinfos"
    if not modelinfos.is_symlink() and not modelinfos.exists():
        modelinfos.parent.mkdir(parents=True, exist_ok=True)
        modelinfos.symlink_to(MODELINFO_CACHE, target_is_directory=True)
    env.update(
        TMPDIR=str(tmp),
        VLLM_CACHE_ROOT=str(workdir / "vllm-cache"),
        TORCHINDUCTOR_CACHE_DIR=str(workdir / "inductor-cache"),
        HF_HOME=str(workdir / "hf-home"),
        HF_HUB_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    return env


def vllm_command() -> list[str]:
    exe = Path(sys.executable).parent / "vllm"
    return [str(exe)] if exe.exists() else [shutil.which("vllm") or "vllm"]


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_healthy(self, timeout: float = 420.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vllm serve not healthy after {timeout:.0f}s:\n{self.log()[-4000:]}")

    def complete(self, prompt: str, max_tokens: int = 16) -> dict:
        body = json.dumps(
            {"model": self.model_name(), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        ).encode()
        req = urllib.request.Request(
            self.base_url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
        """POST ``body`` as JSON; (status, JSON reply), also for an HTTP error status."""
        req = urllib.request.Request(
            self.base_url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def rpc(self, method: str, *args: str) -> list:
        """A worker method through vLLM's ``/collective_rpc`` (needs ``VLLM_SERVER_DEV_MODE=1``)."""
        status, reply = self.post("/collective_rpc", {"method": method, "args": list(args)}, timeout=300)
        if status != 200:
            raise RuntimeError(f"collective_rpc {method}: HTTP {status}: {reply}")
        return reply.get("results", [])

    def model_name(self) -> str:
        with urllib.request.urlopen(self.base_url + "/v1/models", timeout=30) as r:
            return json.loads(r.read())["data"][0]["id"]

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        return self.proc.returncode


def start_server(
    model_dir: Path,
    workdir: Path,
    *extra_args: str,
    port: int | None = None,
    env: dict | None = None,
    eager: bool = True,
) -> Server:
    """``vllm serve MODEL_DIR --host 127.0.0.1 ...`` in its own process group, logging to a file;
    ``env``: variables on top of :func:`cpu_env`; ``eager=False`` keeps vLLM's default
    torch.compile and CUDA graphs."""
    port = port or free_port()
    log_path = workdir / f"vllm-serve-{port}.log"
    cmd = [
        *vllm_command(),
        "serve",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "512",
        *(["--enforce-eager"] if eager else []),
        *extra_args,
    ]
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**cpu_env(workdir), **(env or {})},
            start_new_session=True,
        )
    return Server(proc=proc, port=port, log_path=log_path)


def serve(
    model_dir: Path,
    workdir: Path,
    *extra_args: str,
    timeout: float = 420.0,
    env: dict | None = None,
    eager: bool = True,
) -> Server:
    """:func:`start_server` on a free port and wait until it is healthy. A port is free when picked
    and taken when vLLM binds it, seconds later: if another process took it meanwhile, start again
    on another (three tries)."""
    for attempt in range(3):
        server = start_server(model_dir, workdir, *extra_args, env=env, eager=eager)
        try:
            server.wait_healthy(timeout)
            return server
        except RuntimeError:
            server.stop()
            if attempt == 2 or "Address already in use" not in server.log():
                raise
    raise AssertionError("unreachable")


def precision_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "vllm-router-ext: router precision" in line]
