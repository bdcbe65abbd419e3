"""The Gluon sm_90 logits kernel (``glm_dsa.kernels.mqa_logits_gluon``) against the oracle.

Gluon kernels do not run in Triton's CPU interpreter: on the CPU only the ahead-of-time sm_90
compile is checked (when the installed Triton is one the kernel was tested with); the ``cuda``
tests run it on an sm_90 GPU with DeepGEMM's metric (exact ``-inf`` masks, ``calc_diff``), at
ragged edge shapes, through the harness, and at GLM-5.3 shapes beside the Triton kernel.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

from glm_dsa import oracle, testing  # noqa: E402
from glm_dsa.kernels import mqa_logits  # noqa: E402
from glm_dsa.kernels.sparse_mla import GLUON_TESTED_TRITON  # noqa: E402
from test_kernels_indexer import (  # noqa: E402
    _assert_logits_close,
    _causal_chunk,
    _inputs,
    _windows,
)

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
TESTED = triton.__version__ in GLUON_TESTED_TRITON
needs_gluon = pytest.mark.skipif(not (SM90 and TESTED),
                                 reason="needs an sm_90 GPU and a Triton in GLUON_TESTED_TRITON")
_RAN_GLUON = []


def _gluon_logits(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits=True, max_seqlen_k=0,
                  config=None):
    """``fp8_mqa_logits``'s checks, then the Gluon kernel (the Triton one for shapes it
    refuses, which the harness may draw); ``config``: None (``CONFIG``) or ``"four"``
    (``FOUR_CONSUMERS``, issue 43's schedule)."""
    from glm_dsa.kernels.mqa_logits_gluon import launch_mqa_logits_gluon, shape_refusal

    mqa_logits.check_mqa_logits_call(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits,
                                     max_seqlen_k)
    launch = mqa_logits.launch_mqa_logits
    if shape_refusal(q.shape[1], q.shape[2]) is None:
        launch = launch_mqa_logits_gluon
        _RAN_GLUON.append(q.shape)
        return launch(q, kv[0], kv[1], weights, cu_seqlen_ks.to(torch.int32),
                      cu_seqlen_ke.to(torch.int32), clean_logits, max_seqlen_k,
                      config=_four_consumers() if config == "four" else None)
    return launch(q, kv[0], kv[1], weights, cu_seqlen_ks.to(torch.int32),
                  cu_seqlen_ke.to(torch.int32), clean_logits, max_seqlen_k)


def _four_consumers():
    from glm_dsa.kernels.mqa_logits_gluon import FOUR_CONSUMERS

    return FOUR_CONSUMERS



_AOT = """
import json, sys
from glm_dsa.kernels.mqa_logits_gluon import compile_sm90
c = compile_sm90(H=int(sys.argv[1]), clean=sys.argv[2] == "1", compressed=sys.argv[3] == "1",
                 candidates=sys.argv[4] == "1", config=json.loads(sys.argv[5]))
ptx = c.asm["ptx"]
print(json.dumps({"shared": c.metadata.shared, "wgmma": ptx.count("wgmma.mma_async"),
                  "tma": ptx.count("cp.async.bulk.tensor"), "atom": ptx.count("atom."),
                  "setmaxnreg": ptx.count("setmaxnreg")}))
"""


@pytest.mark.skipif(not TESTED, reason=f"AOT check needs triton in {GLUON_TESTED_TRITON}")
@pytest.mark.parametrize("config", [None, "four"])
@pytest.mark.parametrize("H, clean, compressed, candidates",
                         [(32, True, False, False), (64, False, False, False),
                          (32, False, True, False), (32, False, False, True)])
def test_gluon_logits_kernel_compiles_for_sm90_within_shared_memory(H, clean, compressed,
                                                                    candidates, config):
    # A fresh interpreter without TRITON_INTERPRET (conftest sets it on the CPU), no GPU needed.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cfg = _four_consumers() if config == "four" else None
    args = [str(H), str(int(clean)), str(int(compressed)), str(int(candidates)), json.dumps(cfg)]
    done = subprocess.run([sys.executable, "-c", _AOT, *args], env=env, capture_output=True,
                          text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    info = json.loads(done.stdout.strip().splitlines()[-1])
    assert info["shared"] <= 232_448  # sm_90's per-block opt-in maximum (227 KB)
    assert info["wgmma"] > 0 and info["tma"] > 0  # tensor cores; TMA loads
    assert info["setmaxnreg"] > 0  # the partitions' register budgets took effect
    assert (info["atom"] > 0) == candidates  # the candidates' slot counters


def test_gluon_logits_refusals():
    from glm_dsa.kernels.mqa_logits_gluon import gluon_refusal, shape_refusal

    assert all(shape_refusal(h, 128) is None for h in (8, 16, 32, 64, 128))
    assert all(shape_refusal(h, 128) is not None for h in (4, 24, 256))
    assert shape_refusal(32, 64) is not None
    q = torch.zeros(4, 32, 128, dtype=torch.float8_e4m3fn)
    k = torch.zeros(16, 128, dtype=torch.float8_e4m3fn)
    assert gluon_refusal(q, k) is not None  # the CPU (or its interpreter)
    if SM90 and TESTED:
        qc, kc = q.cuda(), k.cuda()
        assert gluon_refusal(qc, kc) is None
        assert gluon_refusal(qc[:, :24], kc) is not None  # 24 heads
        assert gluon_refusal(qc, kc[:, :64]) is not None  # D = 64, and not contiguous


@pytest.mark.parametrize("bad", [{"consumers": 3}, {"row_groups": 4}, {"block_n": 512},
                                 {"consumers": 4, "block_n": 64}, {"gates": True}])
def test_gluon_logits_refuse_a_schedule_the_kernel_lacks_before_any_compute(bad):
    from glm_dsa.kernels.mqa_logits_gluon import launch_mqa_logits_gluon

    q = torch.zeros(4, 32, 128, dtype=torch.float8_e4m3fn)
    k = torch.zeros(16, 128, dtype=torch.float8_e4m3fn)
    ks = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="config|consumers|block_n"):
        launch_mqa_logits_gluon(q, k, torch.ones(16), torch.ones(4, 32), ks, ks + 16, True, 0,
                                config=bad)


@pytest.mark.cuda
@needs_gluon
@pytest.mark.parametrize(
    "S, H, N, kind",
    [
        (37, 32, 300, "causal"),
        (23, 32, 170, "random"),
        (1, 64, 40, "causal"),
        (50, 64, 1000, "random"),
        (300, 8, 2049, "random"),  # 32 rows a block, a ragged last key tile
        (17, 128, 513, "causal"),  # one row a consumer
        (9, 16, 200_003, "random"),  # one row block: its columns split over the SMs
    ],
)
@pytest.mark.parametrize("mode", ["clean", "unclean", "compressed"])
@pytest.mark.parametrize("config", [None, "four"])
def test_gluon_logits_match_oracle(S, H, N, kind, mode, config):
    q, k, k_scale, w = _inputs(S, H, 128, N, seed=S + H)
    ks, ke = _windows(kind, S, N, seed=N)
    if mode == "clean":
        ref = oracle.fp8_mqa_logits(q, (k, k_scale), w, ks, ke)
        _assert_logits_close(_gluon_logits(q, (k, k_scale), w, ks, ke, config=config), ref)
    elif mode == "unclean":
        ref = oracle.fp8_mqa_logits(q, (k, k_scale), w, ks, ke)
        out = _gluon_logits(q, (k, k_scale), w, ks, ke, clean_logits=False, config=config)
        cols = torch.arange(N, device=ks.device)
        inside = (cols >= ks[:, None].long()) & (cols < ke[:, None].long())
        assert oracle.calc_diff(out[inside], ref[inside]) <= 5e-6
    else:
        width = int((ke - ks).max()) + 3
        ref = oracle.fp8_mqa_logits(q, (k, k_scale), w, ks, ke, False, width)
        _assert_logits_close(_gluon_logits(q, (k, k_scale), w, ks, ke, False, width,
                                           config=config), ref)


@pytest.mark.cuda
@needs_gluon
def test_gluon_logits_pass_the_harness_at_glm_shapes():
    _RAN_GLUON.clear()
    testing.check_kernel("fp8_mqa_logits", _gluon_logits, cases=20, device="cuda",
                         shapes="glm-5.3")
    assert _RAN_GLUON, "no case took the Gluon kernel"


@pytest.mark.cuda
@needs_gluon
@pytest.mark.parametrize("S, N, H", [(2048, 32768, 32), (1024, 65536, 64)])
@pytest.mark.parametrize("config", [None, "four"])
def test_gluon_logits_at_glm_shapes_match_oracle_and_triton(S, N, H, config):
    q, k, k_scale, w = _inputs(S, H, 128, N, seed=41)
    ks, ke = _causal_chunk(S, N)
    ref = oracle.fp8_mqa_logits(q, (k, k_scale), w, ks, ke)
    out = _gluon_logits(q, (k, k_scale), w, ks, ke, config=config)
    _assert_logits_close(out, ref)
    triton_out = mqa_logits.launch_mqa_logits(q, k, k_scale, w, ks, ke, True, 0)
    _assert_logits_close(out, triton_out)


def _gluon_candidates(q, k, k_scale, w, ks, ke, thr, cand, config=None):
    from glm_dsa.kernels.mqa_logits_gluon import launch_mqa_candidates_gluon
    from glm_dsa.kernels.topk import COUNTERS

    counters = torch.zeros((q.shape[0], COUNTERS), dtype=torch.int32, device="cuda")
    keys, cols = launch_mqa_candidates_gluon(
        q, k, k_scale, w, ks, ke, thr, counters, cand,
        config=_four_consumers() if config == "four" else None)
    return keys, cols, counters[:, 0]


def _decode(keys):
    """The float32 scores of ``order_keys`` bits (its inverse, as test_kernels_indexer)."""
    positive = keys < 0  # top bit set: a non-negative score
    return torch.where(positive, keys ^ torch.iinfo(torch.int32).min, ~keys).view(torch.float32)


@pytest.mark.cuda
@needs_gluon
@pytest.mark.parametrize("S, H, N, kind", [(37, 32, 3000, "causal"), (50, 64, 1000, "random"),
                                           (9, 16, 200_003, "random")])
@pytest.mark.parametrize("config", [None, "four"])
def test_gluon_candidates_at_minus_inf_keep_each_window_entry_with_its_logit(S, H, N, kind,
                                                                            config):
    q, k, k_scale, w = _inputs(S, H, 128, N, seed=S)
    ks, ke = _windows(kind, S, N, seed=N)
    width = max(1, int((ke - ks).max()))
    thr = torch.full((S,), float("-inf"), device="cuda")
    keys, cols, count = _gluon_candidates(q, k, k_scale, w, ks, ke, thr, width, config)
    assert torch.equal(count, (ke - ks).to(torch.int32))
    logits = _gluon_logits(q, (k, k_scale), w, ks, ke, config=config)
    for m in range(S):
        n = int(ke[m] - ks[m])
        seen = cols[m, :n].long()
        assert torch.equal(seen.sort().values, torch.arange(n, device="cuda")), m  # each once
        # The same epilogue as the logits kernel: bitwise its logits.
        assert torch.equal(_decode(keys[m, :n]), logits[m, int(ks[m]) + seen]), m


@pytest.mark.cuda
@needs_gluon
@pytest.mark.parametrize("S, H, N", [(64, 32, 40_000), (16, 64, 9000)])
def test_gluon_candidates_keep_what_reaches_the_threshold_and_count_the_overflow(S, H, N):
    q, k, k_scale, w = _inputs(S, H, 128, N, seed=H)
    ks, ke = _causal_chunk(S, N)
    logits = _gluon_logits(q, (k, k_scale), w, ks, ke)
    thr = logits.float().quantile(0.99, dim=1)
    expected = logits >= thr[:, None]
    cand = int(expected.sum(1).max())
    keys, cols, count = _gluon_candidates(q, k, k_scale, w, ks, ke, thr, cand)
    assert torch.equal(count, expected.sum(1).to(torch.int32))
    for m in range(S):
        n = int(count[m])
        assert sorted(cols[m, :n].tolist()) == expected[m].nonzero().flatten().tolist(), m
    # Fewer slots than entries: all are counted, the slots hold a subset of them.
    small = max(1, cand // 4)
    keys, cols, count2 = _gluon_candidates(q, k, k_scale, w, ks, ke, thr, small)
    assert torch.equal(count2, count)
    for m in range(S):
        got = cols[m, :min(small, int(count[m]))].tolist()
        assert len(set(got)) == len(got) and all(bool(expected[m, j]) for j in got), m
