"""Hypothesis strategies for the inputs of every kernel contract (sizes shrink).

The same builders as ``check_kernel``: sizes are drawn from hypothesis, tensor values from a
drawn seed. Use with ``check_case``::

    from hypothesis import given
    from glm_dsa.testing import check_case
    from glm_dsa.testing.strategies import cases

    @given(cases("fp8_mqa_logits"))
    def test_my_logits(case):
        check_case(case, my_kernel.fp8_mqa_logits)

Importing this module needs hypothesis (a test-only dependency); ``glm_dsa.testing`` does not.
"""

from __future__ import annotations

from hypothesis import strategies as st

from glm_dsa.testing.cases import Case, build_case, edge_case_names

__all__ = ["cases"]


class _DrawPick:
    def __init__(self, draw):
        self._draw = draw

    def int(self, lo: int, hi: int) -> int:
        return self._draw(st.integers(lo, hi))

    def choice(self, options: tuple):
        return self._draw(st.sampled_from(options))


def cases(contract: str, shapes: str = "small", *, edges: bool = True,
          **kernel_options) -> st.SearchStrategy[Case]:
    """Cases of ``contract``: random ones, and (``edges=True``) its named edge cases too.

    ``kernel_options`` pin arguments in every case, as in ``check_kernel``.
    """
    names = (None,) + (edge_case_names(contract) if edges else ())

    @st.composite
    def _case(draw) -> Case:
        edge = draw(st.sampled_from(names))
        data_seed = draw(st.integers(0, 2**32 - 1))
        name = edge or f"hypothesis data_seed={data_seed}"
        return build_case(contract, _DrawPick(draw), data_seed, shapes, edge, name, kernel_options)

    return _case()
