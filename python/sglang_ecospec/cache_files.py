"""The plugin's cache files (the startup calibration's profiles, the gate's memory): their
root, and the pieces their names and keys are made of."""

import hashlib
import importlib.metadata
import json
import os
import re
from pathlib import Path

CACHE_ENV = "SGL_ECOSPEC_CACHE"  # the lab's cache root (the testbed is cached there too)


def cache_root() -> Path:
    """``$SGL_ECOSPEC_CACHE``, default ``~/.cache/sgl-ecospec``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "sgl-ecospec")


def file_digest(path: Path) -> str | None:
    """sha256 of the file's bytes, or None where there is no such file."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def key_digest(key: dict) -> str:
    """A short digest of a JSON-ready key (the part of a file name that tells keys apart)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def slug(text: str) -> str:
    """``text`` as a file-name part: lower-case letters and digits joined by dashes."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:48]


def plugin_version() -> str:
    """The installed sgl-ecospec's version ("source" when run from a source tree)."""
    try:
        return importlib.metadata.version("sgl-ecospec")
    except importlib.metadata.PackageNotFoundError:
        return "source"
