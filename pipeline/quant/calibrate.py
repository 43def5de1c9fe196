"""Calibration: what each linear layer's input looks like on real text, for calibrated quantization (gptq.py).

The statistic is H = mean over tokens of x x^T for the input x of every linear layer (q/k/v share one
input, so do gate/up and the Gated-DeltaNet input projections; lm_head's input is the final norm's output).
It is measured with transformers' own implementation of the architecture (the float reference the
numerics tests use), streamed so that memory stays at about one decoder layer whatever the model size:

* pass 1 runs the text model once over all calibration windows (one batch) with every decoder layer on
  the `meta` device; a hook loads a layer's weights from the checkpoint just before it runs, keeps the
  hidden states entering it (a memory-mapped file, tokens x hidden float32) and the arguments it was
  called with, and frees the weights after it. The embedding is a gather from the checkpoint; lm_head
  never runs (only its input is needed).
* `hessians(layer)` reloads that layer, runs it on its saved input and records its linear inputs. One
  layer's matrices are held at a time, and conversion asks for layers in order. When all layers' matrices
  together are small (under KEEP_ALL_BYTES, e.g. SmolLM2-135M: 0.3 GB), pass 1 records them as it goes
  and there is no second pass.

Calibration text: `pipeline/quant/data/calibration.txt` (the default, written for this project: encyclopedic
prose, stories, dialogues, a recipe, instructions, letters, code, SQL, numbers, a few sentences in French,
German, Spanish and Chinese — deliberately unlike the held-out text of the quality benchmark, so measured
gains are not in-domain), or a text file named in the scheme. It is cut into windows of `window` tokens
(`tokens` in all, as many whole windows as the text gives, at least one). A checkpoint with no tokenizer
gets seeded random token ids instead, with a note: right for random-weight test models, poor for real ones.

torch, transformers and tokenizers are imported inside the functions that use them: a build that does not
calibrate (most schemes) never pays their seconds of import time and hundreds of MB.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.cache import digest, source_hash
from pipeline.config import CalibrationSpec
from pipeline.errors import ConfigError, WeightsError
from pipeline.frontend.hf_config import text_config
from pipeline.quant.convert import FUSED, checkpoint_name
from pipeline.quant.experts import expert_slabs
from pipeline.quant.gptq import prepare
from pipeline.quant.quantize import dequantize_q4, quantize_q4

MIN_DISTINCT = 256                 # fewer distinct calibration tokens than this: a degenerate tokenizer
KEEP_ALL_BYTES = 1 << 30            # all layers' H (float32) kept from pass 1 below this size


def token_windows(ckpt: Any, spec: CalibrationSpec, vocab_size: int) -> tuple[np.ndarray, str]:
    """Calibration token ids [windows, window] and a line saying where they came from."""
    ids = _tokenize(ckpt, spec.text_path())
    window = int(spec.window)
    distinct = len(set(ids or ()))
    if ids is None or not ids or max(ids) >= vocab_size or distinct < min(MIN_DISTINCT, vocab_size // 4):
        n = max(1, int(spec.tokens) // window)
        rng = np.random.default_rng(0)
        why = ("the checkpoint has no tokenizer" if ids is None else "the text gives no tokens" if not ids else
               f"its tokenizer gives ids up to {max(ids)}, beyond the model's {vocab_size} embeddings"
               if max(ids) >= vocab_size else
               f"its tokenizer turns the text into only {distinct} distinct tokens, mostly unknown words")
        return (rng.integers(0, vocab_size, (n, window)).astype(np.int64),
                f"{n} x {window} seeded random token ids ({why})")
    window = min(window, len(ids))
    n = max(1, min(int(spec.tokens) // window, len(ids) // window))
    arr = np.asarray(ids[:n * window], np.int64).reshape(n, window)
    name = "builtin calibration text" if spec.text == "builtin" else spec.text
    return arr, f"{n} x {window} tokens of the {name}"


def _tokenize(ckpt: Any, text_file: Path) -> list[int] | None:
    from tokenizers import Tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        try:
            files = ckpt.write_tokenizer(Path(tmp))
        except WeightsError:
            return None
        if "tokenizer.json" not in files:
            return None
        tok = Tokenizer.from_file(str(Path(tmp) / "tokenizer.json"))
    return tok.encode(text_file.read_text(encoding="utf-8"), add_special_tokens=False).ids


def _transformers_config(hf_config: dict[str, Any]):
    """transformers' config of the text model (the text part of a multimodal Qwen3.5 config), from the
    fields `frontend.hf_config` picks out (tying the lm_head as the checkpoint does)."""
    from transformers import AutoConfig

    cfg = dict(text_config(hf_config).text)
    cfg.pop("architectures", None)
    model_type = cfg.pop("model_type", None)
    try:
        return AutoConfig.for_model(model_type, **cfg)
    except (KeyError, ValueError) as err:
        raise ConfigError(f"transformers cannot build model_type {model_type!r} for calibration ({err})",
                          fix="use a scheme with calibration: none") from None


class Calibration:
    """H per linear input of one checkpoint on one calibration text. Use as a context manager (the saved
    hidden states live in a temporary folder that is removed on exit)."""

    def __init__(self, ckpt: Any, hf_config: dict[str, Any], spec: CalibrationSpec, report: Any = None,
                 work_dir: Path | None = None, store: Path | None = None):
        """`store`: a folder for calibrated tensors (NK codes + scales by content key), shared by builds of
        the same weights for other layouts / targets; None keeps nothing."""
        self.ckpt, self.hf_config, self.spec, self.report = ckpt, hf_config, spec, report
        self.work_dir, self.store = work_dir, store
        self._fingerprint: str | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._model = None
        self._inputs: dict[int, tuple[Path, tuple, dict]] = {}   # layer -> (hidden file, args, kwargs)
        self._lm_head: np.ndarray | None = None
        self._layer_cache: tuple[int, dict[str, np.ndarray]] | None = None
        self._all: dict[int, dict[str, np.ndarray]] | None = None    # every layer's H, when small
        self._prepared: dict[str, Any] = {}
        self._sensitivity: dict[str, dict[str, float]] = {}
        self._ids: np.ndarray | None = None                      # the calibration windows' token ids
        self.description = ""
        self.tokens = 0

    def __enter__(self) -> Calibration:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._model = None
        self._inputs.clear()
        self._layer_cache = None
        self._prepared.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    # -------------------------------------------------------------------------------------- queries
    def hessian(self, module: str) -> np.ndarray | None:
        """H [K, K] (float32) of the input of HF linear module `module` (e.g. model.layers.3.mlp.down_proj,
        lm_head); None when it is not a linear layer of the text model."""
        self._run_pass1()
        if module == "lm_head":
            return self._lm_head
        layer = _layer_index(module)
        if layer is None or layer not in self._inputs:
            return None
        if self._all is not None:
            return self._all.get(layer, {}).get(module)
        if self._layer_cache is None or self._layer_cache[0] != layer:
            self._layer_cache = None                         # free the previous layer's matrices first
            self._layer_cache = (layer, self._layer_hessians(layer))
        return self._layer_cache[1].get(module)

    def prepared(self, module: str):
        """gptq.Prepared for `module` (kept for the last few modules: q_weight and q_scale share it)."""
        if module not in self._prepared:
            h = self.hessian(module)
            if h is None:
                return None
            if len(self._prepared) >= 4:
                self._prepared.pop(next(iter(self._prepared)))
            self._prepared[module] = prepare(h)
        return self._prepared[module]

    def input_of(self, param_base: str, tied: bool) -> CalibratedInput | None:
        """The calibrated input of our parameter `param_base`, or None when it has none (a gather)."""
        module = module_for_param(param_base, tied)
        if module is None or (module != "lm_head" and _layer_index(module) is None):
            return None
        return CalibratedInput(self, module)

    def role_sensitivity(self, role_modules: dict[str, tuple[str, ...]], tied: bool) -> dict[str, float]:
        """{role: mean KL(float model || the same model with only that role's matrices rounded to q4)} over
        the calibration tokens, for QUANT=auto (auto_quant.py).

        `role_modules` maps a role to the HF parameter suffixes it holds inside a decoder layer (e.g.
        qkv_proj -> self_attn.q_proj.weight, ...); `embed_tokens` (the gathered rows, and the output
        projection too when `tied`) and `lm_head` are roles outside the layers. One streamed pass: each
        decoder layer is loaded once and run on one hidden-state stream per role plus the float stream, so
        the cost is (roles + 1) forwards of the calibration text at one layer's memory. Rounding is to
        nearest (quantize.py), which needs no H; auto_quant scales these figures to the calibrated formats.
        Kept in the store by content key (a re-plan for another budget or target does not measure again).
        """
        key = self.key(["role-sensitivity", tied, sorted((r, list(m)) for r, m in role_modules.items())], 4)
        if key in self._sensitivity:
            return dict(self._sensitivity[key])
        path = self.store / f"{key}.json" if self.store else None
        if path is not None and path.is_file():
            try:
                return {r: float(v) for r, v in json.loads(path.read_text()).items()}
            except (OSError, ValueError, AttributeError):
                pass                                   # a damaged entry is measured again
        result = self._measure_role_sensitivity(role_modules, tied)
        self._sensitivity[key] = dict(result)
        self._store_put(f"{key}.json", lambda tmp: tmp.write_text(json.dumps(result)))
        return result

    def _measure_role_sensitivity(self, role_modules: dict[str, tuple[str, ...]], tied: bool) -> dict[str, float]:
        import torch


        def rounded(w):
            arr = w.detach().numpy().reshape(-1, w.shape[-1])
            if arr.shape[-1] % 32:
                return w
            return torch.from_numpy(dequantize_q4(*quantize_q4(arr))).reshape(w.shape)

        self._run_pass1()
        base = self._model.model
        roles = list(role_modules)
        embedded = self._embed(self._ids)
        streams = {None: embedded}
        for r in roles:
            streams[r] = rounded(embedded) if r == "embed_tokens" else embedded
        t0 = time.time()
        self._say(f"auto: sensitivity of {len(roles)} roles ({', '.join(roles)}) on the calibration text …")
        with torch.no_grad():
            for i, layer in enumerate(base.layers):
                _, args, kwargs = self._inputs[i]
                self._load(layer, f"model.layers.{i}")
                params = dict(layer.named_parameters())
                for r, h in streams.items():
                    swapped = [(p, p.data) for n, p in params.items() if r and n.endswith(role_modules.get(r, ()))]
                    for p, original in swapped:
                        p.data = rounded(original)
                    out = layer(h, *args, **kwargs)
                    streams[r] = out[0] if isinstance(out, tuple) else out
                    for p, original in swapped:
                        p.data = original
                layer.to_empty(device="meta")
            head_name = checkpoint_name(self.ckpt, "model.embed_tokens.weight" if tied else "lm_head.weight")
            head = torch.from_numpy(np.ascontiguousarray(self.ckpt.get(head_name), np.float32))
            head_rounded = rounded(head)
            finals = {r: base.norm(h).reshape(-1, h.shape[-1]) for r, h in streams.items()}
            kl = {r: 0.0 for r in roles}
            rows = finals[None].shape[0]
            for start in range(0, rows, 256):
                ref = torch.log_softmax(finals[None][start:start + 256] @ head.T, dim=-1)
                p_ref = ref.exp()
                for r in roles:
                    w = head_rounded if r == "lm_head" or (tied and r == "embed_tokens") else head
                    logp = torch.log_softmax(finals[r][start:start + 256] @ w.T, dim=-1)
                    kl[r] += float((p_ref * (ref - logp)).sum())
        self._say(f"auto: sensitivity measured in {time.time() - t0:.1f} s")
        return {r: v / rows for r, v in kl.items()}

    # ------------------------------------------------------------------------------ calibrated store
    def key(self, sources: list[str], bits: int) -> str:
        """Content key of one calibrated tensor: the checkpoint (every earlier layer shapes this one's
        input), its sources, the format, the calibration and the quantizer code."""
        if self._fingerprint is None:
            self._fingerprint = self.ckpt.fingerprint()
        return digest({"weights": self._fingerprint, "sources": sources, "bits": bits,
                        "calibration": self.spec.identity(), "code": source_hash()})

    def load(self, key: str) -> tuple[np.ndarray, np.ndarray, float, float] | None:
        """(NK codes, NK scales, output error, output energy) of a stored tensor, or None."""
        path = self.store / f"{key}.npz" if self.store else None
        if path is None or not path.is_file():
            return None
        try:
            with np.load(path) as z:
                return z["codes"], z["scales"], float(z["err"]), float(z["energy"])
        except (OSError, ValueError, KeyError):   # a damaged entry is recomputed (and replaced)
            return None

    def save(self, key: str, codes: np.ndarray, scales: np.ndarray, err: float, energy: float) -> None:
        self._store_put(f"{key}.npz", lambda tmp: np.savez(tmp, codes=codes, scales=scales,
                                                             err=np.float64(err), energy=np.float64(energy)))

    def _store_put(self, name: str, write) -> None:
        """write(temporary path) then rename it to store/name; nothing without a store."""
        if self.store is None:
            return
        tmp = self.store / f".{os.getpid()}.{name}"     # keeps the suffix: np.savez would add ".npz"
        try:
            self.store.mkdir(parents=True, exist_ok=True)
            write(tmp)
            os.replace(tmp, self.store / name)
        except OSError:
            tmp.unlink(missing_ok=True)   # the store is an optimisation: a full disk only loses the reuse

    # --------------------------------------------------------------------------------------- passes
    def _skeleton(self):
        import torch
        from transformers import AutoModelForCausalLM

        config = _transformers_config(self.hf_config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
        base = model.model
        # buffers computed at construction (rotary inverse frequencies) are not in the checkpoint: rebuild
        for name, child in list(base.named_children()):
            if any(b.is_meta for b in child.buffers()) and not any(True for _ in child.parameters()):
                setattr(base, name, type(child)(config=config))
        for name, child in base.named_children():
            if name != "layers" and any(b.is_meta for b in child.buffers()):
                raise ConfigError(f"calibration cannot rebuild {type(child).__name__} ({name}) of this model",
                                  fix="use a scheme with calibration: none")
        return model

    def _load(self, module: Any, prefix: str) -> None:
        """Weights of `module` (HF names under `prefix`) from the checkpoint, in float32."""
        import torch


        module.to_empty(device="cpu")
        for name, p in module.named_parameters():
            src = checkpoint_name(self.ckpt, f"{prefix}.{name}")
            slabs = expert_slabs(self.ckpt, src) if src not in self.ckpt else None
            if slabs is not None and len(slabs) == p.shape[0]:   # stacked experts: filled one expert at a time
                with torch.no_grad():
                    for e, read in enumerate(slabs):
                        p[e].copy_(torch.from_numpy(np.ascontiguousarray(read(), np.float32)).reshape(p[e].shape))
                continue
            arr = self.ckpt.get(src) if src in self.ckpt else None
            if arr is None:
                raise WeightsError(f"tensor {src!r} (needed for calibration) is not in the checkpoint",
                                   path=self.ckpt.path, fix="check that the weights belong to this model config")
            if int(np.prod(arr.shape)) != p.numel():
                raise WeightsError(f"shape mismatch for {src}: the config implies {list(p.shape)}, the weights "
                                   f"give {list(arr.shape)}", path=self.ckpt.path,
                                   fix="use the config.json that came with these weights")
            with torch.no_grad():
                p.copy_(torch.from_numpy(np.ascontiguousarray(arr, np.float32)).reshape(p.shape))

    def _embed(self, ids: np.ndarray):
        """Embedding rows of the token ids, gathered from the checkpoint (no full table in memory)."""
        import torch


        name = checkpoint_name(self.ckpt, "model.embed_tokens.weight")
        uniq, inverse = np.unique(ids, return_inverse=True)
        rows = np.empty((len(uniq), int(self.ckpt.shape(name)[1])), np.float32)
        start = 0
        while start < len(uniq):                 # contiguous runs of ids read together
            stop = start + 1
            while stop < len(uniq) and uniq[stop] == uniq[stop - 1] + 1:
                stop += 1
            rows[start:stop] = self.ckpt.get_rows(name, int(uniq[start]), int(uniq[stop - 1]) + 1)
            start = stop
        return torch.from_numpy(rows[inverse.reshape(ids.shape)])

    def _run_pass1(self) -> None:
        if self._model is not None:
            return
        import torch

        vocab = text_config(self.hf_config).vocab_size
        ids, self.description = token_windows(self.ckpt, self.spec, vocab)
        self._ids = ids
        self.tokens = int(ids.size)
        model = self._skeleton()
        base = model.model
        self._tmp = tempfile.TemporaryDirectory(prefix="calib-", dir=self.work_dir)
        folder = Path(self._tmp.name)
        lm = {}
        linear_bytes = sum(4 * m.in_features ** 2 for layer in base.layers for m in layer.modules()
                           if isinstance(m, torch.nn.Linear))
        self._all = {} if linear_bytes <= KEEP_ALL_BYTES else None
        recorders: list[Any] = []

        def before(i: int):
            def hook(mod, args, kwargs):
                hidden = args[0] if args else kwargs["hidden_states"]
                rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
                path = folder / f"layer{i}.npy"
                if self._all is None:
                    np.save(path, hidden.detach().numpy())
                self._inputs[i] = (path, tuple(args[1:]), rest)
                self._load(mod, f"model.layers.{i}")
                if self._all is not None:
                    self._all[i] = {}
                    recorders.extend(_record_linear_inputs(mod, f"model.layers.{i}", self._all[i]))
            return hook

        def after(mod, args, output):
            for h in recorders:
                h.remove()
            recorders.clear()
            mod.to_empty(device="meta")

        def final_norm(mod, args, output):
            lm["h"] = _second_moment(output)

        handles = []
        for i, layer in enumerate(base.layers):
            handles.append(layer.register_forward_pre_hook(before(i), with_kwargs=True))
            handles.append(layer.register_forward_hook(after))
        handles.append(base.norm.register_forward_hook(final_norm))
        self._load(base.norm, "model.norm")
        layers = len(base.layers)
        t0 = time.time()
        self._say(f"calibrate: {self.description} through {layers} layers …")
        try:
            with torch.no_grad():
                base(inputs_embeds=self._embed(ids), use_cache=False)
        finally:
            for h in handles:
                h.remove()
        self._say(f"calibrate: layer inputs measured in {time.time() - t0:.1f} s")
        self._lm_head = lm.get("h")
        self._model = model

    def _layer_hessians(self, i: int) -> dict[str, np.ndarray]:
        import torch

        layer = self._model.model.layers[i]
        path, args, kwargs = self._inputs[i]
        self._load(layer, f"model.layers.{i}")
        out: dict[str, np.ndarray] = {}
        handles = _record_linear_inputs(layer, f"model.layers.{i}", out)
        try:
            with torch.no_grad():
                layer(torch.from_numpy(np.load(path)), *args, **kwargs)
        finally:
            for h in handles:
                h.remove()
            layer.to_empty(device="meta")
        return out

    def _say(self, text: str) -> None:
        """A line above the conversion's progress bar (pass 1 runs lazily, inside it)."""
        if self.report is not None:
            self.report.info(text)


@dataclass(frozen=True)
class CalibratedInput:
    """One layer input of a Calibration, as the conversion of one parameter uses it."""

    calibration: Calibration
    module: str

    def hessian(self) -> np.ndarray:
        return self.calibration.hessian(self.module)

    def prepared(self):
        return self.calibration.prepared(self.module)

    def key(self, sources: list[str], bits: int) -> str:
        return self.calibration.key(sources, bits)

    def load(self, key: str):
        return self.calibration.load(key)

    def save(self, *args: Any) -> None:
        self.calibration.save(*args)


def _record_linear_inputs(layer: Any, prefix: str, out: dict[str, np.ndarray]) -> list[Any]:
    """Hooks that put H of each nn.Linear input of `layer` into out[<prefix>.<module name>]; modules fed
    the same tensor (q/k/v) share one array."""
    import torch

    seen: dict[int, tuple[Any, np.ndarray]] = {}   # id(input) -> (input, H); holding the input keeps its id
                                                   # (and memory) from being reused by a later tensor

    def record(name: str):
        def hook(mod, inp, output):
            x = inp[0]
            if id(x) not in seen:
                seen[id(x)] = (x, _second_moment(x))
            out[name] = seen[id(x)][1]
        return hook

    return [m.register_forward_hook(record(f"{prefix}.{n}"))
            for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)]


def _second_moment(x: Any) -> np.ndarray:
    """mean over tokens of x x^T, float32 [K, K] (accumulated by BLAS in float32 over the tokens)."""
    flat = x.detach().reshape(-1, x.shape[-1]).float()
    return ((flat.T @ flat) / flat.shape[0]).numpy()


def _layer_index(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2])
    return None


def module_for_param(param_base: str, tied: bool) -> str | None:
    """The HF linear module whose input feeds our parameter `param_base` (e.g. model.layers.0.self_attn.qkv_proj
    -> model.layers.0.self_attn.q_proj; a tied embedding table is also the lm_head)."""
    if param_base == "lm_head" or (tied and param_base.endswith("embed_tokens")):
        return "lm_head"
    if param_base.endswith("embed_tokens"):
        return None
    owner, _, leaf = param_base.rpartition(".")
    if leaf in FUSED:
        return f"{owner}.{FUSED[leaf][0]}"
    return param_base
