"""llama.cpp GGUF files of the Llama family (llama, qwen2, qwen3), presented as their HF originals.

Tensor names are mapped back to HF names, the config is synthesized from the GGUF metadata (including a
Llama-3 RoPE scaling recovered from the rope_freqs tensor), and the row permutation llama.cpp applies to
the Q/K projections of LLaMA-architecture models (for its interleaved RoPE) is undone, so `get` returns
tensors laid out exactly as in the HF original.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

from pipeline.errors import ConfigError, WeightsError
from pipeline.frontend.checkpoint_base import (
    NONFINITE_BITS,
    REDOWNLOAD,
    Checkpoint,
    FloatSpan,
    build_tokenizer,
    files_fingerprint,
    natural_key,
    one_line,
    row_range,
)

_GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_GGUF_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# tensors llama.cpp adds that have no HF parameter (their content goes into the config)
_GGUF_EXTRA = {"rope_freqs.weight"}
_GGUF_PLAIN = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def _f32(value: Any) -> float:
    """A float32 metadata value as the short decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    HF stores each head's rotary pairs as two halves (row j pairs with row j + d/2); llama.cpp's converter
    interleaves them (rows 2j, 2j+1) for its RoPE. Per head, HF row k*d/2 + j is GGUF row 2j + k.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{rows} rows do not split into {n_head} heads of even size")
    d = rows // n_head
    j = np.arange(d // 2)
    within = np.concatenate([2 * j, 2 * j + 1])
    order = (np.arange(n_head)[:, None] * d + within[None, :]).reshape(-1)
    return w[order]


def _llama3_factors(scaling: dict[str, Any], theta: float, dim: int) -> np.ndarray:
    """Per-frequency divisors llama.cpp stores in rope_freqs for HF's "llama3" RoPE scaling."""
    inv = theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * np.pi / inv
    factor = scaling["factor"]
    orig = scaling["original_max_position_embeddings"]
    low_wl = orig / scaling["low_freq_factor"]
    high_wl = orig / scaling["high_freq_factor"]
    smooth = (orig / wavelen - scaling["low_freq_factor"]) / (scaling["high_freq_factor"] - scaling["low_freq_factor"])
    medium = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < high_wl, 1.0, np.where(wavelen > low_wl, factor, medium))


def _llama3_scaling_from_factors(factors: np.ndarray, theta: float, dim: int) -> dict[str, Any] | None:
    """Recover a "llama3" rope_scaling dict from llama.cpp's rope_freqs tensor, or None if it is not one.

    The factors only depend on the wavelength bounds orig/low_freq_factor and orig/high_freq_factor, so the
    dict is given with low_freq_factor = 1 (the value of every Llama 3.x release); it reproduces the tensor.
    """
    r = np.asarray(factors, dtype=np.float64).reshape(-1)
    if r.size != dim // 2:
        return None
    factor = float(r.max())
    if factor <= 1.0 + 1e-6:
        return {}
    wavelen = 2 * np.pi / theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    medium = (r > 1.0 + 1e-6) & (r < factor * (1 - 1e-6))
    if medium.sum() < 2:
        return None
    # in the medium band, s = (1/r - 1/factor) / (1 - 1/factor) is linear in 1/wavelength: s = a/wl + b
    s = (1.0 / r[medium] - 1.0 / factor) / (1.0 - 1.0 / factor)
    a, b = np.polyfit(1.0 / wavelen[medium], s, 1)
    if a <= 0 or b >= 0:
        return None
    low_wl = -a / b  # s = 0
    high_wl = a / (1.0 - b)  # s = 1
    scaling = {
        "rope_type": "llama3",
        "factor": _f32(factor),
        "low_freq_factor": 1.0,
        "high_freq_factor": float(f"{low_wl / high_wl:.6g}"),
        "original_max_position_embeddings": int(round(low_wl)),
    }
    if not np.allclose(_llama3_factors(scaling, theta, dim), r, rtol=1e-4, atol=0):
        return None
    return scaling


