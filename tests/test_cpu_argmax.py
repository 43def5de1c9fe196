"""The greedy step's argmax kernel (pipeline/kernels/cpu/argmax.py) against numpy's argmax: the first of equal maxima."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from pipeline.config import load_target
from pipeline.kernels.cpu.argmax import LANES, argmax_kernel


@pytest.mark.parametrize("n", [LANES, 37, 49152 + 5])      # one vector; a scalar tail; a vocab with a tail
def test_argmax_kernel_matches_numpy(n):
    lib = tvm.compile(tvm.IRModule({"main": argmax_kernel(n).with_attr("global_symbol", "main")}),
                      target=load_target("host-cpu").tvm())
    rng = np.random.default_rng(n)
    cases = {
        "random": rng.standard_normal(n),
        "all equal": np.ones(n),                                    # the first index wins
        "ties": np.where(np.arange(n) % 7 == 3, 9.0, rng.standard_normal(n)),
        "last": np.r_[rng.standard_normal(n - 1), 50.0],            # in the tail when n % LANES
        "negative": -np.abs(rng.standard_normal(n)) - 5.0,
    }
    out = tvm.runtime.tensor(np.zeros(1, dtype="int32"))
    for name, x in cases.items():
        x = x.astype("float32")
        lib["main"](tvm.runtime.tensor(x), out)
        assert int(out.numpy()[0]) == int(np.argmax(x)), name
