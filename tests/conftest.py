import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# The CI machine has 2 slow cores: bound the examples and never fail on timing.
settings.register_profile(
    "ci",
    max_examples=15,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Without a GPU the Triton kernels (glm_dsa.kernels) run in Triton's CPU interpreter, which
# reads this variable when triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def _peers_missing() -> str | None:
    """Why the peer kernels cannot run here, or None."""
    from glm_dsa import peers

    missing = [m for m in (peers.DEEP_GEMM, peers.FLASH_MLA) if not peers.available(m)]
    return f"needs {' and '.join(missing)} (the peer kernels) importable" if missing else None


def pytest_collection_modifyitems(config, items):
    have_cuda = torch.cuda.is_available()
    n_gpus = torch.cuda.device_count() if have_cuda else 0
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA GPUs")
    if any("peers" in item.keywords for item in items):
        why = _peers_missing()
        for item in items:
            if why and "peers" in item.keywords:
                item.add_marker(pytest.mark.skip(reason=why))
    for item in items:
        if "cuda" in item.keywords and not have_cuda:
            item.add_marker(skip_cuda)
        if "multigpu" in item.keywords and n_gpus < 2:
            item.add_marker(skip_multi)


@pytest.fixture(autouse=True)
def shuffled_programs(request, monkeypatch):
    """Triton's interpreter runs a launch's programs one after another in grid order, which a
    GPU never promises: a kernel whose result leans on one program finishing before another
    starts (a slot counter shared across a row's column splits, a "last program reduces") would
    pass every CPU test. In every test the interpreted programs of each launch run in another
    order, a seeded permutation of the grid (the seed from the test's id, so a failure repeats).
    Any order is legal; on a GPU it changes nothing."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import zlib

    import numpy as np
    from triton.runtime import interpreter

    rng = np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
    builder = interpreter.InterpreterBuilder
    set_dim, set_idx = builder.set_grid_dim, builder.set_grid_idx
    grid: dict = {}

    def set_grid_dim(self, nx, ny, nz):
        grid["dims"], grid["order"] = (nx, ny, nz), rng.permutation(nx * ny * nz)
        set_dim(self, nx, ny, nz)

    def set_grid_idx(self, x, y, z):
        # The interpreter walks (x, y, z) in row-major order: program i runs grid["order"][i].
        _, ny, nz = grid["dims"]
        j = int(grid["order"][(x * ny + y) * nz + z])
        set_idx(self, j // (ny * nz), j // nz % ny, j % nz)

    monkeypatch.setattr(builder, "set_grid_dim", set_grid_dim)
    monkeypatch.setattr(builder, "set_grid_idx", set_grid_idx)


@pytest.fixture
def shuffled_atomics(monkeypatch):
    """Triton's interpreter serves the lanes of one atomic read-modify-write in lane order, so a
    buffer whose slots come from ``atomic_add`` fills in column order on the CPU, which a GPU's
    warps never promise: a missing sort of such a buffer passes every CPU test. Under this
    fixture each such op serves its lanes in a seeded random order instead (any order is legal:
    the lanes of one op are unordered, whatever its memory order). Its value reseeds
    (``shuffled_atomics(seed)``). On a GPU it changes nothing."""
    import numpy as np

    state = {"rng": np.random.default_rng(0)}

    def reseed(seed: int) -> None:
        state["rng"] = np.random.default_rng(seed)

    if os.environ.get("TRITON_INTERPRET") != "1":
        return reseed
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_atomic_rmw

    def create_atomic_rmw(self, rmw_op, ptr, val, mask, *rest):
        shape, n = ptr.data.shape, ptr.data.size
        if n <= 1:
            return original(self, rmw_op, ptr, val, mask, *rest)
        order = state["rng"].permutation(n)

        def served(h):
            data = np.ascontiguousarray(h.data.reshape(-1)[order])
            return interpreter.TensorHandle(data, h.dtype)

        old = original(self, rmw_op, served(ptr), served(val), served(mask), *rest)
        back = np.empty_like(old.data.reshape(-1))
        back[order] = old.data.reshape(-1)
        return interpreter.TensorHandle(back.reshape(shape), old.dtype)

    monkeypatch.setattr(builder, "create_atomic_rmw", create_atomic_rmw)
    return reseed
