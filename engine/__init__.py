"""Inference on transformers decoder models over the tiered KV cache (see engine/engine.py)."""
from engine.engine import Engine
from engine.outputs import CompletionOutput, LookupResult, RequestMetrics, StreamChunk, Usage
from engine.sampling_params import SamplingParams

__all__ = ["Engine", "SamplingParams", "CompletionOutput", "StreamChunk", "Usage", "RequestMetrics", "LookupResult"]
