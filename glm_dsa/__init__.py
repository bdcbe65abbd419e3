"""glm-dsa: the PyTorch reference of one GLM-5.3 DSA layer and of its chunked prefill.

The objects a user composes (README, "Equivalence test in Python"): a config (``get_config``,
``keep_layers``), the model (``DSAForCausalLM`` with its ``DecoderLayer``\\ s, built by
``build_model`` / ``init_weights`` or ``load_checkpoint``), one step's ragged metadata
(``ForwardBatch``), the paged caches (``KVCache``) and the chunked-prefill driver
(``PrefillEngine``).
"""

from glm_dsa.batch import ForwardBatch
from glm_dsa.cache import KVCache
from glm_dsa.config import PRESETS, DSAConfig, from_hf_config, get_config, keep_layers, to_hf_config
from glm_dsa.layer import DecoderLayer, DSAForCausalLM
from glm_dsa.prefill import PrefillEngine
from glm_dsa.weights import build_model, init_weights, load_checkpoint, save_checkpoint

__all__ = [
    "DSAConfig", "PRESETS", "get_config", "keep_layers", "from_hf_config", "to_hf_config",
    "DSAForCausalLM", "DecoderLayer", "ForwardBatch", "KVCache", "PrefillEngine",
    "build_model", "init_weights", "load_checkpoint", "save_checkpoint",
]
__version__ = "0.1.0"
