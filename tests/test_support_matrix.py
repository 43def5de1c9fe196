"""The support matrix: every model family and RoPE variant the loader accepts, built (library only, no weights)
for every target. Issue #39: a real Llama-3.x config failed on the GPU targets while the CPU targets built it.

Each family gets a tiny config (2-4 layers, hidden 128-256, vocab 320, real head dims) in its real checkpoint's shape; a cell runs
`stages.build` (fuse, schedule, compile; no PoCL / qemu run) with q4f16, the default scheme. A failing cell
names the family, the target and the kernel the error names (or says that it names none). The cells
are slow (`make test-slow`); the default suite checks that the matrix lists every architecture and RoPE type
the loader accepts, so a family added there without a matrix entry fails at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from typing import Any

import pytest
import tvm
from tvm import tirx

from pipeline.config import TARGETS, ModelSpec, load_quant, load_target
from pipeline.errors import ConfigError
from pipeline.frontend.gguf_file import _GGUF_ARCHS as GGUF_ARCHS
from pipeline.frontend.hf_config import HYBRID_ARCHITECTURES
from pipeline.kernels.cpu.rope import NO_CSE_ATTR
from pipeline.models import config_from_hf
from pipeline.models.llama import ARCHITECTURES, ROPE_SCALINGS
from pipeline.progress import Reporter
from pipeline.stages import Loaded, build, define, fuse, tune

# a vocabulary no other dim equals: android-hexagon pins every kernel with a vocab-sized dim to the CPU as the
# lm_head's (npu/hexagon.partition), which with vocab == hidden left no kernel on the NPU
VOCAB = 320
# head dims as in the real models (kernels are scheduled per head dim; TVM's CSE failure on the Llama-3 RoPE
# kernel shows at 64, not at 32 or 128): Llama 64 / 128, Qwen3 128, the hybrid 256 (rotary 64) and GDN 128
SIZES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
             rms_norm_eps=1e-6, max_position_embeddings=2048, rope_theta=10000.0)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                  "original_max_position_embeddings": 8192}
HYBRID_TEXT = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                   layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4,
                   num_key_value_heads=2, head_dim=256, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, vocab_size=VOCAB,
                   max_position_embeddings=2048, rms_norm_eps=1e-6,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                    "mrope_section": [11, 11, 10], "mrope_interleaved": True})
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)


def _dense(arch: str, model_type: str, **extra: Any) -> dict[str, Any]:
    return {"architectures": [arch], "model_type": model_type, **SIZES, "num_hidden_layers": 2,
            "tie_word_embeddings": True, **extra}


def _hybrid(arch: str, model_type: str, nested: bool, **extra: Any) -> dict[str, Any]:
    text = {**HYBRID_TEXT, **extra}
    if nested:   # the multimodal wrapper: text fields under text_config (real Qwen3.5 checkpoints)
        return {"architectures": [arch], "model_type": model_type, "tie_word_embeddings": False,
                "text_config": {**text, "model_type": f"{model_type}_text"}}
    return {"architectures": [arch], "model_type": f"{model_type}_text", "tie_word_embeddings": False, **text}


# family / variant -> a tiny HF config.json in that family's real shape
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": _dense("LlamaForCausalLM", "llama"),
    "llama-untied": _dense("LlamaForCausalLM", "llama", tie_word_embeddings=False),
    "llama-llama3-rope": _dense("LlamaForCausalLM", "llama", rope_theta=500000.0, rope_scaling=LLAMA3_SCALING),
    "llama-llama3-rope-head128": _dense("LlamaForCausalLM", "llama", head_dim=128, rope_theta=500000.0,
                                        rope_scaling=LLAMA3_SCALING),
    "llama-attention-bias": _dense("LlamaForCausalLM", "llama", attention_bias=True),
    "mistral": _dense("MistralForCausalLM", "mistral", tie_word_embeddings=False, sliding_window=4096),
    "qwen2": _dense("Qwen2ForCausalLM", "qwen2", tie_word_embeddings=False),
    "qwen3": _dense("Qwen3ForCausalLM", "qwen3", head_dim=128),
    "qwen3-moe": _dense("Qwen3MoeForCausalLM", "qwen3_moe", num_hidden_layers=3, decoder_sparse_step=1,
                        mlp_only_layers=[0], norm_topk_prob=True, tie_word_embeddings=False, head_dim=128, **MOE),
    "qwen3.5-hybrid-partial-rope": _hybrid("Qwen3_5ForConditionalGeneration", "qwen3_5", nested=True),
    "qwen3.5-hybrid-text-only": _hybrid("Qwen3_5ForCausalLM", "qwen3_5", nested=False),
    "qwen3.5-moe-hybrid": _hybrid("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", nested=True,
                                  shared_expert_intermediate_size=128, **MOE),
    "qwen3.5-moe-hybrid-text-only": _hybrid("Qwen3_5MoeForCausalLM", "qwen3_5_moe", nested=False,
                                            shared_expert_intermediate_size=128, **MOE),
}
# configs the loader refuses in one line (on every target) instead of building a model that ignores a field
REFUSED_FAMILIES: dict[str, tuple[dict[str, Any], str]] = {
    "llama-mlp-bias": (_dense("LlamaForCausalLM", "llama", mlp_bias=True), "mlp_bias is true"),
    "mistral-narrow-sliding-window": (_dense("MistralForCausalLM", "mistral", sliding_window=512),
                                      "sliding_window 512 is narrower than the context window 2048"),
    "qwen2-sliding-window": (_dense("Qwen2ForCausalLM", "qwen2", use_sliding_window=True, sliding_window=1024),
                             "sliding_window 1024 is narrower"),
}
BUILD_TARGETS = sorted(t for t in TARGETS if t != "android-vulkan")
REFUSED_TARGETS = {"android-vulkan": "needs TVM's target.build.vulkan code generator"}


def _rope_type(hf: dict[str, Any]) -> str:
    text = hf.get("text_config") or hf
    return (text.get("rope_scaling") or text.get("rope_parameters") or {}).get("rope_type") or "default"


# --------------------------------------------------------------------------------------------- naming a kernel
KERNEL_PATTERNS = (
    r"PrimFunc '?\"?([A-Za-z_][\w.]*)",              # our CompileErrors: "PrimFunc 'name' was not scheduled"
    r"@T\.prim_func[^\n]*\n\s*def ([A-Za-z_]\w*)",   # TVMScript of the offending function in TVM's message
    r"\bdef ([A-Za-z_]\w*)\(",
    r"global_symbol\"?:?\s*=?\s*\"([A-Za-z_]\w*)\"",
    r"\bfunction ([A-Za-z_]\w*)\b",
    r"\bkernel '?([A-Za-z_]\w*)",
)


def failing_kernel(error: BaseException, kernels: list[str] | tuple[str, ...] = ()) -> str | None:
    """The kernel a build error names: a known kernel name quoted in the message (longest first, so
    `fused_rope` beats `rope`), else a PrimFunc TVM printed; None when the message names none."""
    text = f"{type(error).__name__}: {error}"
    for name in sorted(kernels, key=len, reverse=True):
        if re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", text):
            return name
    for pattern in KERNEL_PATTERNS:
        found = re.search(pattern, text)
        if found:
            return found.group(1)
    return None


def _last_line(error: BaseException) -> str:
    """TVM's messages end with the failed check; ours are one line."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1] if lines else ''}"[:300]


