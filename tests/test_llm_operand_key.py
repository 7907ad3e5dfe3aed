"""The held-out filter's operand key on every wording (issue 49): unspaced operators and word
forms name the same operation as the spaced symbol, so a proposal written as "What is 45+23?"
or "Add 45 and 23" shares its key with the task's "Calculate 45 + 23." and cannot leak into
a held-out set (trainers/llm/operations.py, trainers/llm/evaluation.content_keys)."""

from __future__ import annotations

import pytest

from trainers.llm.evaluation import content_keys, overlap, training_keys
from trainers.llm.operations import operations, symbol_operators, word_operators


def operand_key(question):
    (key,) = [k for k in content_keys(question) if k[0] == "operands"]
    return key


SUM = "Calculate 45 + 23."


@pytest.mark.parametrize("question", [
    "What is 45+23?", "45+23=", "Add 45 and 23", "add 23 to 45.", "What is 45 plus 23?",
    "What is the sum of 45 and 23?", "Find the total of 23 and 45.", "Compute 23 + 45.",
    "Tom has 45 pens and adds 23 more. How many pens?"])
def test_word_and_unspaced_forms_share_the_key_of_the_spaced_sum(question):
    assert operand_key(question) == operand_key(SUM) == ("operands", (23.0, 45.0), ("+",))
    assert content_keys(question) & content_keys(SUM)


@pytest.mark.parametrize("question, op", [
    ("What is 45-23?", "-"), ("Subtract 23 from 45.", "-"), ("45 minus 23", "-"),
    ("What is the difference between 45 and 23?", "-"), ("What is 45*23?", "*"),
    ("Multiply 45 by 23.", "*"), ("What is 45 times 23?", "*"), ("the product of 45 and 23", "*"),
    ("What is 45×23?", "*"), ("Divide 45 by 23.", "/"), ("45 divided by 23", "/"),
    ("the quotient of 45 and 23", "/"), ("45÷23", "/"), ("45/23", "/")])
def test_each_operation_by_symbol_or_word(question, op):
    assert operand_key(question) == ("operands", (23.0, 45.0), (op,))
    assert operand_key(question) == operand_key(f"Calculate 45 {op} 23.")


def test_other_operations_or_numbers_do_not_share_the_key():
    assert not content_keys("Add 45 and 23") & content_keys("Calculate 45 * 23.")
    assert not content_keys("What is 45+24?") & content_keys(SUM)
    assert not content_keys("Subtract 23 from 45.") & content_keys(SUM)


def test_signs_are_not_operators():
    assert symbol_operators("4 + -9") == ["+"]
    assert symbol_operators("-( 4 + -9 )") == ["+"]
    assert operand_key("-( 4 + -9 )") == operand_key("4 + -9")
    assert symbol_operators("What is -5?") == []
    assert word_operators("Addison has 3 cats") == []  # whole words only


def test_operations_are_distinct_and_sorted():
    assert operations("What is the sum of 2+3 and 4?") == ("+",)
    assert operations("Add 3 to 4, then multiply by 2: (3 + 4) * 2") == ("*", "+")


def test_word_form_proposals_are_kept_out_of_a_held_out_set():
    proposals = [{"question": q} for q in ("Add 45 and 23", "What is 12+30?",
                                           "What is the product of 6 and 7?")]
    keys = training_keys(proposals)
    held = [{"question": q} for q in ("Calculate 45 + 23.", "Calculate 30 + 12.",
                                      "Calculate 7 * 6.", "Calculate 7 + 6.")]
    assert overlap(held, keys) == 3
    assert overlap(held[3:], keys) == 0
