"""Adapter aliases: one name whose requests go to up to MAX_TARGETS adapters by weight, for
a canary (90/10), a flip (0/100) and a rollback (a PUT of the old weights).

    Alias("bot-prod", (AliasTarget("bot@3", 90), AliasTarget("bot@4", 10)), owner="", ...)

A target is `ID`, `ID@N` or `ID@sha256:HEXPREFIX`; only its id is judged here (the
residency manager's `locate` parses the pin and judges whether it names something). `choose` picks one target per
request: with OpenAI's `user` field, a hash of (alias, user) placed on the cumulative weights,
so a user keeps its target while the weights stay, and a weight change moves only the users
whose point crosses a boundary; without it, a random draw by weight. Where aliases are kept and
how every replica sees the same ones: adapters/alias_store.py.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import random
from dataclasses import dataclass

from loragw.adapters.errors import AdapterError, InvalidAdapterId
from loragw.adapters.ids import validate_adapter_id

MAX_TARGETS = 16
MAX_WEIGHT = 1_000_000


class InvalidAlias(AdapterError):
    """The alias or its targets break a rule (HTTP 400); nothing was changed."""

    status = 400
    code = "invalid_alias"


class AliasConflict(AdapterError):
    """The alias's name is an adapter's id, or a target is another alias (HTTP 409)."""

    status = 409
    code = "alias_conflict"


class AliasesUnavailable(AdapterError):
    """Redis, which keeps the fleet's aliases, does not answer: a change cannot be made now
    (HTTP 503). Requests keep resolving aliases as last read."""

    status = 503
    code = "aliases_unavailable"


@dataclass(frozen=True, slots=True)
class AliasTarget:
    adapter: str  # ID, ID@N or ID@sha256:HEXPREFIX
    weight: int  # >= 0; 0 keeps a target listed (for a rollback) without sending it traffic


@dataclass(frozen=True, slots=True)
class Alias:
    alias: str
    targets: tuple[AliasTarget, ...]
    owner: str  # "": shared (the operator's); else the tenant whose namespace holds it
    updated_at: int  # unix seconds of the last PUT


def target_id(target: str) -> str:
    """The adapter id a target names: `bot` of `bot@3`."""
    return target.partition("@")[0]


def check_alias(alias: Alias) -> Alias:
    """`alias` if its name and targets keep the rules; else InvalidAlias naming the first
    broken one. The name follows the adapter id rules (adapters/ids.py)."""
    try:
        validate_adapter_id(alias.alias)
    except InvalidAdapterId as exc:
        raise InvalidAlias(f"an alias is named like an adapter id: {exc}") from None
    count = len(alias.targets)
    if not 1 <= count <= MAX_TARGETS:
        raise InvalidAlias(f"an alias needs 1 to {MAX_TARGETS} targets, got {count}")
    seen: set[str] = set()
    for i, target in enumerate(alias.targets):
        _check_target(alias.alias, i, target)
        if target.adapter in seen:
            raise InvalidAlias(f"targets[{i}]: {target.adapter!r} is listed twice; list each "
                               "target once with its whole weight")
        seen.add(target.adapter)
    if sum(t.weight for t in alias.targets) <= 0:
        raise InvalidAlias("the targets' weights sum to 0; give at least one target a "
                           "positive weight (or DELETE the alias)")
    return alias


def _check_target(name: str, i: int, target: AliasTarget) -> None:
    weight = target.weight
    if isinstance(weight, bool) or not isinstance(weight, int) or not 0 <= weight <= MAX_WEIGHT:
        raise InvalidAlias(f"targets[{i}].weight must be an integer in [0, {MAX_WEIGHT}], got "
                           f"{weight!r}")
    adapter_id = target_id(target.adapter)
    try:
        validate_adapter_id(adapter_id)
    except InvalidAdapterId as exc:
        raise InvalidAlias(f"targets[{i}].adapter: {exc}") from None
    if adapter_id == name:
        raise AliasConflict(f"targets[{i}]: alias {name!r} cannot point at itself")


def sticky_point(alias: str, user: str, total: int) -> int:
    """A point in [0, total) that depends only on (alias, user): uniform over users."""
    digest = hashlib.sha256(f"{alias}\x00{user}".encode("utf-8", "surrogatepass")).digest()
    return (int.from_bytes(digest[:8], "big") * total) >> 64


def choose(alias: Alias, user: str | None = None, rng: random.Random | None = None) -> str:
    """The target one request naming `alias` goes to; never one of weight 0."""
    ends = list(itertools.accumulate(t.weight for t in alias.targets))  # cumulative weights
    assert ends and ends[-1] > 0, f"alias {alias.alias!r} has no positive weight"
    if user:
        point = sticky_point(alias.alias, user, ends[-1])
    else:
        point = (rng or random).randrange(ends[-1])
    # the first target whose cumulative weight passes the point: a weight-0 target adds no
    # width, so no point lands on it
    return alias.targets[bisect.bisect_right(ends, point)].adapter
