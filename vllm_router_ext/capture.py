"""Record what a served model's router gates really see, for ``vllm-router-audit``.

Opt in with ``--router-capture DIR`` (or ``additional_config["router_capture_dir"]``, or
``VLLM_ROUTER_CAPTURE_DIR``) and a token budget ``--router-capture-tokens N`` (same keys with
``_tokens``; default :data:`DEFAULT_TOKENS`). Each gate the plugin owns keeps the first N rows of
its input and of the fp32 logits our op produced, from forward passes of scheduled requests
(vLLM's warm-up, profiling and data-parallel padding passes carry no attention metadata and are
skipped), in one file per engine core:

    DIR/router-capture-<run>-dp<rank>.safetensors   keys layers.<i> [rows, hidden] (model dtype),
                                                      logits.<i> [rows, experts] (float32)
    DIR/router-capture-<run>-dp<rank>.json           model, precision, vLLM version, rows per
                                                      layer, whether the budget was reached

Rows reach the file as they arrive: it is laid out for the whole budget when the model is built
and each gate's rows are written in place, and the JSON's row counts are brought up to date after
every forward pass. So any end keeps what was recorded, a stop signal (which vLLM answers by
killing its workers at once) or a crash (SIGKILL, out of memory) too, less at most the pass in
flight. Whoever ends cleanly (the worker at the budget, a garbage-collected model, the process
that started the engine when it exits) trims the file to the rows held and logs it; a file left
untrimmed still reads right, the JSON saying how many rows count.

``<run>`` is one more than the highest run already in DIR (nothing is overwritten); ``dp<rank>``
is the engine core's data-parallel rank. Tensor-parallel ranks hold the same replicated gate
inputs, so only TP rank 0 records and writes. Speculative-decoding drafts are not recorded.
The budget's bytes are computed when the model is built and refused above a limit
(:data:`MEMORY_SHARE` of the host's memory unless set: the audit and the trim read a capture
whole) or above the directory's free disk. The capture runs Python in the gate's forward: it needs
eager mode (``--enforce-eager``). A failed write (a full disk) stops the capture, not serving: one
line says so, the JSON (rewritten in place, needing no new space) names the reason, and the rows of
the last finished pass stay readable. Captures are read with plain reads, never a memory map, so
a full or truncated file is an error message, never a bus error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import shutil
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from csrc_triton import environment
from vllm_router_ext.settings import CHECKED

# Under "vllm." so that, inside vLLM, its handlers and format apply.
logger = logging.getLogger(f"vllm.{__name__}")

DIR_KEY = "router_capture_dir"
TOKENS_KEY = "router_capture_tokens"
MEMORY_LIMIT_KEY = "router_capture_memory_limit_gib"
CLI_DIR_KEY = "router_capture_dir_cli"
CLI_TOKENS_KEY = "router_capture_tokens_cli"
CLI_MEMORY_LIMIT_KEY = "router_capture_memory_limit_gib_cli"
DIR_ENV = environment.CAPTURE_DIR
TOKENS_ENV = environment.CAPTURE_TOKENS
MEMORY_LIMIT_ENV = environment.CAPTURE_MEMORY_LIMIT
DEFAULT_TOKENS = 4096
MEMORY_SHARE = 0.25  # of the host's physical memory, when no limit is set
BUDGET_REACHED = "budget reached"
STOPPED = "the model or its process ended before the budget was reached"
ENGINE_STOPPED = "the engine stopped before the budget was reached"
_GiB = 1 << 30
_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
_BY_NAME = {name: dtype for dtype, name in _DTYPES.items()}
#: The status JSON is padded to whole blocks of this size (JSON allows trailing blanks), so a
#: rewrite in place after a failed write fits the blocks it already has on a full disk.
_STATUS_BLOCK = 4096
FILE_RE = re.compile(r"^(router-capture-(\d+)-dp\d+)\.(?:safetensors|json)$")
#: The decoder layer of a router, under any family's names (``model.layers.N.mlp.gate``,
#: ``...block_sparse_moe.gate``, ``...feed_forward.router``, DBRX's ``transformer.blocks.N...``).
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|blocks)\.(\d+)\.")


class CaptureError(ValueError):
    """A capture setting that cannot work; the message names the value and what is allowed."""


def parse_tokens(value: Any, source: str) -> int:
    try:
        tokens = int(str(value).strip())
    except ValueError:
        tokens = 0
    if tokens <= 0:
        raise CaptureError(
            f"invalid router capture budget {value!r} from {source}; allowed: a positive integer"
        )
    return tokens


def parse_gib(value: Any, source: str) -> float:
    try:
        gib = float(str(value).strip())
    except ValueError:
        gib = 0.0
    if not 0 < gib < float("inf"):
        raise CaptureError(
            f"invalid router capture memory limit {value!r} from {source}; allowed: a positive number of GiB"
        )
    return gib


#: Captured activations are user traffic: the directory the plugin creates and every file it
#: writes are its owner's alone, and no write follows a symbolic link or reuses a file.
DIR_MODE = 0o700
FILE_MODE = 0o600
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def check_directory(value: Any, source: str) -> Path:
    """``value`` as a directory this process can create and write into, else :class:`CaptureError`.
    A symbolic link is refused (its target is named: pass that); a directory created here is 0700."""
    path = Path(str(value)).expanduser()
    if path.is_symlink():
        raise CaptureError(
            f"router capture directory {str(path)!r} from {source} is a symbolic link (to "
            f"{os.path.realpath(path)!r}); pass the real directory"
        )
    try:
        path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        if not path.is_dir():
            raise NotADirectoryError(f"{str(path)!r} is not a directory")
        probe = path / f".router-capture-write-test-{os.getpid()}-{os.urandom(4).hex()}"
        os.close(create_private(probe))
        probe.unlink()
    except OSError as e:
        raise CaptureError(
            f"router capture directory {str(path)!r} from {source} is not writable: {e}"
        ) from e
    return path


def create_private(path: Path) -> int:
    """A new file at ``path``, readable and writable by its owner only, opened for writing: never
    an existing file, never through a symbolic link (``FileExistsError`` / ``OSError`` instead)."""
    return os.open(path, _NEW_FILE, FILE_MODE)


def _private_temporary(path: Path) -> Path:
    """A new owner-only file beside ``path`` (a fresh random name), to be renamed over it."""
    while True:
        tmp = path.with_name(f".{path.name}.{os.urandom(6).hex()}.tmp")
        try:
            os.close(create_private(tmp))
            return tmp
        except FileExistsError:
            continue


def next_run(directory: Path) -> int:
    """One more than the highest capture run in ``directory`` (1 in an empty one)."""
    runs = [int(m.group(2)) for p in directory.iterdir() if (m := FILE_RE.match(p.name))]
    return max(runs, default=0) + 1


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class CaptureSettings:
    directory: Path
    tokens: int
    source: str
    memory_limit_gib: float | None = None  # None: MEMORY_SHARE of the host's memory
    memory_limit_source: str | None = None
    tokens_source: str | None = None  # None: the default budget

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "directory": str(self.directory)}

    @classmethod
    def from_json(cls, value: dict) -> CaptureSettings:
        return cls(**{**value, "directory": Path(value["directory"])})


def resolve_capture(additional_config: dict, env: dict[str, str] | None = None) -> CaptureSettings | None:
    """The capture request from its sources (command line, ``additional_config``, environment:
    for each setting the first one set wins, as for the precision); None when none asks for one.
    Where the settings were checked where the engine started, those (they travel with it)."""
    checked = additional_config.get(CHECKED)
    if isinstance(checked, dict) and "capture" in checked:
        return None if checked["capture"] is None else CaptureSettings.from_json(checked["capture"])
    env = environment.capture() if env is None else env

    def first(cli_key: str, flag: str, key: str, env_name: str) -> tuple[Any, str]:
        for value, source in (
            (additional_config.get(cli_key), flag),
            (additional_config.get(key), f"additional_config[{key!r}]"),
            (env.get(env_name), f"environment variable {env_name}"),
        ):
            if value not in (None, ""):
                return value, source
        return None, ""

    directory, source = first(CLI_DIR_KEY, "--router-capture", DIR_KEY, DIR_ENV)
    if directory is None:
        return None
    tokens, tokens_source = first(CLI_TOKENS_KEY, "--router-capture-tokens", TOKENS_KEY, TOKENS_ENV)
    limit, limit_source = first(
        CLI_MEMORY_LIMIT_KEY, "--router-capture-memory-limit", MEMORY_LIMIT_KEY, MEMORY_LIMIT_ENV
    )
    return CaptureSettings(
        directory=check_directory(directory, source),
        tokens=DEFAULT_TOKENS if tokens is None else parse_tokens(tokens, tokens_source),
        source=source,
        memory_limit_gib=None if limit is None else parse_gib(limit, limit_source),
        memory_limit_source=limit_source or None,
        tokens_source=tokens_source or None,
    )


@dataclass(frozen=True)
class GateShape:
    layer: int
    hidden: int
    experts: int
    dtype: torch.dtype  # of the gate's input rows

    @property
    def bytes_per_token(self) -> int:
        return self.hidden * self.dtype.itemsize + self.experts * 4


def size_text(nbytes: float) -> str:
    return f"{nbytes / _GiB:.2f} GiB" if nbytes >= _GiB / 10 else f"{nbytes / (1 << 20):.1f} MiB"


def check_budget(settings: CaptureSettings, gates: list[GateShape], *, floor: bool = False) -> int:
    """The bytes the budget needs for ``gates`` (inputs and fp32 logits); :class:`CaptureError`
    naming the budget, the bytes and the limit when above the memory limit or the free disk.
    ``floor``: ``gates`` is one gate standing for a model not built yet (it has at least that)."""
    per_token = sum(g.bytes_per_token for g in gates)
    need = settings.tokens * per_token
    if settings.memory_limit_gib is None:
        host = host_memory_bytes()
        limit, says = int(host * MEMORY_SHARE), f"{MEMORY_SHARE:.0%} of this host's {size_text(host)}"
    else:
        limit, says = int(settings.memory_limit_gib * _GiB), f"from {settings.memory_limit_source}"
    counted = "at least, for one gate" if floor else f"{len(gates)} gate(s)"
    budget = (
        f"router capture budget {settings.tokens} tokens (from {settings.tokens_source or 'the default'}) "
        f"needs {'at least ' if floor else ''}{size_text(need)} "
        f"({counted}, {per_token} bytes per token: inputs and fp32 logits)"
    )
    if need > limit:
        raise CaptureError(
            f"{budget}, above the memory limit of {size_text(limit)} ({says}; the audit reads a capture "
            "whole); lower --router-capture-tokens or raise --router-capture-memory-limit GIB"
        )
    free = shutil.disk_usage(settings.directory).free
    if need > free:
        raise CaptureError(
            f"{budget}, above the {size_text(free)} free in {str(settings.directory)!r}; lower "
            "--router-capture-tokens or capture into a larger disk"
        )
    return need


class GateCapture:
    """One process's capture: the first ``tokens`` rows of each gate's input and logits, written
    in place into a file laid out for the whole budget, the JSON's counts updated every pass."""

    def __init__(self, settings: CaptureSettings, gates: list[GateShape], stem: str, meta: dict) -> None:
        self.settings = settings
        self.path = settings.directory / f"{stem}.safetensors"
        self.meta = meta
        self.gates = {g.layer: g for g in gates}
        self._last = max(self.gates)  # its rows end a forward pass
        self._count: dict[int, int] = dict.fromkeys(self.gates, 0)
        self._written: dict[int, int] = dict(self._count)  # the counts the JSON holds
        self._lock = threading.Lock()
        self.done = False
        self._offsets, header = _layout(gates, settings.tokens)
        self._fd = create_private(self.path)  # a new run's name: nothing to overwrite
        os.write(self._fd, header)
        os.ftruncate(self._fd, self._offsets["end"])  # sparse: disk is used as rows arrive
        self._write_status(complete=False, ended=None)

    def record(self, layer: int, x: torch.Tensor, logits: torch.Tensor) -> None:
        """Write what is still missing of this layer's budget at its place in the file."""
        take = min(x.shape[0], self.settings.tokens - self._count.get(layer, 0))
        if self.done or take <= 0 or not _serving_pass():
            return
        rows_x = x[:take].detach().to("cpu").contiguous()
        rows_logits = logits[:take].detach().float().to("cpu").contiguous()
        with self._lock:
            start = self._count[layer]
            take = min(take, self.settings.tokens - start)
            if self.done or take <= 0:
                return
            rows_x, rows_logits = rows_x[:take], rows_logits[:take]
            try:
                for key, rows in ((f"layers.{layer}", rows_x), (f"logits.{layer}", rows_logits)):
                    row_bytes = rows[0].numel() * rows.element_size()
                    os.pwrite(self._fd, _bytes(rows), self._offsets[key] + start * row_bytes)
            except OSError as e:  # a full disk: the capture stops, serving goes on
                self._stop_on_error(e)
                return
            self._count[layer] = start + take
            if all(c >= self.settings.tokens for c in self._count.values()):
                self._finish(BUDGET_REACHED)
            elif layer == self._last:
                try:
                    self._write_status(complete=False, ended=None)
                except OSError as e:  # no room for the JSON's new copy: the same stop
                    self._stop_on_error(e)

    def close(self, ended: str = STOPPED) -> None:
        """Trim the file to the rows recorded and say so (idempotent): the model or process ends."""
        with self._lock:
            if not self.done:
                self._finish(ended)

    def _status(self, counts: dict[int, int], complete: bool, ended: str | None) -> dict:
        return {
            **self.meta,
            "budget_tokens": self.settings.tokens,
            "layers": sorted(counts),
            "rows_per_layer": {str(layer): n for layer, n in sorted(counts.items())},
            "complete": complete,
            "ended": ended,
            "trimmed": False,
        }

    def _write_status(self, complete: bool, ended: str | None) -> None:
        _atomic_json(
            self.path.with_suffix(".json"), self._status(self._count, complete, ended), _STATUS_BLOCK
        )
        self._written = dict(self._count)

    def _stop_on_error(self, error: OSError) -> None:
        """Stop recording after a failed write; the JSON keeps the last finished pass's counts and
        says why, rewritten in place (a full disk has no room for a new file)."""
        self.done = True
        reason = f"could not write: {error.strerror or error} ({_errno_name(error)})"
        with contextlib.suppress(OSError):
            os.close(self._fd)
        kept = _row_counts(self._written.values())
        try:
            _overwrite_json(self.path.with_suffix(".json"), self._status(self._written, False, reason))
        except OSError as e:
            reason += f"; its JSON could not say so either: {e}"
        logger.error(
            "vllm-router-ext: router capture %s stopped, %s; %s tokens per layer kept (the last finished "
            "pass, untrimmed: vllm-router-audit reads it)", self.path, reason, kept,
        )  # fmt: skip

    def _finish(self, ended: str) -> None:
        self.done = True
        try:
            os.close(self._fd)
            self._write_status(complete=ended == BUDGET_REACHED, ended=ended)
            message = trim_capture(self.path)
        except (OSError, ValueError) as e:  # disk full, directory gone, file cut short: serving goes on
            kept = _row_counts(self._written.values())
            logger.error(
                "vllm-router-ext: could not finish the router capture %s (%s); %s tokens per layer kept, "
                "untrimmed: vllm-router-audit reads it", self.path, e, kept,
            )  # fmt: skip
            return
        logger.info("vllm-router-ext: %s", message)


