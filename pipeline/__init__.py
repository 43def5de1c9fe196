"""mobile-llm-pipeline: Hugging Face / GGUF LLMs -> app-ready phone bundles, compiled with TVM."""

__version__ = "0.1.0"
