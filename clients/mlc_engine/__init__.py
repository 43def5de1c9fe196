"""MLC-LLM's C++ serving engine built as a client of our bundles (build.py) and driven from Python (client.py)."""