def _layout(gates: list[GateShape], rows: int) -> tuple[dict[str, int], bytes]:
    """A safetensors header for ``rows`` rows of every gate's input and logits, and each tensor's
    absolute file offset (``end``: the file's size)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    relative, at = {}, 0
    for g in sorted(gates, key=lambda g: g.layer):
        for key, dtype, width in (
            (f"layers.{g.layer}", g.dtype, g.hidden),
            (f"logits.{g.layer}", torch.float32, g.experts),
        ):
            size = rows * width * dtype.itemsize
            header[key] = {"dtype": _DTYPES[dtype], "shape": [rows, width], "data_offsets": [at, at + size]}
            relative[key], at = at, at + size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    offsets = {key: start + off for key, off in relative.items()}
    offsets["end"] = start + at
    return offsets, struct.pack("<Q", len(text)) + text


def _row_counts(counts) -> str:
    """Rows per layer in words: one count, or the distinct ones (``27/28``)."""
    return "/".join(str(n) for n in sorted(set(counts)))


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def _atomic_json(path: Path, value: dict, block: int = 1) -> None:
    """Write then rename: a kill mid-write never leaves a torn JSON (padded with blanks to a
    multiple of ``block`` bytes)."""
    text = json.dumps(value, indent=1)
    text += " " * (-len(text) % block)
    tmp = _private_temporary(path)
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)  # replaces a symbolic link at ``path`` itself, never its target
    finally:
        tmp.unlink(missing_ok=True)


def _overwrite_json(path: Path, value: dict) -> None:
    """Rewrite an existing JSON in place within its size (blanks pad it): needs no new disk space;
    never through a symbolic link."""
    fd = os.open(path, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd).st_size
        text = json.dumps(value, indent=1).encode()
        if len(text) > size:
            raise OSError(f"{path}: the new status ({len(text)} bytes) does not fit its {size} bytes")
        os.pwrite(fd, text + b" " * (size - len(text)), 0)
    finally:
        os.close(fd)


def _errno_name(error: OSError) -> str:
    import errno

    return errno.errorcode.get(error.errno or 0, "error")


def read_tensors(path: Path, rows: dict[str, int] | None = None) -> dict[str, torch.Tensor]:
    """A capture file's tensors, each cut to ``rows[layer]`` rows where given, read with plain
    reads (a memory map of a file on a full disk, or cut short, dies of SIGBUS instead).
    :class:`CaptureError` names a file that is not a capture or is cut short."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise CaptureError(f"{path}: cannot be read: {e}") from None
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 2 <= length <= min(size - 8, 100 << 20):
            raise CaptureError(f"{path}: not a safetensors file (its header length is {length})")
        try:
            header = json.loads(os.pread(fd, length, 8))
        except ValueError as e:
            raise CaptureError(f"{path}: not a safetensors file (its header is not JSON: {e})") from None
        tensors = {}
        for name, spec in header.items():
            if name == "__metadata__":
                continue
            dtype = _BY_NAME.get(spec.get("dtype")) if isinstance(spec, dict) else None
            if dtype is None or len(spec.get("shape", ())) != 2:
                raise CaptureError(f"{path}: tensor {name!r} is not a capture's ({spec})")
            total, width = spec["shape"]
            n = total if rows is None else min(total, rows.get(name.split(".", 1)[-1], total))
            nbytes = n * width * dtype.itemsize
            start = 8 + length + spec["data_offsets"][0]
            data = os.pread(fd, nbytes, start)
            if len(data) != nbytes:
                raise CaptureError(
                    f"{path}: cut short: {name} needs bytes {start}..{start + nbytes}, the file has {size}"
                )
            tensors[name] = (
                torch.frombuffer(bytearray(data), dtype=dtype).reshape(n, width)
                if nbytes
                else torch.empty(n, width, dtype=dtype)  # no rows yet: frombuffer refuses 0 bytes
            )
        return tensors
    finally:
        os.close(fd)


