"""Math verifier: answer extraction and symbolic equivalence through math-verify, on and off the main thread."""

from __future__ import annotations

import logging
import threading

import pytest
from math_verify import parse

from rlplatform.rewards.math_verifier import extract_answer, math_verify


@pytest.mark.parametrize("completion, answer", [
    (r"Half of the pie is left, so the result is \boxed{\frac{1}{2}}.", "0.5"),
    ("Dividing, the answer is 1/2.", r"\frac{1}{2}"),
    (r"Simplifying the root: $\boxed{2\sqrt{2}}$", r"\sqrt{8}"),
    ("First 3 apples, then 39 more: 42", "42"),
    (r"\boxed{\dfrac{3}{4}}", "0.75"),
    ("The final answer is $1,000$.", "1000"),
    (r"try \boxed{5} first; no: \boxed{x^2+2x+1}", "(x+1)^2"),
])
def test_equivalent_answers_score_one(make_sample, completion, answer):
    assert math_verify(make_sample(completion, answer=answer)) == 1.0


@pytest.mark.parametrize("completion, answer", [
    (r"\boxed{\frac{1}{3}}", "0.5"),
    ("The answer is 41.", "42"),
    ("I am not sure.", "42"),  # nothing to extract
    (r"\boxed{\frac{1}{2", "0.5"),  # unclosed box: falls back to the last number, 2
])
def test_wrong_or_missing_answers_score_zero(make_sample, completion, answer):
    assert math_verify(make_sample(completion, answer=answer)) == 0.0


@pytest.mark.parametrize("completion, extracted", [
    (r"so \boxed{\frac{a}{\sqrt{b}}} holds", r"\frac{a}{\sqrt{b}}"),  # nested braces
    (r"\boxed{1} or rather \boxed{2}", "2"),  # the last box
    ("We get 7, hence the answer is $x = 7$.", "x = 7"),
    ("7 then 8.5 then -3/4", "-3/4"),
    ("no digits here", None),
])
def test_extract_answer(completion, extracted):
    assert extract_answer(completion) == extracted


def test_scores_off_the_main_thread(make_sample):
    # math-verify's own timeout is SIGALRM-based and refuses to run in a thread...
    error = _in_thread(lambda: parse("$1$", parsing_timeout=5))
    assert isinstance(error, ValueError) and "threaded environment" in str(error)
    # ...so off the main thread the reward runs math-verify without it
    sample = make_sample(r"\boxed{2\sqrt{2}}", answer=r"\sqrt{8}")
    assert _in_thread(lambda: math_verify(sample)) == 1.0


def test_no_warning_that_math_verify_runs_without_its_own_timeout(make_sample, caplog, monkeypatch):
    """Off the main thread math-verify warns, once a process, that it has no timeout; the reward worker bounds the
    call, and a job's evaluator and reward workers printed the warning into its console."""
    from math_verify import grader, parser

    monkeypatch.setattr(parser, "TIMEOUT_WARNING_SHOWN", False)  # as in a fresh process
    monkeypatch.setattr(grader, "TIMEOUT_WARNING_SHOWN", False)
    with caplog.at_level(logging.WARNING):
        assert _in_thread(lambda: math_verify(make_sample("the answer is 42", answer="42"))) == 1.0
    assert not [r for r in caplog.records if "Timeout is disabled" in r.getMessage()]


def _in_thread(fn):
    """What `fn()` returns, or the exception it raises, when called on a new thread."""
    outcome = []

    def call():
        try:
            outcome.append(fn())
        except Exception as err:
            outcome.append(err)
    thread = threading.Thread(target=call)
    thread.start()
    thread.join()
    return outcome[0]
