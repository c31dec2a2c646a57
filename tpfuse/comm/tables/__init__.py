"""Measured tables: per world size and GPU model, the size thresholds that "auto" uses.

``tpfuse tune --write-table`` measures, on the machine at hand, the algorithms that the
plans choose between (``tpfuse.bench.tune``) and writes ``w{W}-{model}.json`` into this
directory (model: ``gpu_model`` of the GPU's name, e.g. "h100"); ``w{W}.json`` is a table for
any GPU model. A ``Communicator`` takes ``knobs_for(W, its GPU's name)``: the defaults
(``tpfuse.comm.knobs.default_knobs``) with the table of that GPU model at W over them, or,
where the model has none, the table for any model (the fallback logged once), or none.

A table file::

    {"world_size": 2,
     "knobs": {"ONESHOT_MAX_BYTES": 2097152, "LL_MAX_BYTES": 131072, "LAMPORT_MAX_BYTES": 1048576,
               "FUSED_ONESHOT_MAX_BYTES": 524288, "FUSED_LL_MAX_BYTES": 131072,
               "FUSED_TWOSHOT_MAX_BYTES": 0,
               "QUANT_MIN_BYTES": {"int4": 2097152, "int6": 4194304, "int8": 4194304, "fp8": null}},
     "provenance": {"gpu": "...", "topology": "...", "date": "...", "commit": "...",
                    "sweep": "tune_w2_bf16.json"}}

A table's keys are the ``Knobs`` fields' names in capitals. Every knob is optional (a
missing one keeps its default, but a missing FUSED_WIDE_* knob
takes the table's FUSED_* value where it has one: a table measured at one row width, older
or from a tune cut short, serves every width alike); sizes are message bytes, ints >= 0; a
codec's None means "never". Anything else raises ValueError naming the file and key.

Every rank must derive the same plan (docs/design.md 2.5), so the tables come from files that
every rank reads alike: this package's directory (the same installed files on every rank
of the node), or ``TPFUSE_TABLE_DIR``, which every rank must then set to the same
directory (``Communicator`` checks that its ranks' knobs agree). Under Triton's interpreter the package's tables are not read: they hold GPU
measurements, and the interpreter's knobs (LL_MAX_BYTES, LAMPORT_MAX_BYTES) are set for the CPU tests' sizes;
``TPFUSE_TABLE_DIR`` is read there too.
"""

from __future__ import annotations

import json
import logging
import os
import re

from tpfuse._runtime import INTERPRETER
from tpfuse.comm.knobs import Knobs, default_knobs
from tpfuse.quant_format import QUANT_CODECS

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
ENV_DIR = "TPFUSE_TABLE_DIR"
SIZE_KNOBS = ("ONESHOT_MAX_BYTES", "LL_MAX_BYTES", "LAMPORT_MAX_BYTES", "FUSED_ONESHOT_MAX_BYTES",
              "FUSED_LL_MAX_BYTES", "FUSED_LAMPORT_MAX_BYTES", "FUSED_TWOSHOT_MAX_BYTES",
              "FUSED_WIDE_ONESHOT_MAX_BYTES", "FUSED_WIDE_LL_MAX_BYTES", "FUSED_WIDE_LAMPORT_MAX_BYTES",
              "FUSED_WIDE_TWOSHOT_MAX_BYTES")
"""The size knobs a table may set (each a ``Knobs`` field, in capitals): bytes."""
QUANT_KNOB = "QUANT_MIN_BYTES"
"""The quantized path's knob: {codec: bytes or None}."""
_FILE = re.compile(r"w([1-9]\d*)(?:-([a-z0-9-]+))?\.json")
_LOGGED: set[tuple[int, str]] = set()
"""(world size, missing table's path) pairs ``knobs_for`` has logged a fallback for."""
logger = logging.getLogger("tpfuse.comm")


def gpu_model(device_name: str) -> str:
    """The short model name that table files carry: the first word of letters then digits,
    with the form factor where it is not the SXM module's ("h100" for "NVIDIA H100 80GB
    HBM3", "h100-pcie" for "NVIDIA H100 PCIe", "h200-nvl" for "NVIDIA H200 NVL": their links
    and clocks differ); else the name's letters and digits."""
    name = device_name.lower().replace("nvidia", " ")
    match = re.search(r"\b([a-z]+\d+[a-z]*)\b", name)
    if not match:
        return re.sub(r"[^a-z0-9]", "", name) or "unknown"
    form = next((f for f in ("pcie", "nvl") if re.search(rf"\b{f}\b", name)), None)
    return match.group(1) + (f"-{form}" if form else "")


def table_path(directory: str, world_size: int, model: str | None = None) -> str:
    """The table file for ``world_size``: of GPU ``model`` ("h100"), or of any model (None)."""
    return os.path.join(directory, f"w{world_size}{'-' + model if model else ''}.json")


