"""Job outputs: atomic writes, leftover clean-up, resume-safe seeds and fault-injection points.

Every file or folder a job writes goes through `atomic_path`: the content is written to a temp name
in the same folder (`.NAME.<pid>.partial`) and moved into place with `os.replace`, so a reader (or a
resumed job) sees the old file or the whole new one, never half of one. A job killed mid-write
leaves its temp behind; `clean_partials` (called when a stage starts) removes the temps of writers
that are no longer alive. Formats and versions stay in each artifact's own metadata (quant_config,
drafter_config, feature shards' `format`).

`fault_point(name)` lets tests really kill a job: with `POLYBASIC_KILL_AT=<name>[:<n>]` in the
environment the process sends itself SIGKILL at the n-th (default first) hit of that point.
Points: `calibrate.block` (a block's state saved), `train.checkpoint` (last.ckpt written),
`distill.samples_shard` (a shard of generated samples saved), `write` (any atomic write, temp file
complete, before the rename) and `write/<file name>` (the same for one file name).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

KILL_ENV = "POLYBASIC_KILL_AT"
SUFFIX = ".partial"

_kill_at: tuple[str, int] | None | bool = False  # False: env not read yet
_hits: Counter = Counter()


def partial_path(path: str | Path) -> Path:
    """The temp name `atomic_path` writes `path` under: `.NAME.<pid>.partial` in the same folder."""
    p = Path(path)
    return p.with_name(f".{p.name}.{os.getpid()}{SUFFIX}")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temp path next to `path`; write the file (or create the folder) there. On success
    it is renamed to `path` (a folder only if `path` does not exist yet: another process that
    finished first wins); on any error the temp is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_path(path)
    _remove(tmp)
    try:
        yield tmp
        if tmp.is_file():  # some writers (safetensors) create 0600 files; give the umask's usual mode
            os.chmod(tmp, 0o666 & ~_umask())
        fault_point("write")
        fault_point(f"write/{path.name}")
        try:
            os.replace(tmp, path)
        except OSError:
            if not (tmp.is_dir() and path.is_dir()):
                raise
            _remove(tmp)  # a folder written by a concurrent process is already in place
    except BaseException:
        _remove(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: str | Path, obj, **kw) -> None:
    write_text(path, json.dumps(obj, **kw))


def save_safetensors(path: str | Path, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)


def torch_save(path: str | Path, obj) -> None:
    import torch

    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def clean_partials(folder: str | Path, recursive: bool = True) -> list[Path]:
    """Remove the temps (`.NAME.<pid>.partial`, in folder or anywhere under it) left by writers that
    are no longer running, e.g. a killed job; returns what was removed."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed = []
    for p in sorted((folder.rglob if recursive else folder.glob)(f".*{SUFFIX}")):
        pid = p.name[:-len(SUFFIX)].rpartition(".")[2]
        if pid.isdigit() and not _alive(int(pid)):
            _remove(p)
            removed.append(p)
    return removed


def announce(msg: str) -> None:
    """One line about what a resumed job reused or cleaned up (stdout, flushed)."""
    print(msg, flush=True)


def clean_and_announce(folder: str | Path) -> None:
    """`clean_partials` on a stage's output folder, saying what it removed."""
    removed = clean_partials(folder)
    if removed:
        announce(f"removed {len(removed)} temp file(s) of an interrupted run: "
                 + ", ".join(str(p) for p in removed))


def seed_for(seed: int, *index: int) -> int:
    """A seed for one unit of work (a block, an epoch, a batch) that depends only on (seed, index):
    a resumed job that skips finished units draws the same numbers in the units it runs."""
    digest = hashlib.sha256(repr((int(seed), *map(int, index))).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _target() -> tuple[str, int] | None:
    global _kill_at
    if _kill_at is False:  # read the environment once
        spec = os.environ.get(KILL_ENV, "")
        name, _, n = spec.rpartition(":")
        if not n.isdigit():
            name, n = spec, "1"
        _kill_at = (name, int(n)) if name else None
    return _kill_at


def fault_point(name: str) -> None:
    """SIGKILL this process at the n-th hit of `name` when POLYBASIC_KILL_AT=<name>[:<n>] (tests)."""
    target = _target()
    if target is None or target[0] != name:
        return
    _hits[name] += 1
    if _hits[name] == target[1]:
        os.kill(os.getpid(), signal.SIGKILL)


__all__ = ["atomic_path", "partial_path", "write_text", "write_json", "save_safetensors", "torch_save",
           "clean_partials", "clean_and_announce", "announce", "seed_for", "fault_point", "KILL_ENV"]
