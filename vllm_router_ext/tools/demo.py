"""The main job on one CPU machine: build a tiny DeepSeek-V3, serve it with
``vllm serve --router-precision bf16-fp32out`` on 127.0.0.1, send a completion, print it and the
router-precision log line, stop the server. It ships: it is the README's first command.

    python -m vllm_router_ext.tools.demo [--precision bf16-fp32out] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from vllm_router_ext.precision import RouterPrecision
from vllm_router_ext.tools.server import precision_lines, serve
from vllm_router_ext.tools.tiny_checkpoint import build_tiny_deepseek_v3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--precision", choices=RouterPrecision.choices(), default="bf16-fp32out")
    p.add_argument("--workdir", default=None)
    p.add_argument("--prompt", default="def fibonacci(n):")
    args = p.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="router-ext-demo-"))
    model = build_tiny_deepseek_v3(workdir / "tiny-deepseek-v3")
    print(f"[demo] tiny DeepSeek-V3 checkpoint: {model}")
    print(f"[demo] starting vllm serve (log: {workdir}/vllm-serve-*.log)")
    server = serve(model, workdir, "--router-precision", args.precision)
    print(f"[demo] vllm serve on {server.base_url}")
    try:
        reply = server.complete(args.prompt, max_tokens=16)
        print(f"[demo] prompt: {args.prompt!r}")
        print(f"[demo] completion: {reply['choices'][0]['text']!r}")
        lines = precision_lines(server.log())
        for line in lines:
            print(f"[demo] server log: {line.strip()}")
        if not lines:
            print("[demo] ERROR: no router-precision line in the server log", file=sys.stderr)
            return 1
    finally:
        rc = server.stop()
        print(f"[demo] server stopped (exit code {rc})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
