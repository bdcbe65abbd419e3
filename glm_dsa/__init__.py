"""glm-dsa: the PyTorch reference of one GLM-5.3 DSA layer and of its chunked prefill."""

from glm_dsa.config import PRESETS, DSAConfig, from_hf_config, get_config, to_hf_config

__all__ = ["DSAConfig", "PRESETS", "get_config", "from_hf_config", "to_hf_config"]
__version__ = "0.1.0"
