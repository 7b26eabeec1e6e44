"""``save_checkpoint`` / ``load_checkpoint``: a sharded model's DCP checkpoint, nothing lost.

The checkpoint is torch's own (``dcp.save`` of ``get_state_dict``, under ``"model"`` and
``"optim"``): FSDP2, DCP's tools and other world sizes read it. tracedac adds what DCP leaves
to the caller, so that a resume is the saved state or an error, never something else:

- **One value per key.** DCP writes one copy of a chunk that several ranks hold (it takes
  them for replicas). Two ranks holding *different* data under one key (expert parallel's
  experts under the same name on every rank, each sharded over its rank alone; a buffer
  that differs by rank) would keep one rank's and give it to all at load. Refused at save
  and at load, naming the keys and ranks (``_collisions``).
- **Atomic.** A save writes ``<dir>.saving`` and, once every rank's files and DCP's metadata
  are written, records their sizes and CRC-32s in ``tracedac.json`` and renames it to
  ``<dir>`` (the last checkpoint stepping aside to ``<dir>.old`` for the instant between the
  two renames). A rank killed at any point leaves the previous checkpoint whole: ``<dir>``, or
  the one a later save or load finds (``_settled``).
- **Verified.** A load checks the files against the manifest (sizes always; CRC-32s unless
  ``verify=False``), or, for a DCP directory tracedac did not write, against DCP's metadata
  (every file present and long enough), then every entry against the model (present, same
  shape and dtype) before ``dcp.load`` touches a tensor: a truncated, mixed or foreign
  directory is an error that names what is wrong, and nothing is half loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..errors import ZeroError
from .module import sharded
from .tp import checkpoint_group

__all__ = ["load_checkpoint", "save_checkpoint"]

MANIFEST = "tracedac.json"
FORMAT = "tracedac.zero checkpoint 1"


def _state(model, optimizer):
    """``get_state_dict`` of the sharded model itself (``sharded(m).module``: not a compiled
    wrapper, whose keys would carry ``_orig_mod.``)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    optimizers = () if optimizer is None else optimizer
    model_sd, optim_sd = get_state_dict(model, optimizers)
    return {"model": model_sd, "optim": optim_sd} if optimizer is not None else {"model": model_sd}


def _flat(state: dict) -> dict:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(state)[0]


# --- one value per key ----------------------------------------------------------------------


def _digest(t: torch.Tensor) -> str:
    """A plain tensor's exact content (dtype, shape and bytes), for comparing ranks' values."""
    data = t.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes()
    return f"{t.dtype} {tuple(t.shape)} {hashlib.sha1(data).hexdigest()}"


def _holding(value, with_values: bool):
    """What this rank writes under one key: a DTensor's mesh (its ranks: DCP writes the chunks
    of one mesh's shards and replicas correctly), a plain tensor's content (``with_values``),
    or None for what DCP stores as an object."""
    if isinstance(value, DTensor):
        return ("DTensor on ranks", tuple(sorted(value.device_mesh.mesh.flatten().tolist())))
    if isinstance(value, torch.Tensor):
        return ("tensor", _digest(value) if with_values else None)
    return None


def _collisions(found: list[dict]) -> list[tuple[str, dict]]:
    """Keys that ranks hold differently: [(key, {holding: [ranks]})]."""
    by_key: dict[str, dict] = {}
    for rank, held in enumerate(found):
        for key, holding in held.items():
            by_key.setdefault(key, {}).setdefault(holding, []).append(rank)
    return [(k, h) for k, h in by_key.items() if len(h) > 1]


def _describe(collisions: list, group, when: str) -> str:
    ranks = dist.get_process_group_ranks(group)
    lines = []
    for key, holdings in collisions[:5]:
        parts = []
        for (kind, what), where in holdings.items():
            on = ", ".join(str(ranks[r]) for r in where)
            parts.append(f"ranks {on}: {kind} {list(what) if kind.startswith('DTensor') else ''}".rstrip())
        lines.append(f"  {key!r}: " + "; ".join(parts))
    more = f"\n  (and {len(collisions) - 5} more)" if len(collisions) > 5 else ""
    return (
        f"{when}: ranks hold different data under the same checkpoint key, and a checkpoint keeps "
        f"one value per key (DCP would write one rank's and give it to every rank at load):\n"
        + "\n".join(lines)
        + more
        + "\nName what differs by rank under its own key: expert-parallel experts by their global "
        "index (a ModuleDict keyed by str(expert index), so rank 1's are 'experts.2', "
        "'experts.3'), a per-rank buffer as non-persistent or reduced to one value before saving."
    )


def check_one_value_per_key(state: dict, group, *, with_values: bool, when: str) -> None:
    """Refuse, on every rank of ``group`` alike, a state where two ranks would store different
    data under one key (one small ``all_gather_object``; plain tensors compared by content
    when ``with_values``, DTensors by their mesh)."""
    mine = {}
    for key, value in _flat(state).items():
        h = _holding(value, with_values)
        if h is not None:
            mine[key] = h
    found = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, mine, group=group)
    collisions = _collisions(found)
    if collisions:
        raise ZeroError(_describe(collisions, group, when))


