"""redline: low-latency LLM inference for Llama 3.x and Llama 4 checkpoints."""

from redline.engine.llm import LLM
from redline.engine.request import Completion, GenerationError
from redline.sampling import SamplingParams
from redline.structured_spec import StructuredOutputs

__all__ = ["LLM", "Completion", "GenerationError", "SamplingParams", "StructuredOutputs"]
__version__ = "0.1.0"
