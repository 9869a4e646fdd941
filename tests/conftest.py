"""Shared fixtures. GPU tests carry ``@pytest.mark.gpu`` and skip without CUDA; on a CPU machine
the Triton kernels run under ``TRITON_INTERPRET=1`` (set here, before anything imports Triton),
with ``tl.dot`` evaluated in one fixed, host-independent order (``tests/interpreter_dot.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if os.environ.get("ROUTER_EXT_FORCE_GPU") != "1":
    try:
        import torch as _torch

        _HAS_CUDA = _torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        _HAS_CUDA = False
    if not _HAS_CUDA:
        os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    _HAS_CUDA = True

import interpreter_dot  # noqa: E402  (tests/interpreter_dot.py)
import torch  # noqa: E402

HAS_CUDA = _HAS_CUDA
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if INTERPRETING:
    interpreter_dot.install()


def pytest_addoption(parser):
    parser.addoption(
        "--shard",
        default="",
        help="I/N: run only every N-th collected test, starting at I (0-based): N processes, one GPU",
    )


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
    # The compile checks last: their runs, started at collection, then compile beside the whole suite
    # (its tests leave a core idle) instead of being waited for in the middle of it.
    items.sort(key=lambda item: item.path.name == "test_kernels_compile.py")
    if config.getoption("--shard"):
        index, count = (int(v) for v in config.getoption("--shard").split("/"))
        if not 0 <= index < count:
            raise pytest.UsageError(f"--shard {index}/{count}: I must be in 0..N-1")
        config.hook.pytest_deselected(items=[t for i, t in enumerate(items) if i % count != index])
        items[:] = [t for i, t in enumerate(items) if i % count == index]


def pytest_collection_finish(session):
    """The ahead-of-time compile runs (CPU-bound subprocesses, minutes on CI's two cores) start as
    soon as their tests are collected, so they run beside the rest of the suite."""
    if session.config.option.collectonly:
        return
    names = {getattr(item, "originalname", "") for item in session.items}
    factory = session.config._tmp_path_factory
    if "test_every_dispatched_kernel_compiles" in names:
        import test_kernels_compile as aot

        session.config.aot_compile_runs = aot.start_compile_runs(factory)
    if "test_tuned_table_compiles_without_spills_under_the_triton_users_run" in names:
        import test_kernels_compile as aot

        session.config.aot_users_triton_runs = aot.start_users_triton_runs(factory)


def pytest_sessionfinish(session):
    for attr in ("aot_compile_runs", "aot_users_triton_runs"):
        runs = getattr(session.config, attr, None)
        if runs:
            import test_kernels_compile as aot

            aot.stop_runs(runs)


@pytest.fixture(params=interpreter_dot.ORDERS if INTERPRETING else ("gpu-mma",))
def dot_order(request):
    """For bitwise claims between kernel forms: under the interpreter the test runs once per fixed
    ``tl.dot`` order (K ascending, K descending), so a claim holds only if it rests on our order of
    MMA steps, never on how one dot sums inside itself; on a GPU its own MMA decides, once."""
    if INTERPRETING:
        interpreter_dot.install(request.param)
    yield request.param
    if INTERPRETING:
        interpreter_dot.install()


@pytest.fixture
def table_env(monkeypatch):
    """``table_env(value)`` sets VLLM_ROUTER_EXT_TABLE (None: unset) and makes the dispatch re-read
    it; the variable and the cache are restored afterwards."""
    import csrc_triton.tables as c

    def set_table(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(c.TABLE_ENV_VAR, raising=False)
        else:
            monkeypatch.setenv(c.TABLE_ENV_VAR, value)
        c.clear_table_cache()

    yield set_table
    c.clear_table_cache()  # monkeypatch restores the variable after this; it is read lazily


@pytest.fixture
def gen():
    """A fresh, seeded-from-entropy generator per test; the seed is printed on failure."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"random seed: {seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="session")
def vllm_dist(tmp_path_factory):
    """vLLM config + a 1-process gloo group, so vLLM layers can be built in-process (no engine)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm_configs import engine_free_config

    import vllm_router_ext

    vllm_router_ext.register()
    cfg = engine_free_config()
    ctx = set_current_vllm_config(cfg)
    ctx.__enter__()
    init_file = tmp_path_factory.mktemp("dist") / "init"
    init_distributed_environment(
        world_size=1, rank=0, local_rank=0, distributed_init_method=f"file://{init_file}", backend="gloo"
    )
    initialize_model_parallel(1, 1)
    yield cfg
    ctx.__exit__(None, None, None)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from vllm_router_ext.tools.tiny_checkpoint import build_tiny_deepseek_v3

    return build_tiny_deepseek_v3(tmp_path_factory.mktemp("ckpt") / "tiny-dsv3", seed=0)


@pytest.fixture
def run_offline(tmp_path):
    """Run one ``vllm.LLM`` scenario in a subprocess; returns what it saved."""
    from vllm_router_ext.tools.server import cpu_env, omp_threads_bind

    def run(
        model: Path,
        *,
        additional_config=None,
        hf_overrides=None,
        tp=1,
        env=None,
        compile=False,
        speculative_config=None,
        timeout=600,
        load_format="auto",
    ):
        out = tmp_path / f"run-{len(list(tmp_path.glob('run-*')))}.pt"
        e = cpu_env(tmp_path)
        e.pop("TRITON_INTERPRET", None)
        e["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model ships the recorder functions
        if tp > 1:
            e["VLLM_CPU_OMP_THREADS_BIND"] = omp_threads_bind(tp)
        e.update(env or {})
        cmd = [
            sys.executable,
            "-m",
            "vllm_router_ext.tools.offline_run",
            str(model),
            str(out),
            "--additional-config",
            json.dumps(additional_config or {}),
            "--hf-overrides",
            json.dumps(hf_overrides or {}),
            "--tp",
            str(tp),
            *(["--compile"] if compile else []),
            *(["--speculative-config", json.dumps(speculative_config)] if speculative_config else []),
            "--load-format",
            load_format,
        ]
        p = subprocess.run(cmd, env=e, cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
        log = p.stdout + p.stderr
        assert p.returncode == 0, f"offline vLLM run failed ({p.returncode}):\n{log[-6000:]}"
        result = torch.load(out, weights_only=False)
        result["log"] = log
        return result

    return run
