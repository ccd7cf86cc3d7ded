"""The tuning database: template parameters per device, op and shape class.

Search order for ``(op, shape class)`` on a device:
  1. run-time overrides (``clops.tuning.override``),
  2. the user file for the device (written by ``clops tune --save``),
  3. the shipped file for the device, then for its vendor, then ``default.json``,
  4. the op's heuristic from the device's limits (the caller's fallback).

Each file is read once per process; :func:`reload` forgets what was read (after editing a
file by hand). Ops memoise their choice until the database changes (:func:`generation`).

Files are JSON: ``{"device": {...identity...}, "entries": {op: {shape_key: params}}}``.
A device's file is named by its normalised name (``nvidia-h200.json``); a
vendor file by the normalised vendor (``nvidia.json``).
"""
from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

from .runtime import device_identity

SHIPPED_DIR = Path(__file__).resolve().parent / "tuning_db"
_overrides = {}
_files = {}  # path -> its entries, read once
_generation = [0]  # bumped by every change ops must see: overrides, saves, reload()
_lock = threading.Lock()


def generation():
    """A count that changes whenever a choice from the database may change (memo keys carry it)."""
    return _generation[0]


def reload():
    """Forget the tuning files read so far (and where ``CLOPS_TUNING_DIR`` pointed); the next op
    call reads them again."""
    with _lock:
        _files.clear()
        _generation[0] += 1


def normalise(name):
    """``NVIDIA H200`` → ``nvidia-h200``: lower case, runs of other characters become one dash."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def device_key(dev):
    return normalise(dev.name)


def vendor_key(dev):
    vendor = normalise(dev.vendor)
    for known in ("nvidia", "amd", "intel", "apple", "arm", "qualcomm"):
        if known in vendor or (known == "amd" and "advanced-micro" in vendor):
            return known
    return vendor.split("-")[0] if vendor else "unknown"


def shape_key(shape_class):
    """``{"hd": 128}`` → ``"hd=128"`` (sorted, so dict order never matters)."""
    return ",".join(f"{k}={shape_class[k]}" for k in sorted(shape_class))


def user_dir():
    """The folder of the user tuning files: ``CLOPS_TUNING_DIR``, else ``tuning`` in the user config dir."""
    if os.environ.get("CLOPS_TUNING_DIR"):
        return Path(os.environ["CLOPS_TUNING_DIR"])
    import platformdirs

    return Path(platformdirs.user_config_dir("clops")) / "tuning"


def user_file(dev):
    return user_dir() / f"{device_key(dev)}.json"


def _load(path):
    found = _files.get(path)
    if found is None:
        try:
            with open(path) as f:
                found = json.load(f).get("entries", {})
        except FileNotFoundError:
            found = {}
        except (OSError, ValueError, AttributeError) as e:
            raise ValueError(f"tuning file {path} is unreadable: {e}") from None
        _files[path] = found
    return found


def _sources(dev):
    yield "user", user_file(dev)
    yield "device", SHIPPED_DIR / f"{device_key(dev)}.json"
    yield "vendor", SHIPPED_DIR / f"{vendor_key(dev)}.json"
    yield "default", SHIPPED_DIR / "default.json"


def lookup(dev, op, shape_class):
    """(params, source) from the database, or (None, None)."""
    key = shape_key(shape_class)
    with _lock:
        found = _overrides.get((device_key(dev), op, key)) or _overrides.get((None, op, key))
    if found is not None:
        return dict(found), "override"
    for source, path in _sources(dev):
        entry = _load(path).get(op, {}).get(key)
        if entry is not None:
            return dict(entry), f"{source} ({path.name})"
    return None, None


def choose(dev, op, shape_class, heuristic):
    """Template parameters for ``op``: the database's, else ``heuristic()``."""
    params, _ = lookup(dev, op, shape_class)
    return params if params is not None else heuristic()


def override(op, shape_class, params, device=None):
    """Use ``params`` for ``op`` at ``shape_class`` from now on (on ``device`` only, if given).

    ``params=None`` removes the override.
    """
    key = (device_key(device) if device is not None else None, op, shape_key(shape_class))
    with _lock:
        if params is None:
            _overrides.pop(key, None)
        else:
            _overrides[key] = dict(params)
        _generation[0] += 1


def save(dev, op, shape_class, params, path=None):
    """Write ``params`` into the user file for ``dev`` (or ``path``); returns the path."""
    path = Path(path) if path else user_file(dev)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        data = {}
    platform, name, driver = device_identity(dev)
    data["device"] = {"platform": platform, "name": name, "driver": driver, "key": device_key(dev)}
    data.setdefault("entries", {}).setdefault(op, {})[shape_key(shape_class)] = dict(params)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    reload()
    return path
