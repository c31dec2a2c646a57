"""Measured plan tables: per world size and GPU model, the size thresholds that "auto" uses.

``tpfuse tune --write-table`` measures, on the machine at hand, the algorithms that the
plans choose between (``tpfuse.bench.tune``) and writes ``w{W}-{model}.json`` into this
directory (model: ``gpu_model`` of the GPU's name, e.g. "h100"); ``w{W}.json`` is a table for
any GPU model. When ``tpfuse.comm`` is imported, each ``w{W}.json`` replaces the defaults of
``tpfuse.comm.plan`` and ``tpfuse.comm.quant_plan`` for its world size W only; when a
``Communicator`` is created on a GPU, the table of that GPU's model at its W, where there is
one, replaces those (``use_gpu_tables``), and a GPU model without one logs once which table,
or the defaults, it uses instead. World sizes without a table keep the defaults.

A table file::

    {"world_size": 2,
     "knobs": {"ONESHOT_MAX_BYTES": 2097152, "LL_MAX_BYTES": 131072, "LAMPORT_MAX_BYTES": 1048576,
               "FUSED_ONESHOT_MAX_BYTES": 524288, "FUSED_LL_MAX_BYTES": 131072,
               "FUSED_TWOSHOT_MAX_BYTES": 0,
               "QUANT_MIN_BYTES": {"int4": 2097152, "int6": 4194304, "int8": 4194304, "fp8": null}},
     "provenance": {"gpu": "...", "topology": "...", "date": "...", "commit": "...",
                    "sweep": "tune_w2_bf16.json"}}

Every knob is optional (a missing one keeps its default, but a missing FUSED_WIDE_* knob
takes the table's FUSED_* value where it has one: a table measured at one row width, older
or from a tune cut short, serves every width alike); sizes are message bytes, ints >= 0; a
codec's None means "never". Anything else raises ValueError naming the file and key.

Every rank must derive the same plan (docs/design.md 2.5), so the tables come from files that
every rank reads alike: this package's directory (the same installed files on every rank
of the node), or ``TPFUSE_TABLE_DIR``, which every rank must then set to the same
directory. Under Triton's interpreter the package's tables are not read: they hold GPU
measurements, and the interpreter's knobs (LL_MAX_BYTES, LAMPORT_MAX_BYTES) are set for the CPU tests' sizes;
``TPFUSE_TABLE_DIR`` is read there too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re

import torch

from tpfuse._runtime import INTERPRETER
from tpfuse.quant_format import QUANT_CODECS

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
ENV_DIR = "TPFUSE_TABLE_DIR"
SIZE_KNOBS = ("ONESHOT_MAX_BYTES", "LL_MAX_BYTES", "LAMPORT_MAX_BYTES", "FUSED_ONESHOT_MAX_BYTES",
              "FUSED_LL_MAX_BYTES", "FUSED_LAMPORT_MAX_BYTES", "FUSED_TWOSHOT_MAX_BYTES",
              "FUSED_WIDE_ONESHOT_MAX_BYTES", "FUSED_WIDE_LL_MAX_BYTES", "FUSED_WIDE_LAMPORT_MAX_BYTES",
              "FUSED_WIDE_TWOSHOT_MAX_BYTES")
"""Knobs of tpfuse.comm.plan: {world size: bytes}."""
QUANT_KNOB = "QUANT_MIN_BYTES"
"""The knob of tpfuse.comm.quant_plan: {codec: {world size: bytes or None}}."""
_FILE = re.compile(r"w([1-9]\d*)(?:-([a-z0-9-]+))?\.json")
_ABSENT = object()
"""What ``apply`` reports for a world size that had no entry of its own (it used W=8's)."""
_APPLIED: dict[int, tuple[dict, dict]] = {}
"""What ``apply_tables`` and ``use_gpu_tables`` did: {world size: (the knobs applied, what
they replaced)}."""
_GPU_MODEL: str | None = None
"""The GPU model whose tables ``use_gpu_tables`` applied in this process (None: none yet)."""
_GPU_TABLES_LOGGED: set[tuple[int, str]] = set()
"""(world size, GPU model) pairs ``use_gpu_tables`` has logged about."""
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


def read_tables(directory: str, model: str | None = None) -> dict[int, dict]:
    """{world size: knobs} of every table in ``directory`` for GPU ``model`` (``w{W}-{model}.json``)
    or, where it has none, for any model (``w{W}.json``); only the latter with model None.
    Empty where the directory does not exist."""
    names = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    found = {}
    for name in names:
        match = _FILE.fullmatch(name)
        if match and match.group(2) in (None, model):
            table = read_table(os.path.join(directory, name))
            if match.group(2) is not None or table["world_size"] not in found:
                found[table["world_size"]] = table["knobs"]
    return found


def apply(world_size: int, knobs: dict) -> dict:
    """Set ``knobs`` (a table's, validated) for ``world_size`` in the plan modules' dicts;
    returns what they replaced, for ``restore``."""
    from tpfuse.comm import plan, quant_plan

    replaced = {}
    for key, value in knobs.items():
        if key == QUANT_KNOB:
            replaced[key] = {c: quant_plan.QUANT_MIN_BYTES[c].get(world_size, _ABSENT) for c in value}
            for codec, size in value.items():
                quant_plan.QUANT_MIN_BYTES[codec][world_size] = size
        else:
            replaced[key] = getattr(plan, key).get(world_size, _ABSENT)
            getattr(plan, key)[world_size] = value
    return replaced


def restore(world_size: int, replaced: dict) -> None:
    """Undo ``apply``: put back what it returned."""
    from tpfuse.comm import plan, quant_plan

    entries = [(quant_plan.QUANT_MIN_BYTES[c], v) for c, v in replaced.get(QUANT_KNOB, {}).items()]
    entries += [(getattr(plan, key), v) for key, v in replaced.items() if key != QUANT_KNOB]
    for table, value in entries:
        if value is _ABSENT:
            table.pop(world_size, None)
        else:
            table[world_size] = value


@contextlib.contextmanager
def applied(world_size: int, knobs: dict):
    """``apply`` for the duration of a with-block (tests, and the tuner measuring under the
    knobs it has derived so far)."""
    _settle_gpu_tables()
    replaced = apply(world_size, knobs)
    try:
        yield
    finally:
        restore(world_size, replaced)


def table_dir() -> str | None:
    """The directory the plans read: ``TPFUSE_TABLE_DIR`` if set (it must be a directory: a
    typo would silently leave the defaults on some ranks), else this package's (None under
    the interpreter, see above)."""
    directory = os.environ.get(ENV_DIR)
    if directory and not os.path.isdir(directory):
        raise ValueError(f"{ENV_DIR}={directory!r} is not a directory")
    return directory or (None if INTERPRETER else PACKAGE_DIR)


def effective_knobs(world_size: int) -> dict:
    """The table-controlled knobs as the plans use them at ``world_size`` (a world size
    without an entry uses W=8's), and FUSED_ROWS_MAX_BYTES, which no table sets but which sizes
    the workspace and picks plans too: what every rank of a group must agree on, which
    ``Communicator`` checks when it is created."""
    from tpfuse.comm import plan, quant_plan

    knobs = {key: plan.for_world(getattr(plan, key), world_size) for key in SIZE_KNOBS}
    knobs["FUSED_ROWS_MAX_BYTES"] = plan.for_world(plan.FUSED_ROWS_MAX_BYTES, world_size)
    knobs[QUANT_KNOB] = {c: quant_plan.default_quant_min_bytes(c, world_size) for c in QUANT_CODECS}
    return knobs


def write_table(path: str, table: dict) -> None:
    """Write ``table`` to ``path`` whole (a temporary file renamed over it), so that no rank
    importing tpfuse.comm meanwhile reads half a table."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    read_table(path)  # what the plans will read must load


def apply_tables() -> None:
    """Apply the tables for any GPU model (``w{W}.json``) of ``table_dir()``. Called once, when
    tpfuse.comm is imported (before any GPU is asked its name)."""
    directory = table_dir()
    for world_size, knobs in (read_tables(directory) if directory else {}).items():
        _APPLIED[world_size] = (knobs, apply(world_size, knobs))


def use_gpu_tables(device_name: str, world_size: int | None = None) -> None:
    """Apply the tables measured on this GPU model (``w{W}-{model}.json`` of ``table_dir()``)
    over the ones ``apply_tables`` applied, once per process; with ``world_size``, log once
    what the plans use there when the model has no table of its own. Called by
    ``Communicator`` on GPUs before the ranks compare their knobs, and by ``applied`` and
    ``built_in_defaults`` (so that a table applied later never undoes theirs)."""
    global _GPU_MODEL
    model = gpu_model(device_name)
    directory = table_dir()
    if directory is None:
        return
    if _GPU_MODEL is None:
        _GPU_MODEL = model
        for w, knobs in read_tables(directory, model).items():
            if os.path.exists(table_path(directory, w, model)):
                if w in _APPLIED:
                    restore(w, _APPLIED[w][1])
                _APPLIED[w] = (knobs, apply(w, knobs))
    if world_size is None or (world_size, model) in _GPU_TABLES_LOGGED:
        return
    _GPU_TABLES_LOGGED.add((world_size, model))
    if model != _GPU_MODEL:
        logger.warning("tpfuse: this process applied the plan tables of %s GPUs; %s uses them too", _GPU_MODEL,
                       device_name)
    elif not os.path.exists(table_path(directory, world_size, model)):
        generic = table_path(directory, world_size)
        source = (f"{os.path.basename(generic)} (measured on {read_table(generic)['provenance'].get('gpu', 'a GPU')})"
                  if os.path.exists(generic) else "the defaults of tpfuse/comm/plan.py")
        logger.warning("tpfuse: no plan table measured on %s at world size %d (%s); the plans use %s",
                       device_name, world_size, os.path.basename(table_path(directory, world_size, model)), source)


def _settle_gpu_tables() -> None:
    """``use_gpu_tables`` for this process's GPU (the current device), on GPU machines."""
    if not INTERPRETER and torch.cuda.is_available():
        use_gpu_tables(torch.cuda.get_device_name())


@contextlib.contextmanager
def built_in_defaults():
    """The plans' own defaults, as written in plan.py and quant_plan.py, for the duration of a
    with-block: what ``apply_tables`` applied at import is undone, then applied again. For
    tests that check those defaults, which a table in this directory would change on GPU
    machines."""
    _settle_gpu_tables()
    for world_size, (_, replaced) in _APPLIED.items():
        restore(world_size, replaced)
    try:
        yield
    finally:
        for world_size, (knobs, _) in _APPLIED.items():
            apply(world_size, knobs)
