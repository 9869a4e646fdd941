"""``vllm serve`` of the tiny DeepSeek-V3 under a bounded load on 127.0.0.1 (real vLLM, CPU build):
32 concurrent clients, 256 completions (half streamed), bad requests in the mix. The load stops by
itself: a fixed number of requests, each with a timeout."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from vllm_router_ext.tools.server import Server, precision_lines, serve

pytestmark = pytest.mark.vllm

CLIENTS = 32
COMPLETIONS = 256
PROMPTS = ["def fibonacci(n):", "import os\nimport sys", "for i in range(10):", "class Path:"]
#: Bad requests and the status each must get; the server keeps serving after each.
BAD = {
    "empty prompt": ({"prompt": ""}, 400),
    "max_tokens 0": ({"prompt": "x = 1", "max_tokens": 0}, 400),
    "prompt past max_model_len": ({"prompt": "x = 1\n" * 2000}, 400),
}


def _post(server: Server, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(
        server.base_url + "/v1/completions",
        data=json.dumps({"model": server.model_name(), "temperature": 0, "max_tokens": 4, **body}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _completion(server: Server, i: int) -> tuple[int, str]:
    status, text = _post(server, {"prompt": PROMPTS[i % len(PROMPTS)], "stream": i % 2 == 1})
    if status == 200 and i % 2 == 1:  # a stream: events up to [DONE]
        assert text.rstrip().endswith("data: [DONE]"), text[-200:]
    return status, text


def _tree_rss(pid: int) -> int:
    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])


@pytest.mark.parametrize(
    "flags",
    [("--router-precision", "fp32"), ("--router-precision", "bf16-fp32out", "--router-batch-invariant")],
    ids=["fp32", "bf16-fp32out-batch-invariant"],
)
def test_serve_under_load(tiny_model, tmp_path, flags):
    server = serve(tiny_model, tmp_path, *flags)
    try:
        statuses: list[int] = []
        rss: list[int] = []
        with ThreadPoolExecutor(CLIENTS) as pool:
            for start in range(0, COMPLETIONS, 64):  # in waves, to sample memory between them
                wave = list(pool.map(lambda i: _completion(server, i), range(start, start + 64)))
                statuses += [s for s, _ in wave]
                if start == 64:
                    rss.append(_tree_rss(server.proc.pid))  # after the first ~100 requests
                for name, (body, expected) in BAD.items():
                    status, text = _post(server, body)
                    assert status == expected, (name, status, text[:300])
        rss.append(_tree_rss(server.proc.pid))  # after the last 100
        assert statuses == [200] * COMPLETIONS
        status, _ = _post(server, {"prompt": "def f():"})
        assert status == 200  # still serving
    finally:
        server.stop()
    log = server.log()
    assert len(precision_lines(log)) == 1
    # Until we stop it: after SIGINT vLLM may log its output handler seeing the engine gone.
    serving = log.split("[shutdown]")[0].splitlines()
    errors = [ln for ln in serving if " ERROR " in ln or "Traceback" in ln]
    assert not errors, errors[:5]
    assert rss[1] <= 1.10 * rss[0], f"server RSS grew from {rss[0] / 2**20:.0f} to {rss[1] / 2**20:.0f} MiB"
