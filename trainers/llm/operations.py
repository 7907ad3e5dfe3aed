"""The arithmetic operations a math question names, whatever its wording: symbols between
operands (spaced or not: ``45 + 23``, ``45+23``, ``3×4``) and operation words (``add``,
``plus``, ``sum``; ``minus``, ``subtract``, ``difference``; ``times``, ``multiply``,
``product``; ``divide``, ``quotient``). Shared by the held-out filter's operand key
(``trainers.llm.evaluation.content_keys``) and CRSP's proposal verifier
(``trainers.crsp.verify``)."""

from __future__ import annotations

import re

#: A binary operator symbol: after an operand (a digit or ``)``, spaces allowed) and before
#: one (a digit or ``(``, with an optional sign). A sign (``4 + -9``, ``-(3 + 4)``) is not one.
BINARY = re.compile(r"(?<=[\d)])\s*([-+*/×÷])(?=\s*[-+]?\s*[\d(])")

#: Operation words (whole words, lower case) -> the operator symbol they name.
WORDS: dict[str, str] = {
    **dict.fromkeys(("add", "adds", "added", "adding", "addition", "plus", "sum", "total"),
                    "+"),
    **dict.fromkeys(("minus", "subtract", "subtracts", "subtracted", "subtracting",
                     "subtraction", "difference"), "-"),
    **dict.fromkeys(("times", "multiply", "multiplies", "multiplied", "multiplying",
                     "multiplication", "product"), "*"),
    **dict.fromkeys(("divide", "divides", "divided", "dividing", "division", "quotient"),
                    "/"),
}
_WORD = re.compile(r"[a-z]+")
#: The two spellings of a symbol that mean the same operation.
_CANONICAL = {"×": "*", "÷": "/"}


def symbol_operators(text: str) -> list[str]:
    """The binary operator symbols of ``text`` in order (``×`` read as ``*``, ``÷`` as
    ``/``): ``"What is 45+23?"`` -> ``["+"]``, ``"4 + -9"`` -> ``["+"]``."""
    return [_CANONICAL.get(op, op) for op in BINARY.findall(text)]


def word_operators(text: str) -> list[str]:
    """The operator symbols named by operation words of ``text`` in order (case-insensitive,
    whole words): ``"Add 45 and 23"`` -> ``["+"]``, ``"the product of 3 and 4"`` ->
    ``["*"]``."""
    return [WORDS[w] for w in _WORD.findall(text.lower()) if w in WORDS]


def operations(text: str) -> tuple[str, ...]:
    """The distinct operations ``text`` names, by symbol or by word, sorted: ``"Calculate 45
    + 23."``, ``"What is 45+23?"``, ``"Add 45 and 23"`` and ``"What is the sum of 45 and
    23?"`` all give ``("+",)``."""
    return tuple(sorted(set(symbol_operators(text)) | set(word_operators(text))))
