"""config="auto"'s disk store: what was measured and learned, kept for later calls and processes.

The store is a hint, never a dependency: every entry read is validated (`valid_entry`), what
is invalid is dropped with one warning and the file rewritten without it, and a store that
cannot be read or written only costs a re-measurement. Writers merge under an exclusive lock
on a lock file beside it, re-reading the file inside the lock, so concurrent processes keep
every entry (and pooled counts add up); each write goes to its own temp file, renamed over
the store, and removed when the rename fails.

A `Store` object keeps what its process read or wrote, by store path (no file read per call),
and the warnings it gave; an `AutoTuner` owns one.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import uuid
import warnings
from pathlib import Path
from typing import Callable, Optional

try:
    import fcntl
except ImportError:  # Windows: no advisory locks
    fcntl = None

SECTIONS = ("latency", "agreement", "realised", "device", "timing", "choice", "anchor", "depth",
            "rounds", "free", "compiled")
# Depths of a draft chain the store counts acceptance at (the "depth" section's bound)
MAX_DEPTH = 64


def cache_path() -> Path:
    """$OUROBOROS_JAX_CACHE/auto.json, else ~/.cache/ouroboros_jax/auto.json."""
    root = os.environ.get("OUROBOROS_JAX_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "ouroboros_jax")
    return Path(root) / "auto.json"


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def valid_entry(section: str, value) -> bool:
    """Whether one stored value can be used: latency {"n": seconds} with n >= 1 and finite
    seconds > 0; agreement [agreeing, positions] counts with agreeing <= positions; realised
    [sum of per-round agreements, rounds] with 0 <= sum <= rounds; device {"bandwidth",
    "flops"} finite and > 0; timing five finite sums (the two squares >= 0) and a count of
    calls; choice {"method": name, "config": {field: int or bool} or None}; anchor a finite
    ratio > 0; depth 1 to MAX_DEPTH [reached, accepted] counts with accepted <= reached;
    rounds three finite sums >= 0 and a count of calls; free 1 to MAX_DEPTH [rounds, tokens
    kept] counts (Ouroboros' free proposals by match length, `Agreement.record_free`);
    compiled a choice's {"method", "config"} with the finite "seconds" >= 0 its loop's compile
    took (`compiles.CompiledLoops`)."""
    if section == "compiled":
        return (isinstance(value, dict) and set(value) == {"method", "config", "seconds"}
                and _number(value["seconds"]) and value["seconds"] >= 0
                and valid_entry("choice", {"method": value["method"],
                                           "config": value["config"]}))
    if section == "device":
        return (isinstance(value, dict) and set(value) == {"bandwidth", "flops"}
                and all(_number(v) and v > 0 for v in value.values()))
    if section == "anchor":
        return _number(value) and value > 0
    if section == "depth":
        return (isinstance(value, list) and 1 <= len(value) <= MAX_DEPTH and all(
            isinstance(d, list) and len(d) == 2 and _count(d[0]) and _count(d[1])
            and d[1] <= d[0] for d in value))
    if section == "free":
        return (isinstance(value, list) and 1 <= len(value) <= MAX_DEPTH and all(
            isinstance(d, list) and len(d) == 2 and _count(d[0]) and _count(d[1])
            for d in value))
    if section == "rounds":
        return (isinstance(value, list) and len(value) == 4
                and all(_number(v) and v >= 0 for v in value[:3]) and _count(value[3]))
    if section == "timing":
        return (isinstance(value, list) and len(value) == 6 and all(_number(v) for v in value[:5])
                and value[0] >= 0 and value[2] >= 0 and _count(value[5]))
    if section == "choice":
        cfg = value.get("config", 0) if isinstance(value, dict) else 0
        return (isinstance(value, dict) and set(value) == {"method", "config"}
                and isinstance(value["method"], str)
                and (cfg is None or (isinstance(cfg, dict) and all(
                    isinstance(k, str) and isinstance(v, (int, bool)) for k, v in cfg.items()))))
    if section == "latency":
        return (isinstance(value, dict) and len(value) > 0
                and all(isinstance(k, str) and k.isdigit() and int(k) >= 1 for k in value)
                and all(_number(v) and v > 0 for v in value.values()))
    if not isinstance(value, list) or len(value) != 2:
        return False
    s, n = value
    if section == "agreement":
        return _count(s) and _count(n) and s <= n
    return _number(s) and _count(n) and 0 <= s <= n  # realised


def validated(raw) -> tuple[dict, list[str]]:
    """(the usable part of a parsed store file, descriptions of what was dropped)."""
    if not isinstance(raw, dict):
        return {}, [f"the file holds a JSON {type(raw).__name__}, not an object"]
    data, dropped = {}, []
    for section, entries in raw.items():
        if section not in SECTIONS:
            dropped.append(f"unknown section {section!r}")
            continue
        if not isinstance(entries, dict):
            dropped.append(f"section {section!r} is a {type(entries).__name__}, not an object")
            continue
        good = {k: v for k, v in entries.items() if valid_entry(section, v)}
        if len(good) < len(entries):
            dropped.append(f"{len(entries) - len(good)} invalid {section} entr"
                           f"{'y' if len(entries) - len(good) == 1 else 'ies'}")
        data[section] = good
    return data, dropped


@contextlib.contextmanager
def _locked(p: Path):
    """An exclusive advisory lock (fcntl.flock) on `<store>.lock` beside the store, held while
    a writer re-reads, merges and replaces the file. Where flock does not exist (Windows) the
    writes are still atomic, only concurrent merges may lose an entry."""
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p.with_name(p.name + ".lock"), "a") as f:
        if fcntl is not None:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _replace_atomically(p: Path, text: str) -> None:
    """Writes text to a temp file of its own (unique name: concurrent writers never share one)
    and renames it over p; the temp file is removed whatever fails."""
    tmp = p.with_name(f"{p.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "x") as f:
            f.write(text)
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


class Store:
    """The disk store as one process sees it: the store file at `cache_path()` (read when a
    call asks, so $OUROBOROS_JAX_CACHE may change between calls), its validated contents kept
    in memory per path after the first read, and the (path, what) pairs already warned
    about."""

    def __init__(self):
        self._memo: dict = {}  # str(path) -> the validated contents last read or written
        self._warned: set = set()

    def warn_once(self, path: str, what: str) -> None:
        if (path, what) not in self._warned:
            self._warned.add((path, what))
            warnings.warn(f"config='auto' cache {path}: {what}", RuntimeWarning, stacklevel=3)

    def _load_file(self, p: Path) -> tuple[dict, list[str]]:
        """The validated contents of the store file ({} when absent or unreadable) and what
        was dropped from it."""
        try:
            text = p.read_text()
        except FileNotFoundError:
            return {}, []
        except (OSError, UnicodeDecodeError) as e:
            self.warn_once(str(p), f"cannot be read ({type(e).__name__}: {e}); measuring afresh")
            return {}, []
        try:
            raw = json.loads(text)
        except ValueError:
            return {}, ["the file is not valid JSON"]
        return validated(raw)

    def read(self) -> dict:
        """The store's contents (read from disk once per path)."""
        p = str(cache_path())
        if p not in self._memo:
            data, dropped = self._load_file(Path(p))
            self._memo[p] = data
            if dropped:  # repaired now, so later processes read a valid file
                self.warn_once(p, "ignored and rewrote " + "; ".join(dropped))
                self.update(lambda d: None)
        return self._memo[p]

    def update(self, change: Callable, path: Optional[Path] = None):
        """Applies change(data) -> result to the store's current contents under the lock (the
        file re-read inside it, so other processes' entries are kept) and writes the result
        back; returns change's result. The in-memory copy follows. A store that cannot be
        written (read-only home, a directory in its place) is warned about once and otherwise
        skipped. path: the store file (default: `cache_path()` now)."""
        p = cache_path() if path is None else path
        try:
            with _locked(p):
                data, _ = self._load_file(p)
                result = change(data)
                _replace_atomically(p, json.dumps(data, indent=1, sort_keys=True))
        except OSError as e:
            self.warn_once(str(p), f"cannot be written ({type(e).__name__}: {e}); results are "
                                   "kept for this process only")
            data = self._memo.get(str(p), {})
            result = change(data)
        self._memo[str(p)] = data
        return result

    def put(self, section: str, key: str, value) -> None:
        def change(data):
            data.setdefault(section, {})[key] = value
        self.update(change)

    def add(self, section: str, key: str, counts: tuple, zero: tuple) -> list:
        """Adds counts to the entry (pooled with what every process has added before);
        returns the new total."""
        return self.add_all((section, key, counts, zero))[0]

    def add_all(self, *entries: tuple) -> list:
        """`add` for several (section, key, counts, zero) entries in one locked write; returns
        their new totals."""
        def change(data):
            out = []
            for section, key, counts, zero in entries:
                old = data.setdefault(section, {}).get(key, list(zero))
                out.append([type(z)(o + c) for o, c, z in zip(old, counts, zero)])
                data[section][key] = out[-1]
            return out
        return self.update(change)
