"""`method.reward_fn` parsed and checked: a `RewardSpec`, or a one-line ValueError naming the key.

Two forms say the same thing:

    reward_fn: {pickscore: 1.0, clipscore: 0.5}                      # FastVideo's: name -> weight
    reward_fn:                                                        # a list, with options
      - {name: pickscore, weight: 1.0, frames: 3}
      - {name: my_rewards:sharpness, weight: 0.5}                     # the user's module:function

(FastVideo's `{rewards: {name: weight}}` is read as the mapping inside.) A weight left out of a list
entry is 1.0. A built-in reward's options are the keys of its class's `options`, each default
filled in; a `module:function` reward takes none, and its function is imported here so that a
missing module fails when the recipe is read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from fv_accel.rewards.base import DTYPES, REWARD_KEY, REWARDS, RewardEntry, RewardSpec
from fv_accel.rewards.user import import_user_function, is_user_reward


def parse_reward_fn(value: Any) -> RewardSpec:
    """The `RewardSpec` of a `method.reward_fn` value (either form); ValueError on any problem."""
    if isinstance(value, Mapping) and set(value) == {"rewards"}:
        value = value["rewards"]
    if isinstance(value, Mapping):
        raw = [(f"{REWARD_KEY}[{name}]", {"name": name, "weight": weight}) for name, weight in value.items()]
    elif isinstance(value, (list, tuple)):
        raw = [(f"{REWARD_KEY}[{i}]", entry) for i, entry in enumerate(value)]
    else:
        raise ValueError(
            f"{REWARD_KEY}: {value!r}: expected a mapping name -> weight (e.g. {{pickscore: 1.0}}) or a list of "
            "{name, weight, options...}"
        )
    if not raw:
        raise ValueError(f"{REWARD_KEY}: {value!r}: name at least one reward")
    entries = [parse_entry(key, entry) for key, entry in raw]
    seen: set[str] = set()
    for (key, _), entry in zip(raw, entries):
        if entry.name in seen:
            raise ValueError(f"{key}: {entry.name!r}: this reward is named twice (each name once: it keys the scores)")
        seen.add(entry.name)
    return RewardSpec(tuple(entries))


def parse_entry(key: str, raw: Any) -> RewardEntry:
    """One reward of the recipe; `key` names it in errors (`method.reward_fn[pickscore]`, `[0]`)."""
    if not isinstance(raw, Mapping) or "name" not in raw:
        raise ValueError(f"{key}: {raw!r}: expected a mapping with 'name' (and 'weight', options)")
    name = raw["name"]
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{key}.name: {name!r}: expected a reward name or 'module:function'")
    name = name.strip()
    weight = parse_weight(f"{key}.weight", raw.get("weight", 1.0))
    given = {k: v for k, v in raw.items() if k not in ("name", "weight")}
    if is_user_reward(name):
        try:
            import_user_function(name)
        except ValueError as err:
            raise ValueError(f"{key}: {name!r}: {err}") from None
        allowed: dict[str, Any] = {}
    else:
        name = name.lower()  # FastVideo's names are case-blind
        if name not in REWARDS:
            raise ValueError(
                f"{key}: {name!r}: unknown reward; known: {', '.join(sorted(REWARDS))}, or 'module:function' for your own"
            )
        allowed = REWARDS[name].options
    for option in given:
        if option not in allowed:
            known = ", ".join(["name", "weight", *allowed])
            raise ValueError(f"{key}.{option}: {given[option]!r}: unknown option of reward '{name}' (options: {known})")
    options = {option: parse_option(f"{key}.{option}", option, given.get(option, default))
               for option, default in allowed.items()}
    return RewardEntry(name=name, weight=weight, options=options)


def parse_weight(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{key}: {value!r}: expected a finite number")
    return float(value)


def parse_option(key: str, option: str, value: Any) -> Any:
    """A built-in reward's option, checked: `frames` an integer >= 1 or "all", `dtype` one of
    DTYPES, `model`/`processor` a Hub id or folder, a revision a string or null."""
    if option == "frames":
        ok = value == "all" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)
        expected = "an integer >= 1 (frames scored, evenly spaced, first and last included) or 'all'"
    elif option == "dtype":
        ok, expected = isinstance(value, str) and value in DTYPES, f"one of {', '.join(DTYPES)}"
    elif option.endswith("revision"):
        ok, expected = value is None or (isinstance(value, str) and bool(value.strip())), "a branch, tag or commit, or null"
    else:  # model, processor
        ok, expected = isinstance(value, str) and bool(value.strip()), "a Hub id or a local folder"
    if not ok:
        raise ValueError(f"{key}: {value!r}: expected {expected}")
    return value
