"""Where a stacked expert parameter's rows come from in a checkpoint: per-expert or stacked tensors.

The bundle stores each MoE layer's experts stacked ([E, 2I, H] gate_up, [E, H, I] down; models/moe.py).
Checkpoints come in two spellings: one 2-d tensor per expert and projection
(``mlp.experts.{e}.gate_proj.weight``, what transformers 5's save_pretrained writes for qwen3_moe /
qwen3_5_moe, and the released checkpoints), or transformers 5's in-memory stacked form
(``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]). `StackedView` presents the
stacked form under the per-expert names, so the converter reads one spelling: the stacked parameter is the
per-expert sources concatenated along rows (expert 0's gate, its up, expert 1's gate, ...), converted like a
fused 2-d weight [E * rows, K] and reshaped (bit-identical: rows are independent).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import numpy as np

_STACKED = re.compile(r"(?P<owner>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
# our parameter (owner.experts.gate_up_proj.weight) -> the per-expert source projections, in row order
PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def expert_sources(param: str, experts: int) -> list[str]:
    """Per-expert checkpoint names of a stacked parameter, concatenated along rows in this order."""
    base, _, _ = param.rpartition(".")
    owner, _, proj = base.rpartition(".")
    return [f"{owner}.{e}.{part}.weight" for e in range(experts) for part in PARTS[proj]]


class StackedView:
    """A checkpoint whose stacked expert tensors also answer to their per-expert names (read-only)."""

    def __init__(self, ckpt: Any):
        self._ckpt = ckpt
        self._virtual: dict[str, tuple[str, int, int, int]] = {}   # name -> (stacked, expert, row0, row1)
        for name in ckpt.names():
            m = _STACKED.match(name)
            shape = tuple(int(d) for d in ckpt.shape(name)) if m else ()
            if not m or len(shape) != 3:
                continue
            experts, rows = shape[0], shape[1]
            parts = PARTS[m["proj"]]
            step = rows // len(parts)
            for e in range(experts):
                for i, part in enumerate(parts):
                    self._virtual[f"{m['owner']}.{e}.{part}.weight"] = (name, e, i * step, (i + 1) * step)
        self._last: tuple[tuple[str, int], np.ndarray] | None = None

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._ckpt, attr)

    def __contains__(self, name: object) -> bool:
        return name in self._virtual or name in self._ckpt

    def names(self) -> list[str]:
        return [*self._ckpt.names(), *self._virtual]

    def stacked_name(self, name: str) -> str:
        """The checkpoint tensor a (possibly virtual per-expert) name is read from."""
        return self._virtual[name][0] if name in self._virtual else name

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._virtual:
            return self._ckpt.shape(name)
        stacked, _, r0, r1 = self._virtual[name]
        return (r1 - r0, *self._ckpt.shape(stacked)[2:])

    def dtype(self, name: str) -> str:
        return self._ckpt.dtype(self._virtual[name][0] if name in self._virtual else name)

    def _expert(self, stacked: str, e: int) -> np.ndarray:
        """One expert's slab [rows, K] of a stacked tensor (the last one kept: gate then up read it once)."""
        if self._last is None or self._last[0] != (stacked, e):
            self._last = ((stacked, e), self._ckpt.get_rows(stacked, e, e + 1)[0])
        return self._last[1]

    def get(self, name: str) -> np.ndarray:
        if name not in self._virtual:
            return self._ckpt.get(name)
        stacked, e, r0, r1 = self._virtual[name]
        return np.ascontiguousarray(self._expert(stacked, e)[r0:r1])

    def get_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        if name not in self._virtual:
            return self._ckpt.get_rows(name, start, stop)
        stacked, e, r0, _ = self._virtual[name]
        return np.ascontiguousarray(self._expert(stacked, e)[r0 + start:r0 + stop])


def with_stacked_experts(ckpt: Any) -> Any:
    """`ckpt`, viewed through StackedView when it holds stacked expert tensors."""
    if any(_STACKED.match(n) for n in ckpt.names()):
        return StackedView(ckpt)
    return ckpt


def expert_slabs(ckpt: Any, name: str) -> list[Callable[[], np.ndarray]] | None:
    """The in-memory stacked tensor `name` (transformers 5's ``experts.gate_up_proj`` / ``down_proj``) of a
    per-expert checkpoint, as one reader per expert of its slab [rows, K] (gate rows then up rows), for code that
    loads transformers' own modules (calibration): it fills the stacked parameter expert by expert, never holding
    a second copy of the whole stack (1.6 GB per layer for the 35B). None when `name` is not a stacked expert
    tensor or its experts are not in `ckpt`."""
    m = _STACKED.match(name)
    if not m:
        return None
    parts = PARTS[m["proj"]]
    owner = m["owner"]
    if f"{owner}.0.{parts[0]}.weight" not in ckpt and owner.startswith("model."):
        owner = "model.language_model." + owner[len("model."):]   # a multimodal wrapper's text model
    experts = 0
    while f"{owner}.{experts}.{parts[0]}.weight" in ckpt:
        experts += 1
    if not experts:
        return None
    return [functools.partial(_slab, ckpt, [f"{owner}.{e}.{part}.weight" for part in parts]) for e in range(experts)]


def _slab(ckpt: Any, names: list[str]) -> np.ndarray:
    return np.concatenate([ckpt.get(n) for n in names])

