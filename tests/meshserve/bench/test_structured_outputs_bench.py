"""The structured-outputs benchmark's own parts: every case is a valid constraint, and
the comparison names the first differing position."""

from meshserve.bench.structured_outputs import CASES, compare, spec_of
from meshserve.sampling import SamplingParams, validate


def test_every_case_is_a_valid_constraint_of_its_kind():
    for kind, spec, _ in CASES:
        structured = spec_of(kind, spec)
        assert structured.kind == kind
        validate(SamplingParams(structured_output=structured), max_model_len=64, vocab_size=100)


def test_the_comparison_names_the_first_difference():
    assert compare([[1, 2, 3], [1, 2, 3], [1, 2], [4]], [[1, 2, 3], [1, 5, 3], [1, 2, 7], [4]]) == [
        {"equal": True, "first_difference": None}, {"equal": False, "first_difference": 1},
        {"equal": False, "first_difference": 2}, {"equal": True, "first_difference": None}]
