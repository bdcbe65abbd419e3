"""Triton kernels with the oracle's signatures (the triton backend); Triton is imported only here."""

from glm_dsa.kernels.sparse_mla import flash_mla_sparse_fwd, sparse_mla_fwd_fp8  # noqa: F401
