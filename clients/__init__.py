"""Clients of the pipeline's bundles that the project builds but does not ship (e.g. MLC-LLM's engine)."""