class GGUFCheckpoint(Checkpoint):
    """A llama.cpp GGUF file of the Llama family, presented with HF names, layout and config."""

    format = "gguf"

    def __init__(self, file: Path, given: Path | None = None):
        self._file = file
        try:
            reader = GGUFReader(str(file))
        except Exception as err:
            raise WeightsError(f"cannot be read as GGUF: truncated, or not a GGUF file ({one_line(err)[:160]})",
                               path=file, fix=REDOWNLOAD) from None
        self._reader = reader
        size = file.stat().st_size
        for t in reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise WeightsError(f"truncated: expected {t.data_offset + t.n_bytes} bytes, file has {size}",
                                   path=file, fix=REDOWNLOAD)
        by_gguf = {t.name: t for t in reader.tensors}
        config = self._synthesize_config(by_gguf)
        super().__init__(given or file, config, {})

        arch = config["model_type"]
        self._tensors: dict[str, Any] = {}
        self._permute: dict[str, int] = {}
        for gname, t in by_gguf.items():
            if gname in _GGUF_EXTRA:
                continue
            hf = self._hf_name(gname)
            if hf is None:
                raise WeightsError(f"GGUF tensor {gname!r} has no counterpart in a HF {arch} model",
                                   path=file, fix="use the model's HF safetensors folder instead")
            self._tensors[hf] = t
            if arch == "llama" and re.fullmatch(r"blk\.\d+\.attn_[qk]\.(weight|bias)", gname):
                n_head = config["num_attention_heads"] if ".attn_q." in gname else config["num_key_value_heads"]
                rows = int(t.shape[-1]) if gname.endswith(".weight") else int(t.shape[0])
                if rows % (2 * n_head):
                    raise WeightsError(f"tensor {gname!r} has {rows} rows, not a whole number of "
                                       f"{n_head} heads", path=file, fix="use the model's HF safetensors folder")
                self._permute[hf] = n_head
        self._tensors = {n: self._tensors[n] for n in sorted(self._tensors, key=natural_key)}

    @staticmethod
    def _hf_name(gname: str) -> str | None:
        if gname in _GGUF_TOP:
            return _GGUF_TOP[gname]
        m = _GGUF_BLOCK_RE.fullmatch(gname)
        if m and m.group(2) in _GGUF_BLOCK:
            return f"model.layers.{m.group(1)}.{_GGUF_BLOCK[m.group(2)]}.{m.group(3)}"
        return None

    # -- metadata -----------------------------------------------------------------------------------------
    def _field(self, key: str, default: Any = None) -> Any:
        field = self._reader.fields.get(key)
        return default if field is None else field.contents()

    def _synthesize_config(self, tensors: dict[str, Any]) -> dict[str, Any]:
        file = self._file
        arch = self._field("general.architecture")
        if arch not in _GGUF_ARCHS:
            raise ConfigError(f"GGUF architecture {arch!r} is not supported", path=file,
                              fix=f"use a {'/'.join(_GGUF_ARCHS)} GGUF, or the model's HF safetensors folder")
        refix = "re-convert it with a current llama.cpp convert_hf_to_gguf.py"

        def need(key: str) -> Any:
            value = self._field(f"{arch}.{key}")
            if value is None:
                raise ConfigError(f"GGUF metadata has no {arch}.{key}", path=file, fix=refix)
            return value

        def uniform(key: str, value: Any) -> int:
            if isinstance(value, list):  # per-layer values; the dense decoder needs them all equal
                if not value or len(set(value)) != 1:
                    raise ConfigError(f"GGUF {arch}.{key} varies per layer ({value[:8]}...), which the dense "
                                      "decoder does not support", path=file, fix="use a llama/qwen2/qwen3 model")
                value = value[0]
            return int(value)

        hidden = int(need("embedding_length"))
        heads = uniform("attention.head_count", need("attention.head_count"))
        kv_heads = uniform("attention.head_count_kv", self._field(f"{arch}.attention.head_count_kv", heads))
        head_dim = int(self._field(f"{arch}.attention.key_length", hidden // heads))
        value_dim = int(self._field(f"{arch}.attention.value_length", head_dim))
        rope_dim = int(self._field(f"{arch}.rope.dimension_count", head_dim))
        if value_dim != head_dim or rope_dim != head_dim:
            raise ConfigError(f"GGUF key_length {head_dim}, value_length {value_dim} and rope.dimension_count "
                              f"{rope_dim} differ, which the {arch} architecture does not allow",
                              path=file, fix="use the model's HF safetensors folder")
        theta = _f32(self._field(f"{arch}.rope.freq_base", 10000.0))

        embd = tensors.get("token_embd.weight")
        if embd is None:
            raise WeightsError("GGUF has no token_embd.weight tensor", path=file, fix=REDOWNLOAD)
        vocab = int(embd.shape[-1])  # ggml ne[1] of [hidden, vocab]

        config: dict[str, Any] = {
            "architectures": [_GGUF_ARCHS[arch]],
            "model_type": arch,
            "hidden_size": hidden,
            "intermediate_size": uniform("feed_forward_length", need("feed_forward_length")),
            "num_hidden_layers": int(need("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": _f32(self._field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": theta,
            "vocab_size": vocab,
            "tie_word_embeddings": "output.weight" not in tensors,
            "attention_bias": "blk.0.attn_q.bias" in tensors,
            "mlp_bias": False,
        }
        context = self._field(f"{arch}.context_length")
        if context is not None:
            config["max_position_embeddings"] = int(context)

        scaling = self._rope_scaling(arch, tensors, theta, head_dim)
        if scaling:
            config["rope_scaling"] = scaling
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": theta, **(scaling or {})}

        for key, gguf_key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
            value = self._field(f"tokenizer.ggml.{gguf_key}_token_id")
            if value is not None:
                config[f"{key}_token_id"] = int(value)
        return config

    def _rope_scaling(self, arch: str, tensors: dict[str, Any], theta: float, head_dim: int) -> dict[str, Any]:
        file = self._file
        kind = self._field(f"{arch}.rope.scaling.type")
        if kind not in (None, "none"):
            factor = _f32(self._field(f"{arch}.rope.scaling.factor", 1.0))
            if kind == "linear":
                return {"rope_type": "linear", "factor": factor}
            if kind == "yarn":
                scaling: dict[str, Any] = {"rope_type": "yarn", "factor": factor}
                orig = self._field(f"{arch}.rope.scaling.original_context_length")
                if orig is not None:
                    scaling["original_max_position_embeddings"] = int(orig)
                for key in ("beta_fast", "beta_slow"):
                    value = self._field(f"{arch}.rope.scaling.yarn_{key}")
                    if value is not None:
                        scaling[key] = _f32(value)
                return scaling
            raise ConfigError(f"GGUF RoPE scaling type {kind!r} is not supported", path=file,
                              fix="use the model's HF safetensors folder")
        freqs = tensors.get("rope_freqs.weight")
        if freqs is None:
            return {}

        scaling = _llama3_scaling_from_factors(dequantize(freqs.data, freqs.tensor_type), theta, head_dim)
        if scaling is None:
            raise ConfigError("GGUF rope_freqs tensor does not match a Llama-3 RoPE scaling", path=file,
                              fix="use the model's HF safetensors folder")
        return scaling

    # -- tensors ------------------------------------------------------------------------------------------
    def _tensor(self, name: str) -> Any:
        try:
            return self._tensors[name]
        except KeyError:
            raise self._unknown(name) from None

    def names(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self._tensor(name).shape.tolist()))

    def dtype(self, name: str) -> str:
        kind = self._tensor(name).tensor_type.name
        return _GGUF_PLAIN.get(kind, kind.lower())

    def get(self, name: str) -> np.ndarray:
        t = self._tensor(name)
        try:
            arr = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise WeightsError(f"tensor {t.name!r} is {t.tensor_type.name}, which gguf-py cannot dequantize",
                               path=self._file, fix="use a GGUF with Q4_0/Q4_1/Q8_0/K-quant/F16 tensors") from None
        arr = np.asarray(arr).astype(np.float32, copy=False).reshape(self.shape(name))
        if name in self._permute:
            arr = _unpermute_rows(arr, self._permute[name])
        if np.may_share_memory(arr, t.data):  # F32 tensors come back as views of the memory map
            arr = arr.copy()
        return np.ascontiguousarray(arr)

    def get_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop), dequantizing only their blocks (ggml blocks never span rows); the Q/K
        tensors whose rows llama.cpp permuted fall back to slicing the whole tensor."""
        t = self._tensor(name)
        shape = self.shape(name)
        if name in self._permute or len(shape) < 2 or t.data.ndim < 2 or t.data.shape[0] != shape[0]:
            return super().get_rows(name, start, stop)
        start, stop = row_range(shape, start, stop)
        try:
            arr = dequantize(t.data[start:stop], t.tensor_type)
        except NotImplementedError:
            return super().get_rows(name, start, stop)   # get() raises the one-line error
        return np.array(arr, dtype=np.float32, order="C").reshape((stop - start, *shape[1:]))

    def fingerprint(self) -> str:
        if self._fingerprint is None:
            spans = [FloatSpan(t.name, _GGUF_PLAIN[t.tensor_type.name], int(t.data_offset),
                               int(t.data_offset) + int(t.n_bytes))
                     for t in self._reader.tensors if _GGUF_PLAIN.get(t.tensor_type.name) in NONFINITE_BITS]
            self._fingerprint = files_fingerprint("gguf", {self._file: spans})
        return self._fingerprint

    def total_bytes(self) -> int:
        return self._file.stat().st_size

    def write_tokenizer(self, dest: Path) -> list[str]:
        dest = Path(dest)
        if getattr(self, "_tokenizer_files", None) is None:   # rebuilding parses the whole GGUF (~8 s)
            self._tokenizer_files = build_tokenizer(self._file.parent, self._file.name, self._file)
        built = dict(self._tokenizer_files)
        template = self._field("tokenizer.chat_template")
        if template and "chat_template.jinja" not in built:
            has_template = False
            if "tokenizer_config.json" in built:
                has_template = bool(json.loads(built["tokenizer_config.json"]).get("chat_template"))
            if not has_template:
                built["chat_template.jinja"] = str(template).encode()
        dest.mkdir(parents=True, exist_ok=True)
        for n, data in built.items():
            (dest / n).write_bytes(data)
        return list(built)