def trim_capture(path: Path, ended: str | None = None) -> str:
    """Rewrite a capture laid out for its whole budget to the rows its JSON counts; what was
    written, in a sentence. ``ended`` sets why it ended where the JSON does not say yet."""
    from safetensors.torch import save_file

    meta_path = path.with_suffix(".json")
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    if ended is not None and meta.get("ended") is None:
        meta["ended"] = ended
    rows = meta["rows_per_layer"]
    if not meta.get("trimmed") and set(rows.values()) != {meta["budget_tokens"]}:
        tensors = read_tensors(path, rows)
        tmp = _private_temporary(path)
        try:
            try:
                save_file(tensors, str(tmp), metadata={"format": "pt"})
            except Exception as e:  # noqa: BLE001 -- safetensors reports a full disk as its own error
                raise OSError(str(e)) from None
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    if not meta.get("trimmed"):
        meta["trimmed"] = True
        _atomic_json(meta_path, meta)
    counts = _row_counts(meta["rows_per_layer"].values())
    state = "complete" if meta["complete"] else f"partial, budget {meta['budget_tokens']}: {meta['ended']}"
    return f"wrote the router capture {path} ({counts} tokens x {len(meta['layers'])} layers, {state})"


def trim_unfinished(directory: Path, first_run: int) -> None:
    """Trim, log and mark ended every capture of run ``first_run`` or later in ``directory`` that
    its worker did not finish (a stop signal ends workers at once); run where the engine started."""
    for meta_path in sorted(directory.glob("router-capture-*-dp*.json")):
        m = FILE_RE.match(meta_path.name)
        if m is None or int(m.group(2)) < first_run:
            continue
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
            if meta.get("trimmed"):
                continue
            logger.info(
                "vllm-router-ext: %s", trim_capture(meta_path.with_suffix(".safetensors"), ENGINE_STOPPED)
            )
        except (OSError, ValueError, KeyError) as e:
            logger.error(
                "vllm-router-ext: could not finish the router capture %s (%s); its rows stay untrimmed "
                "and vllm-router-audit reads them", meta_path.with_suffix(".safetensors"), e,
            )  # fmt: skip


