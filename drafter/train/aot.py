"""The train step's compiled pieces saved whole and loaded back, without dynamo.

A train whose graphs are all in Inductor's cache (drafter/train/precompile.py fills it beside
extract) still spent seconds of its first step compiling: dynamo traced each
piece's Python again, and AOTAutograd and Inductor then found their work on disk. torch's
ahead-of-time compile (`torch.compile(fn, fullgraph=True).aot_compile(example inputs)`,
experimental in torch) saves the whole result, dynamo's guards and bytecode with the forward
and backward kernels, and `torch.compiler.load_compiled_function` reads it back: no tracing at
all, and a shorter warm-up than one traced from a warm cache (BENCHMARKS.md, Training).

A `Piece` stands where TTT called a torch.compile'd function (the layer's pre and post pieces,
the loss chunk's statistics). Its first call in a process describes its arguments
(`signature`: shapes (the loss chunk's rows left out), strides, dtypes, grad mode, autocast, the
modules the function reads and their parameters, the torch and Python versions, the device's
compute capability and the source of drafter/train/model.py, ttt.py, merge.py and losses.py)
and:

- mode "save" (the precompile process): compiles the function ahead of time for these
  arguments and saves it as `<Inductor's cache dir>/drafter-aot/<name>-<signature>.bin`;
- mode "load" (train): loads that file when it exists.

Every later call goes to the loaded function; a call whose arguments its guards refuse (a shape
it was not compiled for) runs the ordinary torch.compile'd function instead, and so does every
call when no file exists, when the save or the load fails or the loaded function fails at its
first call (a torch without the API, a changed format, kernels this GPU cannot run: logged
once) and in mode "off". The pieces are pure functions of their arguments, so running one again
after a failed call is safe. The files are pickles, read as Inductor's own cache is (it runs
the code it finds in the same directory): only the user's own runs write there. What each
piece did is in `report()` (train's manifest: `warmup_compile.saved`)."""
from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch._dynamo

log = logging.getLogger("drafter")

MODES = ("off", "load", "save")
_REPORT: list[dict] = []  # what each piece's first call did in this process, in order
_SOURCES = ("model.py", "ttt.py", "merge.py", "losses.py")


