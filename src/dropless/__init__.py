"""dropless: Mixture-of-Experts training on PyTorch without dropping tokens."""

from .config import BalanceConfig, MoEConfig, RouterConfig
from .layers.moe import MoELayer, MoEOutput, MoEStats

__version__ = "0.1.0"

__all__ = ["BalanceConfig", "MoEConfig", "MoELayer", "MoEOutput", "MoEStats", "RouterConfig"]
