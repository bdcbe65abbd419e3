"""What the paged cache refuses (issue 27): a NaN or inf latent row in every format, as the FP8
format always did, and, with ``track_writes``, reads of slots never written (which used to
return plausible zeros)."""

from __future__ import annotations

import pytest
import torch

from glm_dsa.cache import KV_DTYPES, KVCache
from glm_dsa.config import get_config

CONFIG = get_config("tiny")
WIDTH = CONFIG.kv_latent_dim  # 144


def _rows(n, seed=0):
    return torch.randn(n, WIDTH, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("column", [0, WIDTH - 1])  # in c, and in k_pe
def test_every_cache_format_refuses_a_nonfinite_row_and_stores_nothing(kv_dtype, bad, column):
    cache = KVCache(CONFIG, num_pages=2, kv_dtype=kv_dtype)
    before = cache.mla[0].clone()
    rows = _rows(5)
    rows[3, column] = bad
    slots = torch.tensor([7, 8, 9, 70, 71])
    with pytest.raises(ValueError, match=r"^write_mla of layer 0: kv_latent row 3 \(slot 70\) holds NaN or inf, "
                                         r"which the cache does not store; fix the producer of the latent$"):
        cache.write_mla(0, slots, rows)
    assert torch.equal(cache.mla[0], before)  # the engine counts bytes of completed steps only
    # (tests/test_prefill.py::test_a_step_that_fails_counts_no_bytes_written)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_with_track_writes_a_read_of_never_written_slots_is_refused(kv_dtype):
    cache = KVCache(CONFIG, num_pages=2, kv_dtype=kv_dtype, track_writes=True)
    written = torch.arange(0, 64)
    cache.write_mla(1, written, _rows(64))
    assert cache.read_mla(1, written, torch.float32).shape == (64, WIDTH)
    with pytest.raises(ValueError, match=r"^read_mla of layer 1: 2 of 66 slots were never written \(first: "
                                         r"slots\[64\] = 64\); write them with write_mla first"):
        cache.read_mla(1, torch.arange(0, 66), torch.float32)
    with pytest.raises(ValueError, match=r"^read_mla of layer 0: 1 of 1 slots were never written"):
        cache.read_mla(0, torch.tensor([3]), torch.float32)  # written in layer 1 only


def test_without_track_writes_unwritten_slots_read_as_zeros():
    """The default keeps the hot path free of the check: what it would miss is shown here."""
    cache = KVCache(CONFIG, num_pages=1, kv_dtype="bf16")
    assert cache.written is None
    assert torch.equal(cache.read_mla(0, torch.arange(4), torch.float32), torch.zeros(4, WIDTH))


def test_a_chunked_prefill_never_reads_an_unwritten_slot():
    """Prefix-cache hits, several requests and chunks: every slot the engine reads was written."""
    from glm_dsa.prefill import PrefillEngine
    from glm_dsa.weights import build_model, init_weights

    model = init_weights(build_model(CONFIG, torch.float32), 0).eval()
    engine = PrefillEngine(model, num_pages=12, kv_dtype="bf16", chunked_prefill_size=128)
    engine.cache = KVCache(CONFIG, 12, "bf16", track_writes=True)
    engine.reset_stats()
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, CONFIG.vocab_size, (130,), generator=g)
    engine.warm_up(prefix)
    rids = [engine.add_request(torch.cat([prefix, torch.randint(0, CONFIG.vocab_size, (n,), generator=g)]))
            for n in (70, 200)]
    engine.run()
    assert [engine.finished[r].cached_len for r in rids] == [128, 128]
    assert all(int(w.sum()) > 0 for w in engine.cache.written.values())