def inductor_cache_dir() -> str:
    """Inductor's on-disk cache (TORCHINDUCTOR_CACHE_DIR, default /tmp/torchinductor_$USER)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        return cache_dir()
    except (ImportError, AttributeError):  # pragma: no cover - older torch
        return os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")


def share_triton_cache(index: int) -> None:
    """drafter's own Triton kernels (the merge, drafter/train/merge.py) compiled into the cache
    Inductor compiles its kernels into: TRITON_CACHE_DIR when set, else `<Inductor's
    cache>/triton/<device index>`, which Inductor itself puts into TRITON_CACHE_DIR, for the rest
    of the process, only when it sets up a kernel's autotuner there. The precompile process,
    compiling, had it set before the merge's first launch; a train loading its graphs did not,
    and compiled the merge again into Triton's default ~/.triton/cache (in the first step of the
    first train after an extract; later trains found it there). Set by
    trainer.device_setup on a GPU, in train and precompile alike; a TRITON_CACHE_DIR already set
    is left as it is."""
    if os.environ.get("TRITON_CACHE_DIR") is not None:
        return
    try:
        from torch._inductor.runtime.cache_dir_utils import triton_cache_dir
    except ImportError:  # pragma: no cover - older torch: Triton's own default
        return
    os.environ["TRITON_CACHE_DIR"] = triton_cache_dir(index)


def directory() -> Path:
    """Where the saved pieces live: beside Inductor's own cache (TORCHINDUCTOR_CACHE_DIR,
    default /tmp/torchinductor_$USER), so that one variable moves or clears both."""
    return Path(inductor_cache_dir() or "/tmp/torchinductor") / "drafter-aot"


@functools.cache
def _source_hash() -> str:
    h = hashlib.sha256()
    for name in _SOURCES:
        h.update((Path(__file__).parent / name).read_bytes())
    return h.hexdigest()[:16]


def _describe(x: Any, rows: bool = False) -> Any:
    """A value as the compiled function sees it: a tensor by its metadata (with `rows`, its
    dim 0 left out: the loss chunk's rows, dynamic), containers item by item, the rest by
    repr."""
    if isinstance(x, torch.Tensor):
        dyn = {0} if rows else set()
        return ("T", str(x.dtype), x.device.type, x.requires_grad,
                tuple(None if i in dyn else s for i, s in enumerate(x.shape)),
                tuple(None if i in dyn else s for i, s in enumerate(x.stride())))
    if isinstance(x, dict):
        return ("D", tuple((k, _describe(v)) for k, v in sorted(x.items())))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_describe(v, rows) for v in x))
    return repr(x)


def signature(name: str, args: tuple, modules: dict[str, torch.nn.Module],
              rows: bool = False) -> str:
    """A key for `name` called on `args`, reading `modules`: equal keys, the same compiled
    function (module docstring). rows: the tensors' dim 0 is dynamic, not in the key."""
    dev = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    cap = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
    parts = [name, torch.__version__, sys.version_info[:2], cap, _source_hash(),
             torch.is_grad_enabled(), torch.is_autocast_enabled(dev.type),
             str(torch.get_autocast_dtype(dev.type)), _describe(args, rows),
             tuple((k, type(m).__name__, tuple((n, _describe(p)) for n, p in
                                                m.named_parameters()))
                   for k, m in sorted(modules.items()))]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def _aot_enabled():
    """torch 2.11 offers `aot_compile` only under dynamo's enable_aot_compile (a default since)."""
    if hasattr(torch._dynamo.config, "enable_aot_compile"):
        return torch._dynamo.config.patch(enable_aot_compile=True)
    return contextlib.nullcontext()


def report() -> list[dict]:
    """What each piece's first call did in this process: {"graph", "mode", "result": saved,
    loaded, missing (no file: compiled as usual) or failed, "seconds", "error" when failed,
    "fallback_calls": calls its guards refused so far}."""
    return [dict(r) for r in _REPORT]


class Piece:
    """`fn` compiled: loaded or saved whole (module docstring), else `jit` (torch.compile(fn)).
    `modules`: the modules fn reads (its closure's), passed by name to the save and the load.
    dynamic_rows: dim 0 of every tensor argument varies from call to call (the loss chunk's
    rows): saved with it dynamic, and out of the key. The saved function is called with the
    tensors as they come: unmarked (losses._rows_dynamic; `jit` marks them itself)."""

    def __init__(self, name: str, fn: Callable, jit: Callable, modules: dict, mode: str,
                 dynamic_rows: bool = False):
        if mode not in MODES:
            raise ValueError(f"saved graphs mode must be one of {MODES}, got {mode!r}")
        self.name, self.fn, self.jit, self.modules, self.mode = name, fn, jit, modules, mode
        self.rows = dynamic_rows
        self.aot: Callable | None = None
        self.entry: dict | None = None

    def __call__(self, *args):
        if self.entry is None and self.mode != "off":
            self._first(args)
            if self.aot is not None:  # a file that loads but does not run here: compile as usual
                try:
                    return self._aot(args)
                except Exception as e:  # noqa: BLE001 - pure functions: run again below
                    self._failed(e, "its first call")
        if self.aot is not None:
            return self._aot(args)
        return self.jit(*args)

    def _aot(self, args: tuple):
        try:
            return self.aot(*args)
        except RuntimeError as e:  # the guards run before any work: nothing has happened
            if not self._refused(e, args):
                raise
            self.entry["fallback_calls"] += 1
            return self.jit(*args)

    def _refused(self, e: RuntimeError, args: tuple) -> bool:
        """Whether the saved function's guards refused `args` (rather than its code failing)."""
        check = getattr(self.aot, "guard_check", None)
        if check is not None:
            try:
                return not check(*args)
            except Exception:  # noqa: BLE001 - another torch's internals: read the message
                pass
        return str(e).startswith("GuardManager check failed")

    def _failed(self, e: Exception, when: str) -> None:
        self.aot = None
        self.entry.update(result="failed", error=f"{type(e).__name__}: {e}"[:500])
        log.warning("saved graphs: %s %s failed at %s, compiling it as usual (%s)", self.mode,
                    self.name, when, self.entry["error"][:200])

    def _first(self, args: tuple) -> None:
        t0 = time.perf_counter()
        sig = signature(self.name, args, self.modules, self.rows)
        path = directory() / f"{self.name}-{sig}.bin"
        self.entry = {"graph": self.name, "mode": self.mode, "file": path.name,
                      "fallback_calls": 0}
        _REPORT.append(self.entry)
        try:
            if self.mode == "save":
                if self.rows:  # marked aliases: the caller's tensors stay unmarked
                    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
                    for a in args:
                        if isinstance(a, torch.Tensor):
                            torch._dynamo.maybe_mark_dynamic(a, 0)
                with _aot_enabled():
                    c = torch.compile(self.fn, fullgraph=True, dynamic=False).aot_compile(
                        (args, {}))
                path.parent.mkdir(parents=True, exist_ok=True)
                c.save_compiled_function(str(path), external_data=self.modules)
                self.aot, self.entry["result"] = c, "saved"
            elif path.is_file():
                with open(path, "rb") as f:
                    self.aot = torch.compiler.load_compiled_function(
                        f, external_data=self.modules)
                self.entry["result"] = "loaded"
            else:
                self.entry["result"] = "missing"
        except Exception as e:  # noqa: BLE001 - an experimental torch API: compile as usual
            self._failed(e, "the " + self.mode)
        self.entry["seconds"] = round(time.perf_counter() - t0, 3)
