"""glm_dsa.cp's host rules at their edges, without launching ranks: the splits with fewer
tokens than ranks, exactly as many, one more; a rank's local batch and its padding; the launch
refusals one step inside and outside (ranks, cores, GPUs, timeout)."""

from __future__ import annotations

import math

import pytest
import torch

from glm_dsa import cp
from glm_dsa.batch import ForwardBatch
from glm_dsa.cp import check_launch, dist_backend_for, launched_by_torchrun, split_rows


@pytest.mark.parametrize("n, cp_, split, want", [
    (1, 1, "interleave", [[0]]), (1, 2, "interleave", [[0], []]), (2, 2, "interleave", [[0], [1]]),
    (3, 2, "interleave", [[0, 2], [1]]), (2, 3, "interleave", [[0], [1], []]),
    (5, 2, "contiguous", [[0, 1, 2], [3, 4]]), (4, 2, "contiguous", [[0, 1], [2, 3]]),
    (1, 2, "contiguous", [[0], []]), (3, 4, "contiguous", [[0], [1], [2], []]),
    # zigzag: 2 cp blocks of n // (2 cp), the first n % (2 cp) one more; rank r: blocks r, 2cp−1−r.
    (8, 2, "zigzag", [[0, 1, 6, 7], [2, 3, 4, 5]]), (9, 2, "zigzag", [[0, 1, 2, 7, 8], [3, 4, 5, 6]]),
    (3, 2, "zigzag", [[0], [1, 2]]), (4, 2, "zigzag", [[0, 3], [1, 2]]), (1, 2, "zigzag", [[0], []]),
    (5, 1, "zigzag", [[0, 1, 2, 3, 4]]),
])
def test_split_edges(n, cp_, split, want):
    got = split_rows(n, cp_, split)
    assert [r.tolist() for r in got] == want
    assert all(r.dtype == torch.int64 for r in got)
    assert max(len(r) for r in got) <= -(-n // cp_)


@pytest.mark.parametrize("n, cp_, split, match", [
    (0, 2, "interleave", "n=0"), (2, 0, "interleave", "cp=0"), (2.0, 2, "interleave", "n=2.0"),
    (2, 2.0, "interleave", "cp=2.0"), (2, 2, "ring", "split='ring'"), (-1, 1, "zigzag", "n=-1"),
])
def test_split_refusals(n, cp_, split, match):
    with pytest.raises(ValueError, match=match):
        split_rows(n, cp_, split)


def test_a_ranks_local_batch_pads_with_empty_rows():
    batch = ForwardBatch.from_slots([2, 0], [3, 2], [torch.arange(10, 15), torch.arange(20, 22)])
    rows = torch.tensor([1, 3])  # request 0's second token, request 1's first
    local = cp._local_batch(batch, rows, 3)
    assert local.positions.tolist() == [3, 0, 0]
    assert local.out_slots.tolist() == [batch.out_slots[1].item(), batch.out_slots[3].item(), -1]
    assert local.ks.tolist() == [batch.ks[1].item(), batch.ks[3].item(), 0]
    assert local.ke.tolist() == [batch.ke[1].item(), batch.ke[3].item(), 0]
    assert local.cu_seqlens_q.tolist() == [0, 1, 2]  # one local row of each request
    assert torch.equal(local.kv_slots, batch.kv_slots) and local.extend_lens == batch.extend_lens
    none = cp._local_batch(batch, torch.tensor([], dtype=torch.int64), 2)
    assert none.positions.tolist() == [0, 0] and none.cu_seqlens_q.tolist() == [0, 0, 0]


def test_backend_and_torchrun_detection(monkeypatch):
    assert dist_backend_for("cpu") == "gloo" and dist_backend_for(torch.device("cuda")) == "nccl"
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.setenv(key, "0")
    assert launched_by_torchrun()
    monkeypatch.delenv("MASTER_ADDR")
    assert not launched_by_torchrun()


@pytest.mark.parametrize("nprocs, cores, ok", [(2, 2, True), (3, 2, False), (1, 1, True), (2, 1, False)])
def test_check_launch_cores(monkeypatch, nprocs, cores, ok):
    monkeypatch.setattr(cp, "usable_cores", lambda: cores)
    if ok:
        check_launch(nprocs, "cpu")
    else:
        with pytest.raises(ValueError, match=f"{nprocs} ranks on {cores} usable CPU core"):
            check_launch(nprocs, "cpu", label="--cp")
    check_launch(nprocs, "cpu", bound_by_cores=False)


@pytest.mark.parametrize("nprocs, gpus, ok", [(2, 2, True), (3, 2, False), (1, 0, False)])
def test_check_launch_gpus(monkeypatch, nprocs, gpus, ok):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    if ok:
        check_launch(nprocs, "cuda")
    else:
        with pytest.raises(ValueError, match=f"--cp: {nprocs} ranks need {nprocs} CUDA devices, torch sees {gpus}"):
            check_launch(nprocs, "cuda", label="--cp")


@pytest.mark.parametrize("nprocs", [0, -1, 1.0, "2"])
def test_check_launch_rank_counts(nprocs):
    with pytest.raises(ValueError, match="must be a positive number of ranks"):
        check_launch(nprocs, "cpu")


@pytest.mark.parametrize("timeout", [0, -1.0, math.inf, math.nan, "5", None])
def test_launch_refuses_bad_timeouts_before_starting(timeout):
    with pytest.raises(ValueError, match="timeout_s=.* must be a positive finite number of seconds"):
        cp.launch(print, 1, "cpu", timeout_s=timeout)


def test_rank_stalled_says_started_or_not():
    assert "made no progress for 5 s" in str(cp.RankStalled(1, 2, 5.0, started=True))
    assert "did not start within 120 s" in str(cp.RankStalled(0, 2, 120.0, started=False))
    assert cp.RANK_START_S == 120.0


@pytest.mark.parametrize("n, size, rank, real", [
    (5, 2, 0, 3), (5, 2, 1, 2), (4, 2, 1, 2), (1, 2, 1, 0), (3, 4, 3, 0), (7, 3, 2, 2),
])
def test_a_ranks_row_mask_marks_exactly_its_own_rows(n, size, rank, real):
    """The padding rows a rank adds to reach ``ceil(n / size)`` are masked; its own are not (the
    MoE combine zeroes the masked rows, the gather drops them)."""
    group = object.__new__(cp.CPGroup)  # the split's host rule only: no process group
    group.size, group.rank, group.split = size, rank, "interleave"
    batch = ForwardBatch.from_slots([0], [n], [torch.arange(n)])
    chunk = group.chunk(batch)
    assert chunk.row_mask.tolist() == [True] * real + [False] * (-(-n // size) - real)
    assert chunk.rows.tolist() == list(range(rank, n, size))
