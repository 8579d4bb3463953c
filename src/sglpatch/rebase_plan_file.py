"""A rebase's saved plan, DIR/.git/sglpatch-rebase/state.json: its fields, its format number and
its reader (every key known and of its type). Outside the rebase package, so that the workdir's
guard (sglpatch.workdir: is a rebase in progress?) reads it without running the rebase, which
builds on the stack; sglpatch.rebase.state writes it, next to the rest of a rebase's state."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from sglpatch.errors import SglpatchError

_TYPES = {"str": str, "int": int, "list": list, "dict": dict}


class RebaseError(SglpatchError):
    pass


PLAN_FORMAT = 1  # of the saved Plan (state.json); load refuses any other, with the way out


@dataclass
class Plan:
    """Everything a rebase needs, saved as state between --continue calls (state.json).
    A change to its fields that an older sglpatch cannot read raises PLAN_FORMAT."""

    project: str
    source: str
    old_lock: str  # dumps
    new_lock: str  # dumps (blobs filled at the end)
    old_base: str
    old_commits: list[str]
    names: list[str]
    strips: list[int]
    sha256s: list[str]
    onto: str
    head: str
    next: int = 0
    outcomes: list[dict] = field(default_factory=list)
    hand: dict[str, str] = field(default_factory=dict)  # name -> "replace"/"drop" resolved during this rebase
    orig: dict = field(default_factory=dict)
    stopped: dict = field(default_factory=dict)
    dest: str = ""  # where the finishing step writes series/patches/lock: "" the primary (--promote), else lines/<R>
    format: int = PLAN_FORMAT


def _damaged(wd: Path, f: Path, why: str) -> RebaseError:
    return RebaseError(
        f"{f} is damaged ({why}): the rebase cannot go on from it; `sglpatch rebase --workdir {wd} --abort` "
        f"puts {wd} and the project back as they were"
    )


def _other_format(wd: Path, f: Path, got) -> RebaseError:
    which = "no format number (an older sglpatch)" if got is None else f"format {json.dumps(got)}"
    return RebaseError(
        f"{f} has {which}, and this sglpatch reads format {PLAN_FORMAT} only: `sglpatch rebase --workdir {wd} --abort` "
        f"puts {wd} and the project back as they were (or finish it with the sglpatch that started it, "
        f"or delete {f.parent}, which forgets the rebase without restoring anything)"
    )


def plan_from(data) -> Plan:
    """A Plan from state.json's JSON, every key known and of its type (ValueError otherwise)."""
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    fields = {f.name: f for f in dataclasses.fields(Plan)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r}")
    for name, f in fields.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(f"missing key {name!r}")
            continue
        kind, _, inner = str(f.type).partition("[")
        value = data[name]
        if not isinstance(value, _TYPES[kind]) or isinstance(value, bool):
            raise ValueError(f"{name} is not a {kind}")
        item = _TYPES.get(inner.rstrip("]").split(",")[0].strip())
        if kind == "list" and item and not all(isinstance(x, item) and not isinstance(x, bool) for x in value):
            raise ValueError(f"{name} holds something that is not a {inner.rstrip(']')}")
    plan = Plan(**data)
    n = len(plan.names)
    if len(plan.strips) != n or len(plan.sha256s) != n or len(plan.old_commits) != n or not 0 <= plan.next <= n:
        raise ValueError("its lists do not agree with each other")
    if plan.stopped and not (isinstance(plan.stopped.get("index"), int) and 0 <= plan.stopped["index"] < n
                             and isinstance(plan.stopped.get("outcome"), dict) and isinstance(plan.stopped.get("files"), list)):
        raise ValueError("its stop record is not one")
    return plan


def load(f: Path, wd: Path) -> Plan:
    """The plan saved in f (DIR/.git/sglpatch-rebase/state.json; wd: DIR), or the one line that
    says why there is none, or how to get out of a damaged one."""
    if not f.is_file():
        if f.parent.exists():  # a rebase killed before it saved its state: nothing to resume or restore
            raise RebaseError(
                f"no rebase to resume in {wd}: one was killed before it changed anything; "
                "re-run `sglpatch rebase --onto ...`, which clears what it left"
            )
        raise RebaseError(f"no rebase in progress in {wd}")
    try:
        text = f.read_text(encoding="utf-8")
        data = json.loads(text)
        if isinstance(data, dict) and data.get("format") != PLAN_FORMAT:
            raise _other_format(wd, f, data.get("format"))
        return plan_from(data)
    except (OSError, UnicodeDecodeError) as e:
        raise _damaged(wd, f, str(e)) from None
    except ValueError as e:
        raise _damaged(wd, f, "empty" if not text.strip() else str(e)) from None