def kernels_failing_alone(defined: Any, target: Any) -> list[str]:
    """The scheduled kernels that fail to compile each on its own (with the library's pass configuration: CSE
    off when a kernel is marked, as compile.build_library does), for an error that names none. TVM's CSE
    failure on the Llama-3 RoPE kernel is such an error ("variable cse_v2 has been used before definition")."""
    mod, _ = tune(fuse(defined, target), target)
    funcs = [(gv, f) for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)]
    no_cse = any(f.attrs is not None and NO_CSE_ATTR in f.attrs for _, f in funcs)
    failing = []
    for gv, func in funcs:
        alone = tvm.IRModule({gv: func.with_attr("global_symbol", gv.name_hint)})
        try:
            with tvm.transform.PassContext(config={"tirx.disable_cse_tir": True}) if no_cse \
                    else contextlib.nullcontext():
                tvm.compile(alone, target=target.tvm())
        except Exception:  # noqa: BLE001 - this kernel is (one of) the failing ones: collected, reported
            failing.append(gv.name_hint)
    return failing


def name_the_kernel(error: BaseException, defined: Any, target: Any) -> str:
    """'kernel X' from the error's text, else from compiling each kernel alone, else why none is named."""
    kernel = failing_kernel(error, [gv.name_hint for gv, _ in defined.mod.functions_items()])
    if kernel:
        return f"kernel {kernel}"
    try:
        alone = kernels_failing_alone(defined, target)
    except Exception as err:  # noqa: BLE001 - the diagnosis failed too: say so in the cell's message
        return f"no kernel named in the error (scheduling alone fails: {_last_line(err)})"
    if alone:
        return f"kernel {', '.join(alone)} (TVM's error names none; found by compiling each kernel alone)"
    return "no kernel named in the error, and every kernel compiles alone"


