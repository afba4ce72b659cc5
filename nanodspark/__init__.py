"""nanodspark: a minimal, readable, real reference engine for DSpark speculative decoding."""
from .config import EngineConfig, ModelConfig
from .engine import LLMEngine
from .llm import LLM
from .request import RequestOutput
from .sampling import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "ModelConfig", "RequestOutput", "SamplingParams"]
