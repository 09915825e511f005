"""The main jobs: ``kvbridge-demo`` (``pd_pair``: kvbridge nodes as processes, with ``processes``,
``workload``, ``report``, ``nodes`` and ``chaos``) and ``kvbridge-demo-vllm`` (``vllm_pd``: two
``vllm serve`` behind the proxy, with ``vllm_client`` and ``vllm_report``; ``tiny_checkpoint``
writes the small checkpoint it serves)."""

from .tiny_checkpoint import tiny_llama

__all__ = ["tiny_llama"]