def build_cell(family: str, target_name: str) -> tuple[Any, dict[str, Any]]:
    """stages.build for one cell; an AssertionError naming the family, the target and the kernel on failure."""
    hf = FAMILIES[family]
    decoder = config_from_hf(hf)
    # named by what it builds: an alias (Mistral read as Llama, the hybrid's text-only class) that the loader
    # reads into the same model is the same library, a build-cache hit
    name = "matrix-" + hashlib.sha256(json.dumps(decoder.to_json(), sort_keys=True).encode()).hexdigest()[:10]
    loaded = Loaded(ModelSpec(name=name, hf_config=hf, weights=None), hf, decoder, None)
    target, quant = load_target(target_name), load_quant("q4f16")
    defined = define(loaded, quant, target)
    try:
        return build(loaded, defined, quant, target, Reporter(quiet=True), verify=False)
    except Exception as err:  # noqa: BLE001 - re-raised as the cell's verdict, naming what failed
        raise AssertionError(f"{family} on {target_name}: {name_the_kernel(err, defined, target)}: "
                             f"{_last_line(err)}") from err


# ------------------------------------------------------------------------------------------------ default suite
def test_matrix_lists_every_accepted_architecture_and_rope_type():
    """A family or RoPE type the loader learns must come with its matrix row."""
    archs = {a for hf in FAMILIES.values() for a in hf["architectures"]}
    assert archs == set(ARCHITECTURES) | set(HYBRID_ARCHITECTURES)
    assert set(GGUF_ARCHS.values()) <= archs   # a GGUF is read into the HF config of its architecture
    assert {_rope_type(hf) for hf in FAMILIES.values()} == {"default", *ROPE_SCALINGS}
    families = {config_from_hf(hf).family for hf in FAMILIES.values()}
    assert families == {*ARCHITECTURES.values(), "qwen3_5", "qwen3_5_moe"}
    assert set(BUILD_TARGETS) | set(REFUSED_TARGETS) == set(TARGETS)


def test_failing_kernel_is_read_from_the_error():
    err = RuntimeError("InternalError: variable cse_v20 has been used before definition\n"
                       "# from tvm.script import tirx as T\n@T.prim_func(private=True)\ndef fused_rope(var_qkv: T.handle):")
    assert failing_kernel(err, ["rope", "fused_rope", "gemv"]) == "fused_rope"
    assert failing_kernel(err) == "fused_rope"
    assert failing_kernel(RuntimeError("variable cse_v20 has been used before definition")) is None


@pytest.mark.parametrize("family", sorted(REFUSED_FAMILIES))
def test_refused_family_says_so_in_one_line(family):
    hf, words = REFUSED_FAMILIES[family]
    with pytest.raises(ConfigError, match=words) as err:
        config_from_hf(hf)
    assert "\n" not in str(err.value) and "fix:" in str(err.value)
    unused = {"mlp_bias": False, "use_sliding_window": False, "sliding_window": 4096}
    config_from_hf({**hf, **{k: v for k, v in unused.items() if k in hf}})   # the field alone decides


@pytest.mark.parametrize("target_name", sorted(REFUSED_TARGETS))
def test_refused_target_says_so_in_one_line(target_name):
    with pytest.raises(ConfigError, match=REFUSED_TARGETS[target_name]) as err:
        load_target(target_name)
    assert "\n" not in str(err.value) and "fix:" in str(err.value)


# ------------------------------------------------------------------------------------------------ the matrix
@pytest.mark.slow
@pytest.mark.parametrize("target_name", BUILD_TARGETS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_builds_for_target(family, target_name):
    lib_dir, info = build_cell(family, target_name)
    for lib in filter(None, (info["library"], info.get("npu_library"))):
        assert (lib_dir / lib).stat().st_size > 0, f"{family} on {target_name}: empty {lib}"
    if load_target(target_name).npu:   # the HVX objects are there, and kernels were placed on them
        hvx = [k["name"] for k in info["kernels"] if k["rule"] == "hvx" and k["on_device"]]
        assert info.get("npu_library") and hvx, f"{family} on {target_name}: no kernel on the NPU"


@pytest.mark.slow
def test_a_failing_cell_names_the_kernel(tmp_path, monkeypatch):
    """The issue's failure, brought back (Llama-3 RoPE kernel built with TVM's CSE on): TVM's error names no
    kernel, the cell names fused_rope (~60 s on a loaded 2-core machine)."""
    import pipeline.kernels.cpu.rope as rope

    monkeypatch.setenv("MLP_CACHE_DIR", str(tmp_path))   # not the working library from the matrix's cache
    monkeypatch.setattr(rope, "CSE_BREAKS", ())
    with pytest.raises(AssertionError) as err:
        build_cell("llama-llama3-rope", "android-adreno")
    assert str(err.value).startswith("llama-llama3-rope on android-adreno: kernel fused_rope (TVM's error names none")
    assert "cse_v" in str(err.value) and "used before definition" in str(err.value)
