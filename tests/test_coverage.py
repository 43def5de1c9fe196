"""The coverage report on a small SmolLM2-shaped model: op classes, callers, placement, honest bytes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.report.coverage import coverage_report, write_coverage

LAYERS = 3
SMALL = dict(architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536,
             num_hidden_layers=LAYERS, num_attention_heads=9, num_key_value_heads=3, vocab_size=2048,
             tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=1e5)


def _build(target_name: str):
    from pipeline.config import ModelSpec, load_quant, load_target
    from pipeline.models.llama import DecoderConfig
    from pipeline.stages import Loaded, define, fuse, tune

    target = load_target(target_name)
    spec = ModelSpec(name="smollm2-shape", hf_config=SMALL, weights=None)
    loaded = Loaded(spec, SMALL, DecoderConfig.from_hf(SMALL), None)
    defined = define(loaded, load_quant("q4f16"), target)
    mod, records = tune(fuse(defined, target), target)
    return defined, mod, records, target


@pytest.fixture(scope="module")
def adreno_built():
    return _build("android-adreno")


@pytest.fixture(scope="module")
def adreno(adreno_built):
    defined, mod, records, target = adreno_built
    return defined, coverage_report(mod, records, target), records


@pytest.fixture(scope="module")
def host_cpu():
    defined, mod, records, target = _build("host-cpu")
    return coverage_report(mod, records, target), records


def _q4_weight_bytes(params) -> int:
    """Independent estimate: uint32 codes + fp16 scales of every quantized matrix (linears + embedding/lm_head)."""
    return sum(int(np.prod([int(d) for d in p.shape])) * np.dtype(p.dtype).itemsize
               for name, p in params if name.endswith((".q_weight", ".q_scale")))


def test_adreno_everything_on_gpu_and_recorded(adreno):
    _, report, records = adreno
    rows = report["kernels"]
    assert len(rows) == len(records) == report["summary"]["kernels"]
    assert {r["placement"] for r in rows} == {"GPU"}
    assert report["summary"]["decode_step"]["cpu"]["bytes"] == 0
    assert report["summary"]["decode_step"]["accelerator"]["bytes_pct"] == 100.0
    json.dumps(report)   # JSON-able


def test_adreno_op_classes(adreno):
    _, report, _ = adreno
    cls = {r["name"]: r["op_class"] for r in report["kernels"]}
    assert cls["batch_decode_paged_kv"] == "attention"
    assert cls["batch_prefill_paged_kv"] == "attention"
    assert cls["rms_norm_split"] == "rmsnorm" and cls["fused_add_rms_norm"] == "rmsnorm"
    assert cls["take"] == "gather"
    assert cls["tir_kv_cache_transpose_append"] == "kv-cache"
    assert cls["fused_split_silu_multiply"] in ("elementwise", "injective")
    dq = [r for r in report["kernels"] if r["op_class"].startswith("dequant-")]
    assert dq and all(any(p["dtype"] == "uint32" for p in r["params"]) for r in dq)
    # decode variants are GEMVs, prefill variants (symbolic seq_len) are matmuls
    assert all(r["op_class"] == "dequant-gemv" for r in dq if r["callers"].get("decode"))
    assert all(r["op_class"] == "dequant-matmul" for r in dq if "seq_len" in json.dumps(r["params"]))


def test_adreno_dequant_gemv_called_by_decode_per_layer(adreno):
    defined, report, _ = adreno
    linear_per_layer = sum(1 for name, _ in defined.params
                           if name.startswith("model.layers.0.") and name.endswith(".q_weight"))
    assert linear_per_layer == 4     # qkv, o, gate_up, down
    gemv = [r for r in report["kernels"] if r["op_class"] == "dequant-gemv"]
    decode_calls = [r["callers"].get("decode", 0) for r in gemv]
    # one kernel per linear shape, each called once per layer, plus the (tied) lm_head once
    assert sorted(decode_calls) == [1] + [LAYERS] * linear_per_layer
    assert sum(decode_calls) == LAYERS * linear_per_layer + 1
    for r in gemv:
        assert r["decode_step"]["calls"] == r["callers"]["decode"]
        assert r["decode_step"]["flops"] > 0 and r["decode_step"]["bytes"] > 0


def test_adreno_decode_bytes_are_honest(adreno):
    defined, report, _ = adreno
    expected = _q4_weight_bytes(defined.params)
    got = report["summary"]["decode_step"]["total"]["bytes"]
    assert abs(got - expected) <= 0.10 * expected, (got, expected)
    phone = report["summary"]["phone"]
    assert phone["decode_step_ms"] == pytest.approx(got / (76.8 * 0.6 * 1e9) * 1e3, rel=1e-3)
    # a prefill chunk does the same weight reads but 256x the FLOPs of the linears
    assert report["summary"]["prefill_chunk"]["total"]["flops"] > 100 * report["summary"]["decode_step"]["total"]["flops"]


def test_adreno_total_row_is_sum_of_classes(adreno):
    _, report, _ = adreno
    classes = report["summary"]["op_classes"]
    total = report["summary"]["op_classes_total"]
    for key in total:
        assert total[key] == sum(c[key] for c in classes.values()), key
    assert total["kernels"] == len(report["kernels"])
    assert total["decode_bytes"] == report["summary"]["decode_step"]["total"]["bytes"]


def test_adreno_kv_cache_traffic_with_context(adreno_built):
    defined, mod, records, target = adreno_built
    plain = coverage_report(mod, records, target)
    ctx = 512
    report = coverage_report(mod, records, target, context_len=ctx)
    rows = {r["name"]: r for r in report["kernels"]}
    attn = rows["batch_decode_paged_kv"]["decode_step"]
    assert attn["calls"] == LAYERS and attn["costed"]
    assert rows["batch_prefill_paged_kv"]["prefill_chunk"]["calls"] == LAYERS
    assert report["summary"]["decode_step"]["not_costed"] == []
    assert plain["summary"]["decode_step"]["not_costed"] == ["batch_decode_paged_kv", "tir_kv_cache_transpose_append"]
    kv_heads, head_dim, fp16 = SMALL["num_key_value_heads"], SMALL["hidden_size"] // SMALL["num_attention_heads"], 2
    expected_kv = LAYERS * (ctx + 1) * 2 * kv_heads * head_dim * fp16       # K and V of every position, per layer
    extra = report["summary"]["decode_step"]["total"]["bytes"] - plain["summary"]["decode_step"]["total"]["bytes"]
    assert abs(extra - expected_kv) <= 0.05 * expected_kv, (extra, expected_kv)
    assert "context of 512" in report["summary"]["phone"]["note"]


def test_host_cpu_everything_on_cpu(host_cpu):
    report, records = host_cpu
    assert len(report["kernels"]) == len(records)
    assert {r["placement"] for r in report["kernels"]} == {"CPU"}
    assert report["summary"]["decode_step"]["accelerator"]["bytes"] == 0
    assert "phone" not in report["summary"]


def test_write_coverage(adreno, tmp_path):
    _, report, _ = adreno
    js, md = write_coverage(report, tmp_path)
    assert json.loads(js.read_text()) == json.loads(json.dumps(report))
    assert js.read_text() == json.dumps(report, indent=1, sort_keys=True) + "\n"
    text = md.read_text()
    assert "| **Total** |" in text
    kernels_section = text.split("## Kernels", 1)[1].split("\n## ", 1)[0]   # not the GPU launch-cost table after it
    kernel_lines = [line for line in kernels_section.splitlines() if line.startswith("| `")]
    assert len(kernel_lines) == len(report["kernels"])
    for r in report["kernels"]:
        assert sum(f"`{r['name']}`" in line for line in kernel_lines) == 1


@pytest.fixture(scope="module")
def default_model_rows():
    """The default model (SmolLM2-135M, q4f16) for android-adreno, fused + scheduled, without compiling."""
    from pipeline.config import load_model, load_quant, load_target
    from pipeline.stages import define, fuse, load, tune

    target = load_target("android-adreno")
    loaded = load(load_model("smollm2-135m"))
    defined = define(loaded, load_quant("q4f16"), target)
    mod, records = tune(fuse(defined, target), target)
    report = coverage_report(mod, records, target, param_names=[n for n, _ in defined.params])
    return loaded.decoder, report["kernels"]


def test_default_model_rows_name_their_module(default_model_rows):
    cfg, rows = default_model_rows
    gemv = {r["module"]: r for r in rows if r["op_class"] == "dequant-gemv"}
    down = gemv["layers.*.mlp.down_proj"]
    # the down_proj GEMV: intermediate -> hidden
    assert down["params"][-1]["shape"][-1] == cfg.hidden_size
    assert any(cfg.intermediate_size in p["shape"] for p in down["params"][:-1])
    assert {"layers.*.self_attn.qkv_proj", "layers.*.self_attn.o_proj", "layers.*.mlp.gate_up_proj",
            "lm_head (tied to embed_tokens)"} <= gemv.keys()
    by_name = {r["name"]: r["module"] for r in rows}
    assert by_name["dequantize_embedding"] == "embed_tokens"
    assert by_name["batch_decode_paged_kv"] == "layers.*.self_attn"
    # the first layer's input norm alone; every other norm is fused with the residual add before it (add_norm.py)
    assert by_name["rms_norm_split"] == "layers.*.input_layernorm", by_name["rms_norm_split"]
    assert set(by_name["fused_add_rms_norm"].split(", ")) == {"layers.*.input_layernorm",
                                                              "layers.*.post_attention_layernorm", "norm"}
    assert all(r["module"] for r in rows)


def test_a_gather_counts_only_the_gathered_rows_of_its_tables():
    """A q8 table tiled for host-cpu is gathered by one kernel that takes the whole codes and scales tables
    (layers.Q4Embedding._gather_tiled): a decode step reads one row of each, so the cost is the output's bytes
    (read, then written) plus the indices — not the scales table's megabytes."""
    from tvm import te

    from pipeline.report.coverage import _cost

    vocab, dim, seq = 4096, 256, 1
    ids = te.placeholder((seq,), "int32", name="ids")
    w = te.placeholder((vocab // 16, dim // 2, 32), "int8", name="w")
    s = te.placeholder((dim // 32, vocab), "float16", name="s")

    def value(i, j):
        t = ids[i]
        return w[t // 16, j // 2, t % 16 * 2 + j % 2].astype("float32") * s[j // 32, t].astype("float32")

    out = te.compute((seq, dim), value, name="embed_dequant")
    func = te.create_prim_func([ids, w, s, out])
    nbytes, _ = _cost("gather", func, func.script(), {})
    assert nbytes == 2 * seq * dim * 4 + seq * 4


def test_adreno_gpu_cost_columns_and_prediction(adreno):
    """Each decode GEMV row carries its launch (read from the scheduled TIR), our kernel's loads per work-item,
    and a predicted time that follows the stated model: bytes / (bandwidth x min(1, work-groups / 48))."""
    from pipeline.kernels.gpu.gemv import plan
    from pipeline.report.coverage import to_markdown
    from pipeline.report.gpu_cost import FILL_GROUPS

    _, report, _ = adreno
    pred = report["summary"]["gpu_prediction"]
    assert "PREDICTION" in pred["model"] and pred["bandwidth_gbs"] == 76.8
    gemvs = [r for r in report["kernels"] if r["rule"] == "dequant_gemv" and r["decode_step"]["calls"]]
    assert len(gemvs) == 5
    for r in gemvs:
        cost = r["gpu_cost"]
        (groups, items), = cost["launches"]
        k, n = (int(p["shape"][-1]) for p in r["params"] if len(p["shape"]) == 3)
        p = plan("q4", n, k)
        assert (groups, items, cost["loads_per_work_item"], cost["load_bytes"]) == (p.groups, p.tn * p.tk, p.loads, 16)
        want = r["decode_step"]["bytes_per_call"] / (76.8e3 * min(1.0, groups / FILL_GROUPS))
        assert cost["predicted_us_per_call"] == pytest.approx(want, abs=0.01)
    total = sum(r["gpu_cost"]["predicted_us_per_call"] * r["decode_step"]["calls"] for r in gemvs)
    assert pred["decode_gemv_us"] == pytest.approx(total, abs=0.1 * len(gemvs))
    assert "## GPU launch cost and predicted decode time (PREDICTION)" in to_markdown(report)


def test_adreno_attention_cost_at_1k_context(adreno_built):
    """With a context, the decode attention row is costed: our split-KV kernel's two launches for one sequence
    (3 KV heads x 16 parts of 64 work-items, then 9 heads x 8 column chunks = 72 merge groups of 1), its barriers, and a prediction from
    the streaming launch's 48 work-groups; TVM's kernel it replaced had 3 (test_gpu_attention.py)."""
    from pipeline.report.coverage import to_markdown

    _, mod, records, target = adreno_built
    report = coverage_report(mod, records, target, context_len=1024)
    row = next(r for r in report["kernels"] if r["name"] == "batch_decode_paged_kv")
    cost, step = row["gpu_cost"], row["decode_step"]
    assert cost["launches"] == [(48, 64), (72, 1)] and "2 per 64 keys" in cost["barriers"]
    assert step["calls"] == LAYERS and step["bytes_per_call"] > 1024 * 2 * 3 * 64 * 2
    assert cost["predicted_us_per_call"] == pytest.approx(step["bytes_per_call"] / 76.8e3, abs=0.01)
    assert "| barriers / launch |" in to_markdown(report)


def test_adreno_norm_launches_fill_the_gpu(adreno):
    """Each layer boundary (residual add, then the RMSNorm of the sum) is one fused_add_rms_norm launch with both
    outputs, the first layer's input norm one rms_norm_split launch (kernels/gpu/add_norm.py): 2 per layer instead
    of 4. At one token each is 48 work-groups of 64 (kernels/gpu/norm_rows.py), every one reading the whole row:
    the 47 re-reads are in its plan's bytes and in its prediction, at the full launch's bandwidth."""
    _, report, _ = adreno
    decode = {r["name"]: r for r in report["kernels"] if r["decode_step"]["calls"]}
    fused = [r for n, r in decode.items() if n.startswith("fused_add_rms_norm")]
    plain = [r for n, r in decode.items() if n.startswith("rms_norm_split")]
    assert sum(r["decode_step"]["calls"] for r in fused) == 2 * LAYERS
    assert [r["decode_step"]["calls"] for r in plain] == [1]
    assert [r["name"] for r in decode.values() if r["op_class"] == "rmsnorm" and r not in fused + plain] == []
    assert not [n for n in decode if n.startswith("add")], sorted(decode)
    row_bytes = SMALL["hidden_size"] * 2
    for r, inputs in [*((f, 2) for f in fused), *((p, 1) for p in plain)]:
        cost = r["gpu_cost"]
        assert cost["launches"] == [(48, 64)] and cost["barriers"] == "1"
        assert cost["reread_bytes"] == 47 * inputs * row_bytes
        want = (r["decode_step"]["bytes_per_call"] + cost["reread_bytes"]) / 76.8e3
        assert cost["predicted_us_per_call"] == pytest.approx(want, abs=0.01)


def test_rnn_state_builtins_count_as_calls_of_their_copy_kernels():
    """The runtime's RNN state runs the module's `rnn_state_{get|set}_{state id}` per builtin call
    (models/recurrent_state.py): those are decode calls of the copy kernels, by state id."""
    from tvm import relax as rx

    from pipeline.report.coverage import relax_callers

    bb = rx.BlockBuilder()
    state = rx.Var("state", rx.AnyType())
    with bb.function("decode", [state]):
        got = bb.emit(rx.call_dps_packed("vm.builtin.rnn_state_get", [state, rx.prim_value(2), rx.prim_value(1)],
                                         out_ty=rx.TensorType((1, 16), "float32")))
        new = bb.emit(rx.call_pure_packed("vm.builtin.rnn_state_set", state, rx.prim_value(2), rx.prim_value(1), got,
                                          ty_args=rx.AnyType()))
        new = bb.emit(rx.call_pure_packed("vm.builtin.rnn_state_set", new, rx.prim_value(0), rx.prim_value(0), got,
                                          ty_args=rx.AnyType()))
        bb.emit_func_output(new)
    calls, _ = relax_callers(bb.get())
    assert calls == {"rnn_state_get_1": {"decode": 1}, "rnn_state_set_1": {"decode": 1},
                     "rnn_state_set_0": {"decode": 1}}


def test_adreno_reshapes_that_become_views_launch_nothing(adreno_built):
    """A call of a pure reshape kernel is rewritten into a view when the library is lowered (compile.py:
    RewriteDataflowReshape): the report gives it no decode call, so its bytes are not in the decode step."""
    from tvm import relax

    from pipeline.report.coverage import relax_callers

    _, mod, records, target = adreno_built
    before, _ = relax_callers(mod)
    after, _ = relax_callers(relax.transform.RewriteDataflowReshape()(mod))
    views = {n for n, c in before.items() if "decode" in c and "decode" not in after.get(n, {})}
    assert views and all("reshape" in n for n in views), views
    report = coverage_report(mod, records, target)
    rows = {r["name"]: r for r in report["kernels"]}
    assert all(rows[n]["decode_step"]["calls"] == 0 for n in views)


# A qwen27b-shaped hybrid: 3 GDN layers of 2 key / 4 value heads of 32, 1 full attention (also test_oclgrind.py)
HYBRID_SHAPE = dict(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", hidden_size=128,
                    intermediate_size=256, num_hidden_layers=4,
                    layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4, vocab_size=512,
                    max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})


@pytest.mark.slow
def test_hybrid_adreno_gdn_state_traffic():
    """A qwen27b-shaped hybrid (3 GDN layers of 2 key / 4 value heads of 32, 1 full attention) for android-adreno
    (~30 s): the GDN decode row is our tiled kernel (launch, 16-byte state loads, 3 barriers, state read and
    written in its bytes); each GDN layer's state is copied in and out by the runtime (rnn_state_get / set,
    costed: twice the state); the state's reshapes are views."""
    from pipeline.config import ModelSpec, load_quant, load_target
    from pipeline.kernels.gpu.gdn import plan
    from pipeline.models import config_from_hf
    from pipeline.stages import Loaded, define, fuse, tune

    hf = HYBRID_SHAPE
    target = load_target("android-adreno")
    defined = define(Loaded(ModelSpec(name="hybrid-shape", hf_config=hf, weights=None), hf, config_from_hf(hf), None),
                     load_quant("q4f16"), target)
    mod, records = tune(fuse(defined, target), target)
    rows = {r["name"]: r for r in coverage_report(mod, records, target, context_len=64)["kernels"]}
    state = 4 * 32 * 32 * 4
    gdn = rows["gdn_decode"]
    p = plan(4, 32, 32, 128)
    assert gdn["decode_step"]["calls"] == 3 and gdn["decode_step"]["bytes_per_call"] > 2 * state
    assert gdn["gpu_cost"]["launches"] == [(p.groups, p.work_items)] and gdn["gpu_cost"]["barriers"] == "3"
    assert (gdn["gpu_cost"]["loads_per_work_item"], gdn["gpu_cost"]["load_bytes"]) == (8, 16)
    for name in ("rnn_state_get_1", "rnn_state_set_1"):
        assert rows[name]["decode_step"]["calls"] == 3 and rows[name]["decode_step"]["bytes_per_call"] == 2 * state + 8
        assert rows[name]["gpu_cost"]["predicted_us_per_call"] is not None
    assert not [n for n, r in rows.items() if r["decode_step"]["calls"] and r["decode_step"]["bytes_per_call"] == 2 * state
                and "reshape" in n]
    # the zero-centred norms (scale 1 + w): each residual add + norm one launch, the first input norm and the full
    # attention layer's q / k norms (4 / 2 heads of 32) one each, every one 48 work-groups at one token
    decode = {n: r for n, r in rows.items() if r["decode_step"]["calls"]}
    assert sum(r["decode_step"]["calls"] for n, r in decode.items() if n.startswith("fused_add_rms_norm")) == 8
    assert sorted(r["decode_step"]["calls"] for n, r in decode.items() if n.startswith("rms_norm_split")) == [1, 1, 1]
    assert not [n for n in decode if n.startswith(("add", "rms_norm")) and not n.startswith("rms_norm_split")], decode
    assert all(r["gpu_cost"]["launches"] == [(48, 64)] for n, r in decode.items() if n.startswith(
        ("fused_add_rms_norm", "rms_norm_split")))
    # each GDN layer's q / k L2 norm: one launch over the 2 x 2 key heads' rows, 48 work-groups (12 per row)
    l2 = [r for n, r in decode.items() if r["op_class"] == "l2norm"]
    assert [(r["decode_step"]["calls"], r["gpu_cost"]["launches"]) for r in l2] == [(3, [(48, 64)])], l2
