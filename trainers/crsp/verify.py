"""The answer of a proposed arithmetic problem, recomputed from its text, so that a proposal's
stated answer can be confirmed by the task's verifier instead of taken on trust.

A proposal's problem is *verifiable* when its arithmetic is explicit:

- an expression (``What is 45+23?``, ``Calculate (3 + 4) * 2.``): the one run of numbers,
  operator symbols and parentheses with a binary operator in it, holding every number of the
  problem; evaluated exactly (``fractions.Fraction``, ``+ - * /`` and signs only, through
  ``ast``: never ``eval``);
- or two numbers and one named operation (``trainers.llm.operations.WORDS``): ``Add 45 and
  23``, ``What is the sum of 45 and 23?``, ``the product of 6 and 7``, ``12 minus 5``,
  ``subtract 5 from 12`` (12 - 5), ``the difference between 5 and 12`` (7: a difference is
  not negative), ``divide 12 by 4`` / ``the quotient of 12 and 4``.

Anything else (a story with no operation named, several operations, a third number, an
answer that is not an integer or a short decimal, a division by zero) has no recomputed
answer: such a proposal earns no learnability reward, however well formed. That is the point
(issue 49): CRSP's proposer had drifted to word problems with made-up answers ("Jones has 20
jellybeans. How many of them are there?" / 20), well formed but never confirmed. As in
Absolute Zero (Zhao et al. 2025, arXiv 2505.03335, Sec. 3.3, where a proposed program is run
by the Python executor to obtain its gold output), the environment, not the proposer,
supplies the answer the solver is scored against."""

from __future__ import annotations

import ast
import re
from fractions import Fraction
from typing import Any

from trainers.llm.operations import BINARY, symbol_operators, word_operators
from trainers.llm.tasks import numeric_match

NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?")
#: A run of expression characters (digits, decimal points, operators, parentheses, spaces).
SPAN = re.compile(r"[-+*/×÷()\d.\s]+")
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
        ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}


def evaluate_expression(text: str) -> Fraction | None:
    """The exact value of an arithmetic expression of numbers, ``+ - * / × ÷``, signs and
    parentheses (None: anything else, or a division by zero)."""
    src = text.replace("×", "*").replace("÷", "/")
    try:
        tree = ast.parse(src.strip(), mode="eval")
        return _value(tree.body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return None


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(str(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _value(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    raise ValueError(f"not arithmetic: {ast.dump(node)[:40]}")


def as_answer(value: Fraction | None, places: int = 6) -> str | None:
    """``value`` written as reasoning-gym writes answers: an integer as ``str(int)``, else a
    decimal of at most ``places`` places when it is one exactly (None: otherwise)."""
    if value is None:
        return None
    if value.denominator == 1:
        return str(value.numerator)
    scaled = value * 10 ** places
    if scaled.denominator != 1:
        return None
    return f"{float(value):.{places}f}".rstrip("0")


def _expression_truth(problem: str, numbers: list[str]) -> Fraction | None:
    spans = [m.group(0) for m in SPAN.finditer(problem) if BINARY.search(m.group(0))]
    if len(spans) != 1:
        return None
    span = spans[0].strip().rstrip(".").strip()
    if sorted(NUMBER.findall(span)) != sorted(numbers):  # a number outside the expression
        return None
    return evaluate_expression(span)


def _word_truth(problem: str, numbers: list[str]) -> Fraction | None:
    ops = set(word_operators(problem))
    if len(numbers) != 2 or len(ops) != 1:
        return None
    a, b = (Fraction(n) for n in numbers)
    op, low = ops.pop(), problem.lower()
    if op == "+":
        return a + b
    if op == "*":
        return a * b
    if op == "-":
        if "difference" in low:
            return abs(a - b)
        if re.search(r"subtract\w*\s+-?[\d.]+\s+from\s", low):
            return b - a
        return a - b
    return None if b == 0 else a / b


def proposal_truth(problem: str) -> str | None:
    """The answer of a proposed problem recomputed from its text (module docstring), as an
    answer string (``"68"``, ``"2.5"``); None when the problem is not verifiable."""
    numbers = NUMBER.findall(problem)
    if len(numbers) < 2:
        return None
    if symbol_operators(problem):
        return as_answer(_expression_truth(problem, numbers))
    return as_answer(_word_truth(problem, numbers))


def verified_entry(problem: str, answer: str | None, score: Any = None
                   ) -> dict[str, Any] | None:
    """The reasoning-gym entry ``{"question", "answer", "metadata"}`` of a proposal whose
    stated ``answer`` the verifier confirms: the recomputed answer (:func:`proposal_truth`)
    scored by ``score(answer, entry)`` (the task's ``score_answer``; None: exact numeric
    equality, ``tasks.numeric_match``) is 1.0. None for a made-up answer, a problem that is
    not verifiable, or no answer."""
    truth = proposal_truth(problem)
    if truth is None or answer is None:
        return None
    entry = {"question": problem, "answer": truth, "metadata": {}}
    return entry if entry_score(score, answer, entry) == 1.0 else None


def entry_score(score: Any, answer: str | None, entry: dict[str, Any]) -> float:
    """``score(answer, entry)`` (the task's verifier) on a verified proposal's entry, 0.0
    without an answer; with ``score`` None, or a task whose verifier needs its own
    metadata (it raises on the entry), exact numeric equality with the entry's answer."""
    if not answer:
        return 0.0
    if score is not None:
        try:
            return float(score(answer, entry))
        except (KeyError, TypeError, ValueError):  # a verifier reading task metadata
            pass
    return numeric_match(answer, entry["answer"])