@dataclass(frozen=True)
class CaptureRead:
    tensors: dict[str, torch.Tensor]
    info: dict  # stem, complete, ended, budget_tokens, rows_per_layer


def captures_in(directory: Path) -> list[str]:
    """The capture stems in ``directory`` (one per run and data-parallel rank)."""
    return sorted({m.group(1) for p in directory.iterdir() if (m := FILE_RE.match(p.name))})


def read_capture(directory: Path, stem: str) -> CaptureRead:
    """A capture's rows: trimmed, or still laid out for the budget (a process killed outright;
    its JSON counts the rows of every finished pass). Partial when the budget was not reached."""
    path = directory / f"{stem}.safetensors"
    meta_path = path.with_suffix(".json")
    if not path.is_file():
        raise CaptureError(f"{directory}: capture {stem} has no {path.name}")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8")) if meta_path.is_file() else {}
    except (OSError, ValueError) as e:
        raise CaptureError(f"{meta_path}: not a capture's JSON ({e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("rows_per_layer", {}), dict):
        raise CaptureError(f"{meta_path}: not a capture's JSON (no rows_per_layer object)")
    tensors = read_tensors(path, meta.get("rows_per_layer") or None)
    ended = meta.get("ended")
    if meta and ended is None:
        ended = "interrupted: the process was killed; rows of its last finished pass kept"
    info = {
        "stem": stem,
        "model": meta.get("model"),
        "architecture": meta.get("architecture"),
        "complete": bool(meta.get("complete", True)),
        "ended": ended,
        "budget_tokens": meta.get("budget_tokens"),
        "rows_per_layer": {
            n.split(".")[1]: t.shape[0] for n, t in tensors.items() if n.startswith("layers.")
        },
    }
    return CaptureRead(tensors, info)


def describe_capture(info: dict) -> str:
    """One line on where the rows came from, and whether the capture is partial."""
    rows = _row_counts(info["rows_per_layer"].values())
    if info["complete"]:
        return f"capture {info['stem']}: complete, {rows} tokens per layer"
    budget = f" of a {info['budget_tokens']}-token budget" if info.get("budget_tokens") else ""
    return f"capture {info['stem']}: PARTIAL, {rows} tokens per layer{budget} ({info['ended']})"


def layer_index(gate_prefix: str) -> int:
    m = _LAYER_RE.search(gate_prefix)
    if m is None:
        raise CaptureError(f"cannot tell the layer of gate {gate_prefix!r}")
    return int(m.group(1))


_STEP = threading.local()  # .on: inside a model runner's execute_model for scheduled requests
_STEP_MARK = "_vllm_router_ext_step_tracking"
#: vLLM's model runners: V1 (the CPU platform's, and CUDA's when asked) and V2 (CUDA's default).
RUNNERS = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner")


def _scheduled_requests(scheduler_output: Any) -> bool:
    """Whether a step runs requests a client sent: vLLM names its warm-up requests ``_warmup...``."""
    ids = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    return any(not str(req_id).startswith("_") for req_id in ids)


def track_scheduled_steps() -> bool:
    """Mark the forward passes vLLM's model runners run for scheduled requests (``execute_model``
    of a client's requests): warm-up, profiling and autotune passes run outside it, as dummy runs
    or with warm-up requests, some with attention metadata. Idempotent; False where no runner can
    be found (attention metadata decides then)."""
    import importlib

    found = False
    for module_name in RUNNERS:
        try:
            runner = importlib.import_module(module_name).GPUModelRunner
        except (ImportError, AttributeError):
            continue
        found = True
        original = runner.execute_model
        if getattr(original, _STEP_MARK, False):
            continue

        def execute_model(self, scheduler_output=None, *args, _original=original, **kwargs):
            outer = getattr(_STEP, "on", None)
            _STEP.on = not kwargs.get("dummy_run", False) and _scheduled_requests(scheduler_output)
            try:
                return _original(self, scheduler_output, *args, **kwargs)
            finally:
                _STEP.on = outer

        functools.update_wrapper(execute_model, original)
        setattr(execute_model, _STEP_MARK, True)
        runner.execute_model = execute_model
    return found


def _serving_pass() -> bool:
    """Whether this forward pass runs scheduled requests: inside a runner's ``execute_model`` for
    them (once tracked) and with attention metadata (data-parallel padding passes run without)."""
    try:
        from vllm.forward_context import get_forward_context, is_forward_context_available
    except ImportError:
        return True
    step = getattr(_STEP, "on", None)
    if step is False or (step is None and _tracking()):
        return False
    return is_forward_context_available() and get_forward_context().attn_metadata is not None


def _tracking() -> bool:
    import sys

    return any(
        getattr(getattr(sys.modules.get(m), "GPUModelRunner", None), "execute_model", None) is not None
        and getattr(sys.modules[m].GPUModelRunner.execute_model, _STEP_MARK, False)
        for m in RUNNERS
        if m in sys.modules
    )
