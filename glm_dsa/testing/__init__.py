"""Check anyone's kernel against the oracle: ``check_kernel(contract, fn)``; golden vectors
(``glm_dsa.testing.golden``) written from the same case table.

``glm_dsa.testing.strategies`` offers the same inputs as hypothesis strategies (hypothesis is
a test-only dependency, imported there only). Names are loaded on first use, so that the
``glm-dsa`` command can register ``check`` without importing torch.
"""

import importlib

_EXPORTS = {
    "CONTRACTS": "glm_dsa.testing.cases",
    "SHAPES": "glm_dsa.testing.cases",
    "CONVENTIONS": "glm_dsa.testing.cases",
    "Case": "glm_dsa.testing.cases",
    "clauses": "glm_dsa.testing.cases",
    "edge_case_names": "glm_dsa.testing.cases",
    "make_case": "glm_dsa.testing.cases",
    "CheckReport": "glm_dsa.testing.check",
    "check_case": "glm_dsa.testing.check",
    "check_kernel": "glm_dsa.testing.check",
    "DEFAULT_TIMEOUT_S": "glm_dsa.testing.check",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'glm_dsa.testing' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
