"""Deterministic corpus of Python source: the interpreter's standard library.

The manifest lists every file used (path relative to its root, size, sha256) in sorted order, and
the split of each file. The held-out split is chosen by a hash of the relative path, so it does
not depend on file contents, file order or the machine: about 2% of files, never trained on.

    python -m ouroboros_jax.training.corpus --out runs/corpus/manifest.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

HELDOUT_PER_MILLE = 20  # ~2% of files
MAX_FILE_BYTES = 512 * 1024  # pydoc_data/topics.py is prose in a string, not code
EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class Entry:
    root: str  # "stdlib" or "site-packages"
    path: str  # relative to the root, "/"-separated
    size: int
    sha256: str
    split: str  # "train" or "heldout"


def split_of(root: str, rel_path: str) -> str:
    h = int(hashlib.sha256(f"{root}/{rel_path}".encode()).hexdigest()[:8], 16)
    return "heldout" if h % 1000 < HELDOUT_PER_MILLE else "train"


def roots(include_site_packages: bool = False) -> dict[str, Path]:
    paths = sysconfig.get_paths()
    out = {"stdlib": Path(paths["stdlib"])}
    if include_site_packages:
        out["site-packages"] = Path(paths["purelib"])
    return out


def _iter_py(root: Path, skip_nested_site: bool):
    for dirpath, dirnames, filenames in os.walk(root):
        # sorted in place so the walk order is deterministic; nested site-packages skipped
        dirnames[:] = sorted(d for d in dirnames if not (d in EXCLUDED_DIRS and (skip_nested_site or d == "__pycache__")))
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath) / name


def build_manifest(include_site_packages: bool = False) -> dict:
    entries: list[Entry] = []
    for root_name, root in roots(include_site_packages).items():
        for p in _iter_py(root, skip_nested_site=(root_name == "stdlib")):
            if p.is_symlink() or not p.is_file():
                continue
            data = p.read_bytes()
            if not data.strip() or len(data) > MAX_FILE_BYTES:
                continue
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:  # a few test fixtures are deliberately latin-1
                continue
            rel = p.relative_to(root).as_posix()
            entries.append(Entry(root_name, rel, len(data), hashlib.sha256(data).hexdigest(), split_of(root_name, rel)))
    entries.sort(key=lambda e: (e.root, e.path))
    body = [e.__dict__ for e in entries]
    return {
        "python": sys.version.split()[0],
        "roots": {k: str(v) for k, v in roots(include_site_packages).items()},
        "heldout_per_mille": HELDOUT_PER_MILLE,
        "max_file_bytes": MAX_FILE_BYTES,
        "num_files": len(entries),
        "num_bytes": sum(e.size for e in entries),
        "files_hash": files_hash(body),
        "files": body,
    }


def files_hash(files: list[dict]) -> str:
    """sha256 over the canonical JSON of the file list: the manifest's identity."""
    return hashlib.sha256(json.dumps(files, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def save_manifest(manifest: dict, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def load_manifest(path: str | Path) -> dict:
    m = json.loads(Path(path).read_text())
    if files_hash(m["files"]) != m["files_hash"]:
        raise ValueError(f"{path}: files_hash does not match its file list")
    return m


def read_texts(manifest: dict, split: str, verify: bool = True) -> list[str]:
    """Texts of one split in manifest order; refuses files whose content changed."""
    out = []
    for f in manifest["files"]:
        if f["split"] != split:
            continue
        data = (Path(manifest["roots"][f["root"]]) / f["path"]).read_bytes()
        if verify and hashlib.sha256(data).hexdigest() != f["sha256"]:
            raise ValueError(f"{f['root']}/{f['path']} differs from the manifest")
        out.append(data.decode("utf-8"))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/corpus/manifest.json")
    ap.add_argument("--site-packages", action="store_true", help="also include installed pure-Python packages")
    a = ap.parse_args(argv)
    m = build_manifest(a.site_packages)
    save_manifest(m, a.out)
    n_held = sum(f["split"] == "heldout" for f in m["files"])
    print(f"{a.out}: {m['num_files']} files ({n_held} held out), {m['num_bytes'] / 1e6:.1f} MB, files_hash {m['files_hash'][:16]}")


if __name__ == "__main__":
    main()
