"""Reward functions by name or import path."""

import itertools
import math
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

import pytest

from alignflow.job.rewards import closeness, exact_match, extract_answer, format_reward, gold_answer, majority_answer, pass_at_k, resolve, same_answer


@pytest.mark.parametrize("completion, score", [("42", 1.0), (" 42.0", 1.0), ("42 is it", 1.0), ("41", 0.0), ("", 0.0), ("-42", 0.0)])
def test_exact_match_reads_the_demo_answers(completion, score):
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
    assert resolve("alignflow.job.rewards:format_reward") is format_reward
    with pytest.raises(ValueError, match="not one of"):
        resolve("exactmatch")
    with pytest.raises(ValueError, match="cannot import"):
        resolve("no_such_module:fn")


# math-verify's own regression cases (huggingface/Math-Verify tests/test_all.py at cf14bc4,
# `compare_strings(gold, pred)`), the gold written as a dataset holds it (no $...$)
MATH_VERIFY_CASES = [
    ("-5", "-5", 1.0),
    ("7425000", "7,425,000", 1.0),
    ("1000", "1000.0", 1.0),
    ("0.4", ".4", 1.0),
    ("2", "AZYUK2A", 0.0),
    ("10/9", "\\frac{10}{9}", 1.0),
    ("-10/9", "-\\frac{10}{9}", 1.0),
    ("9", "Answer \\[ 9 \\]", 1.0),
    ("10", "Answer \\( (9+1) \\)", 1.0),
    ("1/3", "$\\frac13 $", 1.0),
    ("\\sqrt{3}", "$\\sqrt3 $", 1.0),
    ("1/3", "$k = \\frac{1}{3}$", 1.0),
    ("1/3", "$\\boxed{\\frac{1}{3}}$", 1.0),
    ("[0,9)", "$[0,1)$", 0.0),
    ("(0,9)", "$[0,9)$", 0.0),
    ("28\\%", "28 percent", 1.0),
    ("0.28", "28", 0.0),
    ("28", "28/100", 0.0),
    ("\\frac{14}{3}", r"$f(-2)+f(-1)+f(0)=\frac{-8}{-4}+\frac{-5}{-3}+\frac{-2}{-2}=2+\frac{5}{3}+1=\boxed{\frac{14}{3}}$", 1.0),
    ("2-2p", "Since $x<2$, it follows that $|x-2|=2-x$. If $2-x=p$, then $x=2-p$. Thus $x-p=\\boxed{2-2p}$.", 1.0),
]


@pytest.mark.parametrize("gold, completion, score", MATH_VERIFY_CASES)
def test_exact_match_decides_as_math_verify_does(gold, completion, score):
    assert exact_match("", completion, gold) == score


@pytest.mark.parametrize(
    "gold, completion, score",
    [
        ("72", "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether in April and May.\n#### 72", 1.0),  # GSM8K train[0]
        ("72", "She sold 48 in April and 24 in May, 72 in all. The answer is 72", 1.0),
        ("72", "48 + 24 = 73", 0.0),  # the answer is the last expression's value, not the first number
        ("\\frac{1}{2}", "So the probability is \\boxed{\\frac{2}{4}}.", 1.0),
        ("\\frac{1}{2}", "\\boxed{0.5}", 1.0),
        ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}", 0.0),
        ("2\\sqrt{2}", "The distance is $\\sqrt{8}$.", 1.0),
        ("3\\pi", "$\\boxed{3\\pi}$", 1.0),
    ],
)
def test_gsm8k_and_math_style_answers(gold, completion, score):
    assert exact_match("", completion, gold) == score


def test_exact_match_off_the_main_thread():
    """math-verify's signal.alarm bound refuses threads; off the main thread it runs unbounded."""
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(exact_match, "", "\\boxed{\\frac{84}{2}}", "42").result() == 1.0


def test_majority_answer_groups_equal_answers():
    """1/2, 0.5 and 2/4 are one answer with three votes against 1/3's two; unparsed ones do not vote."""
    votes = [extract_answer(t) for t in ("$\\frac{1}{3}$", "0.5", "no idea", "1/3", "\\boxed{2/4}", "$\\frac{1}{2}$")]
    assert same_answer(gold_answer("1/2"), majority_answer(votes))
    assert same_answer(gold_answer("1/3"), majority_answer(votes[:4]))  # 1/3 twice, 0.5 once
    assert same_answer(gold_answer("1/3"), majority_answer(votes[:2]))  # a tie: the first seen
    assert majority_answer([extract_answer("no idea")]) == []


@pytest.mark.parametrize(
    "n, c, k, expected",
    [(1, 1, 1, 1.0), (1, 0, 1, 0.0), (10, 3, 1, 0.3), (5, 2, 2, 0.7), (4, 1, 4, 1.0), (4, 0, 4, 0.0), (10, 1, 5, 0.5), (6, 3, 2, 0.8)],
)
def test_pass_at_k_worked_numbers(n, c, k, expected):
    """By hand: 1 - C(n-c, k)/C(n, k); e.g. n=5, c=2, k=2: 1 - 3/10; n=6, c=3, k=2: 1 - 3/15."""
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("n, c, k", [(6, 2, 3), (7, 1, 4), (8, 5, 2), (5, 0, 2)])
def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_sample(n, c, k):
    """The estimator's meaning, counted: of all k-subsets of n samples (c correct), the share holding one."""
    subsets = list(itertools.combinations([True] * c + [False] * (n - c), k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(map(any, subsets)) / len(subsets), abs=1e-12)


def test_pass_at_k_stays_exact_where_binomials_overflow_floats():
    """n=2000: C(2000, 1000) ~ 1e600 overflows a float; the exact rational agrees to 1e-12."""
    for c, k in [(3, 100), (1, 1000), (40, 10)]:
        exact = 1 - Fraction(math.comb(2000 - c, k), math.comb(2000, k))
        assert pass_at_k(2000, c, k) == pytest.approx(float(exact), abs=1e-12)
