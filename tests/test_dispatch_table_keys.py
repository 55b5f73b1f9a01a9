"""The dispatch table's M and DxF keys: one spelling each, so no measured M or shape can have
two entries of which lookups silently read one."""

import pytest
from helpers import dispatch_table

from swiglu_train.ops import dispatch
from swiglu_train.ops.dispatch import DispatchTable, DispatchTableError


@pytest.mark.parametrize(
    "by_m",
    [
        {"16": "gated", "016": "cublas"},  # M = 16 twice
        {"\u00b2": "gated"},  # a superscript two: isdigit() but no int()
        {"\u0661\u0666": "gated", "16": "cublas"},  # Arabic-Indic 16: int() reads it as 16
    ],
)
def test_an_m_key_spelled_another_way_is_refused(by_m):
    table = dispatch_table({"8x8": {"mlp": by_m}})
    with pytest.raises(DispatchTableError, match=r"dispatch table <table>: shapes\.8x8\.mlp\."):
        DispatchTable.from_dict(table)


def test_a_shape_key_in_other_digits_is_refused():
    table = dispatch_table({"8x16": {"mlp": {1: "gated"}}, "8x1\u0666": {"mlp": {1: "cublas"}}})
    with pytest.raises(DispatchTableError, match=r"shapes\.8x1"):
        DispatchTable.from_dict(table)


def test_plain_keys_still_load():
    table = DispatchTable.from_dict(dispatch_table({"8x16": {"mlp": {1: "gated", 16: "cublas"}}}))
    with dispatch.use_table(table):
        assert [dispatch.choose("mlp", 8, 16, m) for m in (1, 16)] == ["gated", "cublas"]
