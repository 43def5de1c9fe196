"""`python -m pipeline run`: chat with a host-cpu bundle — the same files an app would ship."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.artifacts.bundle import escapes, verify_manifest
from pipeline.artifacts.tensor_cache import iter_tensor_cache
from pipeline.errors import PipelineError
from pipeline.runtime.engine import Engine, MissingWeightsError
from pipeline.runtime.host_memory import HugePageArena


class Bundle:
    """A built bundle directory: library, weights, tokenizer, configs."""

    def __init__(self, path: str | Path, verify: bool = True):
        """`verify`: check every file against the manifest's sha256 before anything is loaded (a flipped byte
        in the library or a shard is refused in one line); off for a bundle already checked this session."""
        self.path = Path(path)
        cfg_path = self.path / "mlc-chat-config.json"
        if not cfg_path.exists():
            raise PipelineError("not a bundle (no mlc-chat-config.json)", path=self.path,
                                fix="build one with `python -m pipeline build --target host-cpu`")
        if verify:
            verify_manifest(self.path, allow_unlisted=True)
        self.config = json.loads(cfg_path.read_text())
        model_lib = str(self.config.get("model_lib", ""))
        self.library = self.path / model_lib
        if escapes(model_lib) or not self.library.resolve().is_relative_to(self.path.resolve()):
            raise PipelineError(f"model_lib {model_lib!r} is not a file inside the bundle", path=cfg_path,
                                fix="rebuild the bundle (python -m pipeline build ...)")
        if self.library.suffix != ".so":
            raise PipelineError(f"the library {self.library.name} is for a phone, not this computer",
                                path=self.path, fix="build with --target host-cpu to run it here")
        if not (self.path / "tensor-cache.json").exists():
            raise PipelineError("the bundle has no weights", path=self.path,
                                fix="rebuild it with --weights DIR")

    def engine(self):
        arena = HugePageArena()     # the weights are read straight into it (no temporary copy each)
        try:
            return Engine(self.library, iter_tensor_cache(self.path, allocate=arena.empty), arena=arena)
        except MissingWeightsError as err:
            raise PipelineError(f"weights lack {err.args[0]}", path=self.path / "tensor-cache.json",
                                fix="rebuild the bundle") from None

    def tokenizer(self):
        from transformers import AutoTokenizer  # local: the runtime path loads it only to chat

        if not (self.path / "tokenizer.json").exists() and not (self.path / "tokenizer.model").exists():
            raise PipelineError("the bundle has no tokenizer (its checkpoint had none)", path=self.path,
                                fix="rebuild from a checkpoint folder that has tokenizer.json")
        try:
            return AutoTokenizer.from_pretrained(str(self.path))
        except (ValueError, OSError) as err:
            raise PipelineError(f"its tokenizer cannot be loaded ({str(err).splitlines()[0][:200]})", path=self.path,
                                fix="rebuild from a checkpoint folder with a complete tokenizer") from None


def sample(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p)
    keep = order[: int(np.searchsorted(np.cumsum(p[order]), top_p) + 1)]
    q = p[keep] / p[keep].sum()
    return int(rng.choice(keep, p=q))


def generate(bundle: Bundle, prompt: str, *, max_new_tokens: int = 128, temperature: float = 0.0,
             top_p: float = 0.95, seed: int = 0, stream: Any = "stdout", chat: bool = True) -> dict:
    """Greedy / sampled generation; text is streamed to `stream` ("stdout": sys.stdout at call time; None: off)."""
    stream = sys.stdout if stream == "stdout" else stream
    tok = bundle.tokenizer()
    engine = bundle.engine()
    if chat and tok.chat_template:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
    else:
        ids = tok.encode(prompt)
    ids = list(ids)
    context = int(bundle.config.get("context_window_size") or 0)
    if context and len(ids) >= context:
        raise PipelineError(f"the prompt is {len(ids)} tokens; the bundle's context window is {context}",
                            path=bundle.path, fix="shorten the prompt, or rebuild with a larger context_window_size")
    eos = set(bundle.config.get("eos_token_id") or [])
    if tok.eos_token_id is not None:
        eos.add(tok.eos_token_id)
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    logits = engine.prefill(ids)
    t_first = time.perf_counter()
    out: list[int] = []
    printed = ""
    token = sample(logits, temperature, top_p, rng)
    t_decode = time.perf_counter()
    while token not in eos and len(out) < max_new_tokens:
        out.append(token)
        text = tok.decode(out, skip_special_tokens=True)
        if stream is not None:
            stream.write(text[len(printed):])
            stream.flush()
        printed = text
        if len(out) >= max_new_tokens or engine.length >= engine.context:
            break
        token = (engine.decode_greedy(token) if temperature <= 0
                 else sample(engine.decode(token), temperature, top_p, rng))
    t_end = time.perf_counter()
    if stream is not None:
        stream.write("\n")
    n_decode = max(len(out) - 1, 0)
    return {
        "text": printed, "tokens": out, "prompt_tokens": len(ids),
        "ttft_s": t_first - t0,
        "prefill_tok_s": len(ids) / max(t_first - t0, 1e-9),
        "decode_tok_s": n_decode / max(t_end - t_decode, 1e-9) if n_decode else 0.0,
    }