# --- the directory ----------------------------------------------------------------------------


def _paths(checkpoint_id) -> tuple[Path, Path, Path]:
    final = Path(checkpoint_id)
    return final, final.with_name(final.name + ".saving"), final.with_name(final.name + ".old")


def _crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != MANIFEST)


def _complete(directory: Path) -> bool:
    return (directory / MANIFEST).is_file()


def _settled(checkpoint_id) -> Path | None:
    """The newest complete checkpoint a save to ``checkpoint_id`` left: a finished save not yet
    renamed (killed between its manifest and its rename), the directory itself, or the one a
    save had stepped aside (killed between the two renames). None when there is none."""
    final, saving, old = _paths(checkpoint_id)
    for candidate in (saving, final, old):
        if candidate.is_dir() and _complete(candidate):
            return candidate
    return final if final.is_dir() else None


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _commit(checkpoint_id) -> None:
    """Rank 0, after every rank's files and the manifest are written: ``<dir>.saving`` becomes
    ``<dir>``. Each step leaves a complete checkpoint that ``_settled`` finds."""
    final, saving, old = _paths(checkpoint_id)
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(saving, final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def _prepare(checkpoint_id) -> None:
    """Rank 0, before a save: finish what a killed save left (``_settled``'s choice becomes
    ``<dir>``), then clear the staging directory."""
    final, saving, old = _paths(checkpoint_id)
    newest = _settled(checkpoint_id)
    if newest is not None and newest != final:
        if final.exists():
            shutil.rmtree(final)
        os.replace(newest, final)
    for stale in (saving, old):
        if stale.exists():
            shutil.rmtree(stale)
    final.parent.mkdir(parents=True, exist_ok=True)


def _sums(directory: Path, names: list[str], rank: int, world: int) -> dict:
    """This rank's share of the directory's files (every ``world``-th): name -> [size, crc32]."""
    return {n: [(directory / n).stat().st_size, _crc(directory / n)] for n in names[rank::world]}


def _gathered(mine: dict, group) -> dict:
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, mine, group=group)
    return {k: v for part in parts for k, v in part.items()}


def save_checkpoint(checkpoint_id: str | os.PathLike, model, optimizer=None) -> None:
    """Save ``model`` (and ``optimizer``) to the directory ``checkpoint_id``, atomically.

    ``dcp.save`` of ``get_state_dict(model, optimizer)`` under ``"model"`` and ``"optim"``: the
    model's own keys, each rank writing its shards. Written to ``<dir>.saving`` and renamed
    once complete, with a manifest of every file's size and CRC-32: a save killed on any rank
    leaves the previous checkpoint loadable. Refuses a state where two ranks hold different
    data under one key. A collective (over the whole 2-D mesh with tensor parallel)."""
    import torch.distributed.checkpoint as dcp

    z = sharded(model)
    group = checkpoint_group(z)
    state = _state(z.module, optimizer)
    check_one_value_per_key(state, group, with_values=True, when="save_checkpoint refused")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    saving = _paths(checkpoint_id)[1]
    _on_rank0(lambda: _prepare(checkpoint_id), group, "preparing")
    dcp.save(state, checkpoint_id=saving, process_group=group)  # returns once .metadata is written
    sums = _gathered(_sums(saving, _files(saving), rank, world), group)
    manifest = {"format": FORMAT, "world_size": world, "files": sums}
    # no rank returns (and loads) before the checkpoint is in place
    _on_rank0(lambda: _finish(checkpoint_id, manifest), group, "finishing")


def _on_rank0(fn, group, what: str) -> None:
    """Run ``fn`` on the group's first rank; every rank returns when it is done, or raises
    the same error (a rank raising alone would leave the others waiting)."""
    error = None
    if dist.get_rank(group) == 0:
        try:
            fn()
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
    found = [None]
    if dist.get_rank(group) == 0:
        found = [error]
    dist.broadcast_object_list(found, group_src=0, group=group)
    if found[0] is not None:
        raise ZeroError(f"save_checkpoint failed {what} the directory on the first rank: {found[0]}")


def _finish(checkpoint_id, manifest: dict) -> None:
    """Rank 0: the manifest, written last and durably, then the rename (``_commit``)."""
    saving = _paths(checkpoint_id)[1]
    tmp = saving / f"{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, saving / MANIFEST)
    _fsync_dir(saving)
    _commit(checkpoint_id)


