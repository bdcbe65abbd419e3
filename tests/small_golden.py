"""A golden set of a few contracts only, written once per test module (the whole set takes ~30 s)."""

from __future__ import annotations

import pytest

from glm_dsa.testing import golden
from glm_dsa.testing.cases import CONTRACTS


def write_small_set(tmp_path_factory, contracts: tuple[str, ...]):
    """The path of a fresh golden directory holding ``contracts``' cases only."""
    path = tmp_path_factory.mktemp("golden") / "g"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(golden, "CONTRACTS", {c: CONTRACTS[c] for c in contracts})
        golden.write_golden(path)
    return path
