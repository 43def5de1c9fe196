"""What MLC-LLM's engine needs to know about a bundle's tokenizer, read from its tokenizer.json.

`tokenizer_info` (mlc-chat-config.json) tells the engine how to turn token strings back into bytes and whether
the tokenizer inserts a space: MLC's `Tokenizer::DetectTokenizerInfo` (cpp/tokenizers/tokenizers.cc at
mlc-ai/mlc-llm@79d603f0) derives it from tokenizer.json, and `mlc_llm gen_config` writes what it detects. The
rules, restated here so a bundle carries the same values MLC's own tooling would write:

- token_postproc_method: `byte_level` when the decoder (or one decoder of a `Sequence`, the last match winning)
  is `ByteLevel`, `byte_fallback` when it is `ByteFallback`; with no decoder, or neither kind (e.g. a lone
  `Metaspace` decoder), `byte_fallback`.
- prepend_space_in_encode: the normalizer (or the first matching one of a `Sequence`) is
  `{"type": "Prepend", "prepend": "▁"}`. MLC looks at nothing else (not the pre-tokenizer's Metaspace).
- strip_space_in_decode: a decoder (or one of a `Sequence`) is `{"type": "Strip", "content": " ", "start": 1,
  "stop": 0}`.

Without a tokenizer.json the engine's defaults apply (byte_fallback, no prepend, no strip), as in MLC.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.errors import WeightsError

DEFAULT_INFO = {"token_postproc_method": "byte_fallback", "prepend_space_in_encode": False,
                "strip_space_in_decode": False}
SPACE = "\u2581"   # sentencepiece's "▁"


def read_tokenizer_json(path: Path) -> dict[str, Any]:
    """tokenizer.json as a dict; a file that is not a JSON object is a one-line error naming it."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WeightsError(f"cannot read the tokenizer ({str(err).splitlines()[0][:200]})", path=path,
                           fix="copy tokenizer.json again from the model's HF repo") from None
    if not isinstance(data, dict):
        raise WeightsError("the tokenizer is not a JSON object", path=path,
                           fix="copy tokenizer.json again from the model's HF repo")
    return data


def _typed(node: Any, path: Path, where: str) -> str:
    """The `type` of a tokenizer.json component; MLC's engine aborts on one without it, so do we (clearly)."""
    if not isinstance(node, dict) or not isinstance(node.get("type"), str):
        raise WeightsError(f"the tokenizer's {where} has no \"type\"", path=path,
                           fix="copy tokenizer.json again from the model's HF repo")
    return node["type"]


def _parts(node: dict[str, Any], key: str, path: Path, where: str) -> list[Any]:
    """The members of a `Sequence` component (decoders / normalizers)."""
    parts = node.get(key)
    if not isinstance(parts, list):
        raise WeightsError(f"the tokenizer's {where} is a Sequence without a \"{key}\" list", path=path,
                           fix="copy tokenizer.json again from the model's HF repo")
    return parts


def detect_tokenizer_info(folder: Path) -> dict[str, Any]:
    """tokenizer_info for the tokenizer.json in `folder` (MLC's defaults when there is none)."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return dict(DEFAULT_INFO)
    return tokenizer_info(read_tokenizer_json(path), path)


def tokenizer_info(data: dict[str, Any], path: Path | str = "tokenizer.json") -> dict[str, Any]:
    info = dict(DEFAULT_INFO)
    decoder = data.get("decoder")
    if isinstance(decoder, dict):
        kind = _typed(decoder, path, "decoder")
        decoders = _parts(decoder, "decoders", path, "decoder") if kind == "Sequence" else [decoder]
        methods = {"ByteLevel": "byte_level", "ByteFallback": "byte_fallback"}
        for part in decoders:
            method = methods.get(_typed(part, path, "decoder"))
            if method:
                info["token_postproc_method"] = method
        info["strip_space_in_decode"] = any(
            _typed(part, path, "decoder") == "Strip" and part.get("content") == " " and _is_int(part.get("start"), 1)
            and _is_int(part.get("stop"), 0) for part in decoders)
    normalizer = data.get("normalizer")
    if isinstance(normalizer, dict):
        kind = _typed(normalizer, path, "normalizer")
        normalizers = _parts(normalizer, "normalizers", path, "normalizer") if kind == "Sequence" else [normalizer]
        info["prepend_space_in_encode"] = any(
            _typed(part, path, "normalizer") == "Prepend" and part.get("prepend") == SPACE for part in normalizers)
    return info


def _is_int(value: Any, want: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value == want


def token_table(data: dict[str, Any]) -> dict[str, int]:
    """Every whole token string of a tokenizer.json -> its id: the model's vocabulary and the added tokens
    (which win, as in the tokenizer itself). Used to find stop strings and prefix tokens that are one token."""
    vocab = (data.get("model") or {}).get("vocab")
    table: dict[str, int] = {}
    if isinstance(vocab, dict):          # BPE, WordPiece, WordLevel
        table.update({str(k): int(v) for k, v in vocab.items() if isinstance(v, int)})
    elif isinstance(vocab, list):        # Unigram: [[piece, score], ...], the id is the position
        table.update({str(entry[0]): i for i, entry in enumerate(vocab) if isinstance(entry, list) and entry})
    for added in data.get("added_tokens") or []:
        if isinstance(added, dict) and isinstance(added.get("content"), str) and isinstance(added.get("id"), int):
            table[added["content"]] = added["id"]
    return table
