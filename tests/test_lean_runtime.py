"""Runtime-only processes (`pipeline run`, the speed benchmark's child): TVM's runtime library alone, no
torch, weights streamed to the device — and the same tokens as a process with the full compiler loaded."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from pipeline.runtime.runner import Bundle

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [1, 504, 3458, 282, 4649, 314, 253]

CHILD = """
import json, sys
from pipeline.runtime.lean import enter_runtime_process
first = enter_runtime_process()
second = enter_runtime_process()
import numpy as np
import tvm.base
from pipeline.runtime.runner import Bundle
bundle = Bundle(sys.argv[1])
engine = bundle.engine()
tokens = [int(np.argmax(engine.prefill({prompt})))]
for _ in range(7):
    tokens.append(int(np.argmax(engine.decode(tokens[-1]))))
text = bundle.tokenizer().decode(tokens)
print(json.dumps({{"first": first, "second": second, "runtime_only": bool(tvm.base._RUNTIME_ONLY),
                  "torch_loaded": sys.modules.get("torch") is not None, "tokens": tokens, "text": text}}))
"""


def test_runtime_process_matches_the_full_process(build_bundle):
    bundle = build_bundle("smollm2-135m", "host-cpu", "q4f16")
    run = subprocess.run([sys.executable, "-c", CHILD.format(prompt=PROMPT), str(bundle)], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "PyTorch was not found" not in run.stderr
    child = json.loads(run.stdout.strip().splitlines()[-1])
    assert child["first"] is True and child["second"] is False
    assert child["runtime_only"] and not child["torch_loaded"]

    engine = Bundle(bundle).engine()          # this process: compiler loaded, torch imported
    tokens = [int(np.argmax(engine.prefill(PROMPT)))]
    for _ in range(7):
        tokens.append(int(np.argmax(engine.decode(tokens[-1]))))
    assert child["tokens"] == tokens
    assert child["text"].strip()


def test_no_effect_once_tvm_is_loaded():
    import tvm  # noqa: F401

    from pipeline.runtime.lean import enter_runtime_process

    assert enter_runtime_process() is False
    assert sys.modules.get("torch", "absent") is not None      # torch was not hidden here
    assert "TVM_USE_RUNTIME_LIB" not in os.environ
