"""Reward functions by name or import path."""

import pytest

from alignflow.rewards import closeness, exact_match, format_reward, resolve


@pytest.mark.parametrize("completion, score", [("42", 1.0), (" 42.0", 1.0), ("42 is it", 1.0), ("41", 0.0), ("", 0.0), ("-42", 0.0)])
def test_exact_match_compares_the_first_number(completion, score):
    assert exact_match("What is 40 + 2?", completion, "42") == score


def test_negative_answers_and_format():
    assert exact_match("What is 2 - 5?", "-3", "-3") == 1.0
    assert format_reward("", " -3 ", "") == 1.0 and format_reward("", "-3, I think", "") == 0.0


@pytest.mark.parametrize("completion, score", [("42", 1.0), ("44", 0.8), ("39 or so", 0.7), ("52", 0.0), ("90", 0.0), ("none", 0.0)])
def test_closeness_gives_partial_credit_within_scale(completion, score):
    assert closeness("What is 40 + 2?", completion, "42") == pytest.approx(score)
    assert closeness("", "45", "42", scale=3.0) == 0.0


def test_resolve_builtin_and_import_path():
    assert resolve("exact_match") is exact_match
    assert resolve("alignflow.rewards:format_reward") is format_reward
    with pytest.raises(ValueError, match="not one of"):
        resolve("exactmatch")
    with pytest.raises(ValueError, match="cannot import"):
        resolve("no_such_module:fn")
