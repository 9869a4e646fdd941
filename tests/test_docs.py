"""Every command the docs show (``$ `` lines in ``console`` blocks) is exercised by a test or CI."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"

#: command prefix -> where it is exercised ("tests/file.py::test" or "CI: ...").
EXERCISED = {
    # GPU tools: their CLIs are tested here; the runs themselves on the H200 (docs/benchmarks.md).
    "python -m vllm_router_ext.bench": "tests/test_cli_tools.py::test_bench_and_tune_help",
    "python benchmarks/tune.py": "tests/test_cli_tools.py::test_bench_and_tune_help",
    "python benchmarks/e2e_serve.py": (
        "tests/test_cli_tools.py::test_e2e_benchmark_summarises_and_renders_a_saved_run"
    ),
    "python benchmarks/render_tables.py": (
        "tests/test_cli_tools.py::test_render_tables_prints_each_shape_with_cublas_and_peer_ratios_and_plots"
    ),
    # The GPU end-to-end suite is the command itself (run on the H200: benchmarks/NOTES.md).
    "pip install pytest && pytest tests/test_gpu_vllm.py": (
        "tests/test_gpu_vllm.py::test_serves_with_defaults_and_names_the_gpu_kernels"
    ),
    "bash scripts/setup_cpu_env.sh": "CI: .ci/run -> scripts/test.sh runs it first",
    "vllm serve --help=vllm-router-ext": "tests/test_vllm_serve.py::test_serve_help_lists_the_flags",
    "vllm-router-audit MODEL_DIR --hidden-states capture/": (
        "tests/test_vllm_serve.py::test_sigterm_writes_the_capture_the_server_holds_then_the_audit_reads_it"
    ),
    "vllm serve MODEL_DIR --enforce-eager --router-capture": (
        "tests/test_vllm_serve.py::test_sigterm_writes_the_capture_the_server_holds_then_the_audit_reads_it"
    ),
    "vllm-router-audit ": "tests/test_audit.py::test_console_script_runs_on_the_tiny_checkpoint",
    "python -m vllm_router_ext.audit ": "tests/test_audit.py::test_cli_on_the_tiny_checkpoint",
    "python -m vllm_router_ext.tools.tiny_checkpoint": "tests/test_cli_tools.py::test_tiny_checkpoint_cli",
    # The warm-up's cache baking: its CLI here; the warm-up itself on the H200 (docs/install.md).
    "TRITON_CACHE_DIR=/opt/triton-cache python -m vllm_router_ext.ops.warmup": (
        "tests/test_warmup.py::test_the_cache_baking_command_refuses_bad_input_in_one_line"
    ),
    "python -m vllm_router_ext.tools.compile_check": (
        "tests/test_kernels_compile.py::test_every_dispatched_kernel_compiles"
    ),
}


def _doc_commands() -> list[tuple[str, str]]:
    found = []
    for page in sorted(DOCS.glob("*.md")):
        for block in re.findall(r"```console\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S):
            found += [(page.name, line[2:].strip()) for line in block.splitlines() if line.startswith("$ ")]
    return found


def test_every_documented_command_is_exercised():
    commands = _doc_commands()
    assert len(commands) >= 5
    for page, cmd in commands:
        assert any(cmd.startswith(prefix) for prefix in EXERCISED), f"{page}: `{cmd}` is not exercised"


def test_the_named_tests_exist():
    root = Path(__file__).resolve().parents[1]
    for where in EXERCISED.values():
        if where.startswith("CI"):
            assert (root / ".ci/run").exists() and "setup_cpu_env.sh" in (root / "scripts/test.sh").read_text(
                encoding="utf-8"
            )
            continue
        path, name = where.split(" ")[0].split("::")
        assert f"def {name}(" in (root / path).read_text(encoding="utf-8"), where


def test_docs_pages_exist_and_link():
    pages = {p.name for p in DOCS.glob("*.md")}
    needed = {
        "index.md",
        "install.md",
        "precision.md",
        "kernels.md",
        "benchmarks.md",
        "determinism.md",
        "audit.md",
        "troubleshooting.md",
    }
    assert needed <= pages
    for page in DOCS.glob("*.md"):
        for target in re.findall(r"\]\(([^)#:]+\.(?:md|png))\)", page.read_text(encoding="utf-8")):
            assert (DOCS / target).exists(), f"{page.name} links to missing {target}"


def test_the_quoted_help_is_the_current_help(monkeypatch):
    """docs/audit.md and docs/benchmarks.md quote each command's ``--help`` (at 100 columns)."""
    from vllm_router_ext import audit, bench

    monkeypatch.setenv("COLUMNS", "100")
    for page, parser in (("audit.md", audit.build_parser()), ("benchmarks.md", bench.build_parser())):
        text = (DOCS / page).read_text(encoding="utf-8")
        assert f"```text\n{parser.format_help().rstrip()}\n```" in text, f"{page}: --help differs"