def _verify_files(directory: Path, verify: bool, group) -> str | None:
    """What is wrong with the directory's files, or None (the same answer on every rank)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    problem = None
    if _complete(directory):
        try:
            manifest = json.loads((directory / MANIFEST).read_text())
            files = manifest["files"]
            if manifest.get("format") != FORMAT:
                raise ValueError(f"format {manifest.get('format')!r}")
        except (ValueError, KeyError, TypeError) as e:
            problem = f"its manifest {MANIFEST} is unreadable ({e})"
        else:
            for i, (name, (size, crc)) in enumerate(sorted(files.items())):
                path = directory / name
                if not path.is_file():
                    problem = f"file {name} is missing"
                elif path.stat().st_size != size:
                    problem = (
                        f"file {name} is {path.stat().st_size} bytes, the save wrote {size} "
                        "(truncated or replaced)"
                    )
                elif verify and i % world == rank and _crc(path) != crc:
                    problem = (
                        f"file {name} is not what the save wrote (CRC-32 differs: corrupted or replaced)"
                    )
                if problem:
                    break
    else:
        problem = _check_dcp_files(directory)
    found = [None] * world
    dist.all_gather_object(found, problem, group=group)
    return next((p for p in found if p is not None), None)


def _check_dcp_files(directory: Path) -> str | None:
    """A DCP directory tracedac did not write: its metadata readable, every file it names
    present and long enough for the items it says are there."""
    import torch.distributed.checkpoint as dcp

    if not (directory / ".metadata").is_file():
        return (
            "it has no .metadata (not a torch.distributed.checkpoint directory, or a save that "
            "never finished)"
        )
    try:
        metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    except Exception as e:  # a torn or foreign pickle: say so rather than fail inside DCP
        return f"its .metadata is unreadable ({type(e).__name__}: {e})"
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = str(info.relative_path)
        ends[name] = max(ends.get(name, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        path = directory / name
        if not path.is_file():
            return f"file {name} is missing"
        if path.stat().st_size < end:
            return f"file {name} is {path.stat().st_size} bytes, its metadata needs {end} (truncated)"
    return None


def load_checkpoint(checkpoint_id: str | os.PathLike, model, optimizer=None, *, verify: bool = True) -> None:
    """Resume ``model`` (and ``optimizer``) from ``save_checkpoint``'s directory, saved on any
    number of ranks, or any DCP checkpoint of the same model.

    Before anything is loaded: the newest complete save to ``checkpoint_id`` is found (one a
    killed save left included), its files are checked (sizes; CRC-32s unless ``verify=False``),
    and every entry against the model (present, same shape, same dtype), and the model must
    not hold different data under one key on two ranks; any of these raises ``ZeroError``
    on every rank. Then ``dcp.load`` and ``set_state_dict``. A collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    z = sharded(model)
    state = _state(z.module, optimizer)
    group = checkpoint_group(z)
    check_one_value_per_key(state, group, with_values=False, when="load_checkpoint refused")
    where = _settled(checkpoint_id)
    if where is None:
        raise ZeroError(f"checkpoint {str(checkpoint_id)!r} does not exist (no directory, nor a save of it).")
    problem = _verify_files(where, verify, group)
    if problem is not None:
        raise ZeroError(
            f"checkpoint {str(where)!r} cannot be loaded: {problem}. Nothing was loaded. Load an "
            "earlier checkpoint, or save again."
        )
    _check_against(dcp.FileSystemReader(str(where)).read_metadata(), state, where, group)
    dcp.load(state, checkpoint_id=where, process_group=group)
    set_state_dict(
        z.module,
        () if optimizer is None else optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}),
    )


def _mismatch(saved: dict, flat: dict, where) -> str | None:
    """What makes this rank's model and the checkpoint disagree, or None."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            continue
        md = saved.get(key)
        if md is None:
            return (
                f"checkpoint {str(where)!r} has no entry {key!r}, which the model (or its "
                "optimizer) needs; it was saved from another model."
            )
        if not isinstance(md, TensorStorageMetadata):
            return f"checkpoint entry {key!r} is not a tensor, the model's is; saved from another model."
        if tuple(md.size) != tuple(value.shape) or md.properties.dtype != value.dtype:
            return (
                f"checkpoint entry {key!r} is {tuple(md.size)} {md.properties.dtype} but the model's is "
                f"{tuple(value.shape)} {value.dtype}; it was saved from another model (dcp.load would "
                f"{'cast it silently' if tuple(md.size) == tuple(value.shape) else 'refuse it'})."
            )
    return None


def _check_against(metadata, state: dict, where, group) -> None:
    """Refuse, on every rank of ``group`` alike, a checkpoint some rank's model disagrees with:
    each rank's keys and first mismatch are gathered before anyone raises (an expert-parallel
    model's ranks hold different experts, so one rank may find what the others do not; a rank
    raising alone would leave the others waiting in the gather)."""
    flat = _flat(state)
    saved = metadata.state_dict_metadata
    found = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, (list(flat), _mismatch(saved, flat, where)), group=group)
    problems = [(r, p) for r, (_, p) in enumerate(found) if p is not None]
    if problems:
        rank, problem = problems[0]
        raise ZeroError(f"{problem} (found by rank {rank} of the checkpoint's group)")
    # Entries no rank of the group has (the checkpoint holds every rank's experts)
    known = set().union(*(keys for keys, _ in found))
    prefixes = tuple(f"{k}." for k in state)
    extra = [k for k in saved if k.startswith(prefixes) and k not in known]
    if extra:
        raise ZeroError(
            f"checkpoint {str(where)!r} has entries the model does not: {extra[:5]}; it was "
            "saved from another model."
        )
