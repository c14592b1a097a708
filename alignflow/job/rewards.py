"""Reward functions for RL stages and task accuracy for eval, selected by name.

A reward function takes `(prompt, completion, answer, **kwargs)` and returns a float. Built in:
- `exact_match`: 1.0 when HF's math-verify finds the completion's answer equal to the
  ground-truth answer (GRPO's reward and eval's `accuracy` alike). The answer is read as LaTeX
  math; the completion's answer is its last `\\boxed{...}`, else its last LaTeX or plain
  expression (math-verify's `LatexExtractionConfig` then `ExprExtractionConfig`), compared
  numerically and symbolically: "42", " 42.0", "42 is the answer", "\\boxed{84/2}" all match 42,
  "$\\frac{2}{4}$" and "0.5" match \\frac{1}{2}; "40 + 2 = 43" does not (its answer is 43);
- `format`: 1.0 when the completion is a bare number and nothing else;
- `closeness`: partial credit for numeric answers, 1 - |x - answer| / scale (at least 0),
  for the completion's first number x: a dense signal where exact matches are rare (the
  demo's tiny model samples the exact sum about one time in five).
`score` is not a function here: it names the grpo stage's `reward_model` input, whose scalar
head scores prompt + completion (`alignflow.job.stages.grpo.model_scores`).
Any other name is an import path `package.module:function` to a function with the same
signature, so users plug in their own reward without touching alignflow:
    grpo.environment=[{name: my_rewards.math:boxed_answer, kwargs: {strict: true}}]

Eval's sampled metrics are here too: `pass_at_k` (Chen et al. 2021's unbiased estimator) and
`majority_answer` (maj@k's vote, answers grouped by math-verify's equivalence).

math-verify bounds each parse and comparison with signal.alarm, which only the main thread
may set: off the main thread (a thread pool) it runs without the bound rather than
fail every answer. The alarm also replaces a pending one (pytest-timeout's) for its duration.
math-verify is imported on first use: it loads sympy (most of a second), and the
orchestrator reads this module's reward names at compose time without checking an answer.
"""

import functools
import importlib
import math
import numbers
import re
import threading
from typing import Callable

import numpy as np

RewardFn = Callable[..., float]

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_BARE_NUMBER = re.compile(r"\s*-?\d+(?:\.\d+)?\s*")
TIMEOUT_S = 5  # math-verify's default bound on one parse or comparison (sympy can loop on odd input)


def _timeout() -> int | None:
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@functools.cache
def _answer_forms() -> tuple:
    """\\boxed{} and $...$ first, then plain expressions."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    return (LatexExtractionConfig(), ExprExtractionConfig())


def extract_answer(text: str) -> list:
    """math-verify's parse of a completion: [sympy value, its string], or [] when it holds no answer."""
    from math_verify import parse

    return parse(text, _answer_forms(), parsing_timeout=_timeout())


@functools.lru_cache(maxsize=65536)
def gold_answer(answer: str) -> list:
    """A dataset's answer read as LaTeX math (plain numbers too), parsed once per distinct answer."""
    from math_verify import parse

    return parse(f"${answer}$", _answer_forms(), parsing_timeout=_timeout())


def same_answer(gold: list, predicted: list) -> bool:
    from math_verify import verify

    return bool(gold and predicted) and verify(gold, predicted, timeout_seconds=_timeout())


def exact_match(prompt: str, completion: str, answer: str, **_) -> float:
    return _verified(completion, answer)


@functools.lru_cache(maxsize=65536)
def _verified(completion: str, answer: str) -> float:
    """Cached: a GRPO group's samples repeat (at temperature 0.3 the demo's mostly do), and one
    math-verify decision costs ~0.3 ms of CPU against ~1 us for the number match it replaced."""
    return float(same_answer(gold_answer(answer), extract_answer(completion)))


def majority_answer(answers: list[list]) -> list:
    """The most frequent of parsed answers ([] ones do not vote), equal ones grouped by
    math-verify; a tie goes to the answer seen first. [] when none was found."""
    groups: list[list] = []  # equal answers, in order of first appearance
    for answer in filter(None, answers):
        group = next((g for g in groups if same_answer(g[0], answer)), None)
        if group is None:
            groups.append([answer])
        else:
            group.append(answer)
    return max(groups, key=len, default=[[]])[0]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. 2021 (eq. 1): 1 - C(n - c, k) / C(n, k), the chance that k of n samples with
    c correct include a correct one, as a product of ratios (the binomials overflow)."""
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


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


def weighted_reward(rules: list[tuple[RewardFn, dict, float]], prompt: str, completion: str, answer: str, key: str) -> float:
    """The weighted sum of one sample's rule rewards ((function, kwargs, weight) each); a reward
    that is not a finite number stops the stage, naming `key`, the function and the sample (it
    would poison every advantage of its group, every choice of best and worst)."""
    total = 0.0
    for fn, kwargs, weight in rules:
        value = fn(prompt, completion, answer, **kwargs)
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValueError(
                f"{key}: {fn.__module__}.{fn.__name__} returned {value!r} (not a finite number) for "
                f"prompt {prompt!r}, completion {completion!r}, answer {answer!r}"
            )
        total += weight * value
    return total