def read_table(path: str) -> dict:
    """The validated table at ``path``: {"world_size": int, "knobs": {...}, "provenance": {...}}."""
    with open(path) as f:
        try:
            table = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(table, dict):
        raise ValueError(f"{path}: the table must be a JSON object")
    for key in table:
        if key not in ("world_size", "knobs", "provenance"):
            raise ValueError(f"{path}: unknown key {key!r} (expected world_size, knobs, provenance)")
    world = table.get("world_size")
    if not _is_size(world) or world < 2:
        raise ValueError(f"{path}: key 'world_size' must be an int >= 2, got {world!r}")
    match = _FILE.fullmatch(os.path.basename(path))
    if match and int(match.group(1)) != world:
        raise ValueError(f"{path}: key 'world_size' is {world}, but the file name says {match.group(1)}")
    knobs = table.get("knobs", {})
    if not isinstance(knobs, dict):
        raise ValueError(f"{path}: key 'knobs' must be an object")
    if not isinstance(table.get("provenance", {}), dict):
        raise ValueError(f"{path}: key 'provenance' must be an object")
    for key, value in knobs.items():
        if key in SIZE_KNOBS:
            if not _is_size(value):
                raise ValueError(f"{path}: key {key!r} must be a size in bytes (an int >= 0), got {value!r}")
        elif key == QUANT_KNOB:
            if not isinstance(value, dict):
                raise ValueError(f"{path}: key {key!r} must be an object {{codec: bytes or null}}")
            for codec, size in value.items():
                if codec not in QUANT_CODECS:
                    raise ValueError(f"{path}: key {key}.{codec}: unknown codec (expected one of {QUANT_CODECS})")
                if size is not None and not _is_size(size):
                    raise ValueError(f"{path}: key {key}.{codec} must be an int >= 0 or null, got {size!r}")
        else:
            raise ValueError(f"{path}: unknown key {key!r} in knobs (expected {', '.join(SIZE_KNOBS + (QUANT_KNOB,))})")
    return {"world_size": world, "knobs": _with_wide_twins(knobs), "provenance": table.get("provenance", {})}


def _with_wide_twins(knobs: dict) -> dict:
    """``knobs`` with each missing FUSED_WIDE_* knob set to its FUSED_* twin's value, where
    the table has that (the wide rows' defaults would otherwise be the built-in ones)."""
    twins = {key.replace("FUSED_", "FUSED_WIDE_", 1): key for key in SIZE_KNOBS
             if key.startswith("FUSED_") and not key.startswith("FUSED_WIDE_")}
    return knobs | {wide: knobs[narrow] for wide, narrow in twins.items() if wide not in knobs and narrow in knobs}


def _is_size(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def table_dir() -> str | None:
    """The directory the tables are read from: ``TPFUSE_TABLE_DIR`` if set (it must be a
    directory: a typo would silently leave the defaults on some ranks), else this package's
    (None under the interpreter, see above)."""
    directory = os.environ.get(ENV_DIR)
    if directory and not os.path.isdir(directory):
        raise ValueError(f"{ENV_DIR}={directory!r} is not a directory")
    return directory or (None if INTERPRETER else PACKAGE_DIR)


def with_table(knobs: Knobs, table_knobs: dict, source: str) -> Knobs:
    """``knobs`` with a table's (validated: ``read_table``) values over them."""
    changes = {key.lower(): value for key, value in table_knobs.items() if key != QUANT_KNOB}
    if QUANT_KNOB in table_knobs:
        changes["quant_min_bytes"] = table_knobs[QUANT_KNOB]
    return knobs.replace(**changes, source=source)


def knobs_for(world_size: int, device_name: str | None = None) -> Knobs:
    """The knobs at ``world_size``: ``default_knobs`` with, over them, the table of
    ``device_name``'s GPU model (``w{W}-{model}.json`` of ``table_dir()``) or, where there is
    none (or no device name), the table for any model (``w{W}.json``), where there is one. A GPU
    model without a table of its own logs once which table, or the defaults, it uses instead."""
    knobs, directory = default_knobs(world_size), table_dir()
    if directory is None or world_size < 2:
        return knobs
    generic = table_path(directory, world_size)
    path = table_path(directory, world_size, gpu_model(device_name)) if device_name else generic
    if device_name and not os.path.exists(path):
        if (world_size, path) not in _LOGGED:
            _LOGGED.add((world_size, path))
            measured_on = read_table(generic)["provenance"].get("gpu", "a GPU") if os.path.exists(generic) else None
            source = (f"{os.path.basename(generic)} (measured on {measured_on})" if measured_on
                      else "the defaults of tpfuse/comm/knobs.py")
            logger.warning("tpfuse: no plan table measured on %s at world size %d (%s); the plans use %s",
                           device_name, world_size, os.path.basename(path), source)
        path = generic
    if not os.path.exists(path):
        return knobs
    return with_table(knobs, read_table(path)["knobs"], os.path.basename(path))


def write_table(path: str, table: dict) -> None:
    """Write ``table`` to ``path`` whole (a temporary file renamed over it), so that no rank
    creating a Communicator meanwhile reads half a table."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    read_table(path)  # what the plans will read must load
