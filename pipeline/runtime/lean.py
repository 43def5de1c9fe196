"""Processes that only run a compiled bundle (`pipeline run`, the speed benchmark) load TVM's runtime alone.

`import tvm` normally maps the compiler library too, and `tvm_ffi` imports torch whenever it is installed
(for DLPack interop); the tokenizer (transformers) imports torch as well. Measured with SmolLM2-135M q4f16
(80 MB of weights): 474 MiB peak RSS through decode that way, 169 MiB with the runtime alone — llama.cpp
takes 200. A phone app links only the runtime, so this is also what the desktop numbers should measure.
"""

from __future__ import annotations

import os
import sys


def enter_runtime_process() -> bool:
    """Make this process a runtime-only one: tvm with libtvm_runtime alone, and no torch for its lifetime.

    Call first thing, before anything imports tvm or torch; returns False (and changes nothing) when one
    of them is already imported. transformers still loads tokenizers without torch; its advisory note
    that PyTorch is missing is silenced.
    """
    if "tvm" in sys.modules or "torch" in sys.modules:
        return False
    sys.modules["torch"] = None            # `import torch` now raises ImportError; find_spec says absent
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    previous = os.environ.get("TVM_USE_RUNTIME_LIB")
    os.environ["TVM_USE_RUNTIME_LIB"] = "1"
    try:
        import tvm  # noqa: F401
    finally:
        if previous is None:
            os.environ.pop("TVM_USE_RUNTIME_LIB", None)
        else:
            os.environ["TVM_USE_RUNTIME_LIB"] = previous
    return True
