"""specserve: speculative decoding with the draft and the target on different machines, lossless.

``import specserve`` needs only torch, transformers and msgpack; Ray, Serve and GPU
extras are imported by the modules that use them.
"""

from .config import EngineConfig, SideConfig
from .llm import LLM
from .outputs import RequestOutput, SpecMetrics, StepDelta
from .sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "SpecMetrics", "StepDelta", "EngineConfig", "SideConfig"]
