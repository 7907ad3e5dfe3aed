import numpy as np
import pytest

from rlbuffers import FieldError, FieldSpec
from rlbuffers.spec import check_batch, check_row


def test_ragged_flag_and_row_shape():
    assert FieldSpec((None, 3), "int32").ragged
    assert FieldSpec((None, 3), "int32").row_shape == (3,)
    assert not FieldSpec((4, 84, 84), "uint8").ragged
    assert FieldSpec((4, 84, 84), "uint8").item_bytes == 4 * 84 * 84


@pytest.mark.parametrize("shape", [(3, None), (-1,), (2.5,)])
def test_bad_shapes_rejected(shape):
    with pytest.raises(FieldError, match="shape"):
        FieldSpec(shape, "float32")


def test_object_dtype_rejected():
    with pytest.raises(FieldError, match="dtype"):
        FieldSpec((), object)


def test_same_kind_cast_accepted_kind_change_refused():
    spec = FieldSpec((2,), "float32")
    assert check_row("obs", spec, np.array([1.0, 2.0])).dtype == np.float32
    with pytest.raises(FieldError, match=r"field 'obs': expected dtype float32, got complex128"):
        check_row("obs", spec, np.array([1j, 2j]))
    with pytest.raises(FieldError, match=r"field 'a': value 1.5 \(float64\) does not fit dtype "
                       "int32 without loss"):
        check_row("a", FieldSpec((), "int32"), 1.5)


def test_shape_error_names_expected_and_actual():
    with pytest.raises(FieldError) as e:
        check_row("obs", FieldSpec((4, 84, 84), "uint8"), np.zeros((84, 84, 4), np.uint8))
    assert str(e.value) == "field 'obs': expected shape (4, 84, 84) uint8, got (84, 84, 4) uint8"


def test_batch_size_mismatch():
    with pytest.raises(FieldError, match="expected batch size 3, got 2"):
        check_batch("r", FieldSpec((), "float32"), np.zeros(2), 3)


def test_ragged_batch_needs_sequence():
    with pytest.raises(FieldError, match="ragged field expects a sequence"):
        check_batch("t", FieldSpec((None,), "int32"), np.zeros((2, 3), np.int32), 2)


def test_spec_dict_round_trip():
    spec = FieldSpec((None, 2), "float64")
    assert FieldSpec.from_dict(spec.to_dict()) == spec
