"""Reward functions for RL stages and task accuracy for eval, selected by name.

A reward function takes `(prompt, completion, answer, **kwargs)` and returns a float. Built in:
- `exact_match`: 1.0 when the completion's first number equals the ground-truth answer
  numerically (the demo's arithmetic task; "42", " 42.0" and "42 is the answer" all match 42);
- `format`: 1.0 when the completion is a bare number and nothing else;
- `closeness`: partial credit for numeric answers, 1 - |x - answer| / scale (at least 0),
  for the completion's first number x: a dense signal where exact matches are rare (the
  demo's tiny model samples the exact sum about one time in five).
`score` is not a function here: it names the grpo stage's `reward_model` input, whose scalar
head scores prompt + completion (`alignflow.stages.grpo.model_scores`).
Any other name is an import path `package.module:function` to a function with the same
signature, so users plug in their own reward without touching alignflow:
    grpo.environment=[{name: my_rewards.math:boxed_answer, kwargs: {strict: true}}]
"""

import importlib
import re
from typing import Callable

RewardFn = Callable[..., float]

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_BARE_NUMBER = re.compile(r"\s*-?\d+(?:\.\d+)?\s*")


def exact_match(prompt: str, completion: str, answer: str, **_) -> float:
    found = _NUMBER.search(completion)
    try:
        return float(found is not None and float(found.group()) == float(answer))
    except ValueError:
        return 0.0


def closeness(prompt: str, completion: str, answer: str, scale: float = 10.0, **_) -> float:
    found = _NUMBER.search(completion)
    try:
        return 0.0 if found is None else max(0.0, 1.0 - abs(float(found.group()) - float(answer)) / scale)
    except ValueError:
        return 0.0


def format_reward(prompt: str, completion: str, answer: str, **_) -> float:
    return float(_BARE_NUMBER.fullmatch(completion) is not None)


SCORE = "score"  # the reward model's score (grpo's `reward_model` input)

REGISTRY: dict[str, RewardFn] = {"exact_match": exact_match, "closeness": closeness, "format": format_reward}


def resolve(name: str) -> RewardFn:
    """A registered reward, or a function by `module:function` import path."""
    if name in REGISTRY:
        return REGISTRY[name]
    module, sep, attr = name.partition(":")
    if not sep:
        raise ValueError(f"reward {name!r}: not one of {sorted(REGISTRY)} and not a 'module:function' path")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"reward {name!r}: cannot import it ({err})") from None
    if not callable(fn):
        raise ValueError(f"reward {name!r} is not callable")
    return fn
