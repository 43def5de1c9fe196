"""Qwen3.5 hybrid (qwen27b's architecture): compiled host-cpu libraries vs transformers' own Qwen3.5 text model.

Tiny configs made here (4 layers [linear x3, full], GQA, partial RoPE, GDN with 2 key / 4 value heads).
q0f32: max |Δlogit| ≤ 1e-3 × max |reference logit| over a 64-token prefill and 32 decode steps, greedy tokens
identical — also with the prompt split across two prefill chunks (conv + delta-rule state carried).
q4f16: top-1 agreement ≥ 90% with fp32 transformers over teacher-forced positions, on a tiny model trained
here for a few seconds on a synthetic language (random weights give near-flat logits, where the top-1 of an
untrained model is noise: 33% agreement with int4 weights even though the kernels are exact).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipeline.runtime.runner import Bundle

VOCAB = 512
PROMPT_LEN = 64
DECODE_STEPS = 32
LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]


def tiny_qwen35(folder, seed: int = 0):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=4, layer_types=LAYER_TYPES,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
        vocab_size=VOCAB, max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(cfg).eval()
    with torch.no_grad():   # widen the tiny init; give the zero-centred norms non-trivial weights
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(3.0)
            elif name.endswith("norm.weight") and "linear_attn" not in name:
                p.normal_(0.0, 0.3)
    return model


ACTIVE = 64   # tokens the synthetic language uses (of VOCAB): few enough to learn in ~100 steps


def chain(rng, batch: int, n: int, perm: np.ndarray) -> np.ndarray:
    """A synthetic language: token t is perm[token t-2] with p = 0.9, else uniform over ACTIVE tokens (a lag
    of 2 needs the token mixers: the GDN conv / delta rule or attention, not just a bigram table)."""
    x = np.empty((batch, n), np.int64)
    x[:, :2] = rng.integers(0, ACTIVE, (batch, 2))
    for t in range(2, n):
        follow = rng.random(batch) < 0.9
        x[:, t] = np.where(follow, perm[x[:, t - 2]], rng.integers(0, ACTIVE, batch))
    return x


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen35_random")
    model = tiny_qwen35(folder)
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model


@pytest.fixture(scope="module")
def trained_model(tmp_path_factory):
    """~15 s of AdamW on the synthetic language (loss 6.5 -> ~1.1)."""
    folder = tmp_path_factory.mktemp("qwen35_trained")
    model = tiny_qwen35(folder).train()
    rng, perm = np.random.default_rng(0), np.random.default_rng(1).permutation(ACTIVE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(100):
        x = torch.from_numpy(chain(rng, 16, 32, perm))
        loss = model(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    word_tokenizer().save_pretrained(folder)
    return folder, model, perm, float(loss.detach())


def word_tokenizer():
    """Token i is the word `w<i>` (a whitespace word-level vocabulary of VOCAB words, no chat template)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")


def reference(model, ids, steps):
    """transformers with its cache: prefill logits, then (logits, greedy token) per decode step."""
    with torch.no_grad():
        out = model(torch.tensor([list(ids)]), use_cache=True)
        prefill, cache = out.logits[0].numpy(), out.past_key_values
        tok, tokens, decode = int(out.logits[0, -1].argmax()), [], []
        for _ in range(steps):
            tokens.append(tok)
            out = model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            decode.append(out.logits[0, -1].numpy())
            tok = int(out.logits[0, -1].argmax())
    return prefill, np.stack(decode), tokens


def ours(engine, ids, steps):
    prefill = engine.prefill(list(ids), all_logits=True)
    tok, tokens, decode = int(np.argmax(prefill[-1])), [], []
    for _ in range(steps):
        tokens.append(tok)
        decode.append(engine.decode(tok))
        tok = int(np.argmax(decode[-1]))
    return prefill, np.stack(decode), tokens


def assert_close(got, want, what, rel=1e-3):
    scale = float(np.abs(want).max())
    diff = float(np.abs(got - want).max())
    assert diff <= rel * scale, f"{what}: max |Δ| {diff:.3g} > {rel} × logit scale {scale:.3g}"


@pytest.mark.slow     # ~46 s: `make test-slow`
def test_hybrid_regions_with_views_are_bit_identical(random_model, build_bundle, tmp_path):
    """The hybrid decode's regions run through its reshapes (q / k / v to heads, the GDN state's shapes) as
    views of the same memory; the same library without the merge gives the same logits to the bit."""
    from test_cpu_regions import decode_logits, unmerged_library

    from pipeline.artifacts.tensor_cache import iter_tensor_cache
    from pipeline.runtime.engine import Engine

    folder, _ = random_model
    bundle = build_bundle(folder, "host-cpu", "q0f32")
    regions = json.loads((bundle / "reports" / "coverage.json").read_text())["cpu_regions"]["regions"]
    assert any(r["views"] and r["calls"].get("decode") for r in regions.values())
    merged = Bundle(bundle).engine()
    plain = Engine(unmerged_library(str(folder), tmp_path, "q0f32"), iter_tensor_cache(bundle))
    prompt = np.random.default_rng(2).integers(0, VOCAB, 20)
    ours, reference = decode_logits(merged, prompt, 4), decode_logits(plain, prompt, 4)
    assert np.abs(reference).max() > 0
    np.testing.assert_array_equal(ours, reference)


@pytest.mark.parametrize("chunk", [None, 40], ids=["one-chunk", "two-chunks"])
def test_q0f32_matches_transformers(random_model, build_bundle, chunk):
    folder, model = random_model
    bundle = Bundle(build_bundle(folder, "host-cpu", "q0f32"))
    # the decode compared below runs merged CPU regions (pipeline/kernels/cpu/regions.py), across the GDN layers'
    # multi-output splits whose tuples are read again after the region: a fraction of the kernel calls
    calls = json.loads((bundle.path / "reports" / "coverage.json").read_text())["cpu_regions"]["calls_per_step"]
    assert calls["decode"]["calls"] * 2 < calls["decode"]["kernels"]
    meta = bundle.engine().meta
    assert meta["kv_state_kind"] == "hybrid"
    assert meta["rnn_state"]["layers"] == [0, 1, 2] and meta["kv_cache"]["layers"] == [3]
    engine = bundle.engine()
    if chunk:
        engine.chunk = chunk          # 64 prompt tokens -> prefill calls of 40 + 24
    ids = np.random.default_rng(1).integers(0, VOCAB, PROMPT_LEN)
    got_prefill, got_decode, got_tokens = ours(engine, ids, DECODE_STEPS)
    ref_prefill, ref_decode, ref_tokens = reference(model, ids, DECODE_STEPS)
    assert_close(got_prefill, ref_prefill, "prefill logits")
    assert_close(got_decode, ref_decode, "decode logits")
    assert got_tokens == ref_tokens


def test_greedy_step_keeps_the_recurrent_state(random_model, build_bundle):
    """decode_greedy (embed + decode + argmax in one call) carries the GDN states like decode: the same
    ids as numpy's argmax of decode's logits, step for step."""
    folder, model = random_model
    engine = Bundle(build_bundle(folder, "host-cpu", "q0f32")).engine()
    assert engine.vm.module.implements_function("decode_greedy")
    ids = np.random.default_rng(3).integers(0, VOCAB, PROMPT_LEN)
    _, _, plain = ours(engine, ids, DECODE_STEPS)
    engine.reset()
    greedy = [int(np.argmax(engine.prefill(list(ids))))]
    while len(greedy) < DECODE_STEPS:
        greedy.append(engine.decode_greedy(greedy[-1]))
    assert greedy == plain == reference(model, ids, DECODE_STEPS)[2]


def test_reset_starts_a_fresh_state(random_model, build_bundle):
    folder, _ = random_model
    engine = Bundle(build_bundle(folder, "host-cpu", "q0f32")).engine()
    ids = list(range(5, 37))
    first = engine.prefill(ids)
    engine.decode(int(np.argmax(first)))
    engine.reset()
    np.testing.assert_array_equal(engine.prefill(ids), first)


def test_q4f16_top1_agreement(trained_model, build_bundle):
    folder, model, perm, final_loss = trained_model
    assert final_loss < 1.5, f"the toy did not learn its language (loss {final_loss:.2f})"
    ids = chain(np.random.default_rng(7), 1, 128, perm)[0]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    got = Bundle(build_bundle(folder, "host-cpu", "q4f16")).engine().prefill(list(ids), all_logits=True)
    agreement = float((got.argmax(-1) == ref.argmax(-1)).mean())
    assert agreement >= 0.90, f"q4f16 top-1 agreement {agreement:.1%} < 90% over {len(ids)} positions"


def test_real_27b_config():
    from pipeline.config import load_model
    from pipeline.models import config_from_hf
    from pipeline.models.qwen3_5 import HybridConfig

    spec = load_model("qwen27b")
    cfg = config_from_hf(spec.hf_config)
    assert isinstance(cfg, HybridConfig)
    assert (len(cfg.linear_layers), len(cfg.full_layers)) == (48, 16)
    assert cfg.full_layers[:2] == [3, 7] and cfg.rotary_dim == 64 and cfg.rope_theta == 1e7
    assert cfg.conv_dim == 10240 and not cfg.tie_word_embeddings
    (conv_shape, _), (rec_shape, rec_dtype) = cfg.rnn_states("float16")
    assert conv_shape == [3, 10240] and rec_shape == [48, 128, 128] and rec_dtype == "float32"
    assert 48 * np.prod(rec_shape) * 4 == 150_994_944     # ≈151 MB of fp32 recurrent state


def test_bad_layer_types_is_a_config_error():
    from pipeline.errors import ConfigError
    from pipeline.models import config_from_hf

    hf = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "num_hidden_layers": 2,
          "layer_types": ["linear_attention", "sliding_attention"], "hidden_size": 64, "intermediate_size": 128,
          "num_attention_heads": 2, "num_key_value_heads": 1, "linear_num_key_heads": 1,
          "linear_num_value_heads": 2, "linear_key_head_dim": 32, "linear_value_head_dim": 32, "vocab_size": 64}
    with pytest.raises(ConfigError, match="layer_types"):
        config_from_hf(hf)


def test_multimodal_checkpoint_layout_converts_like_text_only(random_model, tmp_path):
    """Qwen3_5ForConditionalGeneration keeps the text model under model.language_model.; the vision tower
    and MTP head are skipped with one info line, and the converted weights equal the text-only ones."""
    from safetensors.numpy import load_file, save_file

    from pipeline import stages
    from pipeline.config import load_model, load_quant, load_target
    from pipeline.progress import Reporter

    folder, _ = random_model
    text_cfg = json.loads((folder / "config.json").read_text())
    mm = tmp_path / "multimodal"
    mm.mkdir()
    tensors = {}
    for f in folder.glob("*.safetensors"):
        for name, arr in load_file(f).items():
            new = name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name
            tensors[new] = arr
    tensors["model.visual.patch_embed.proj.weight"] = np.zeros((8, 3, 2, 2), np.float32)
    tensors["mtp.fc.weight"] = np.zeros((4, 4), np.float32)
    save_file(tensors, mm / "model.safetensors")
    (mm / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "tie_word_embeddings": False, "text_config": {**text_cfg, "model_type": "qwen3_5_text"}}))

    quant, target = load_quant("q4f16"), load_target("host-cpu")
    lines: list[str] = []
    report = Reporter(quiet=True)
    report.info = lines.append
    caches = []
    for path in (folder, mm):
        loaded = stages.load(load_model(str(path)))
        caches.append(stages.quantize(loaded, stages.define(loaded, quant, target), quant, report))
    assert any("skipping 1 vision tower tensors (model.visual.*) and 1 multi-token-prediction head tensors"
               in line for line in lines), lines
    shards = sorted(p.name for p in caches[0].glob("params_shard_*.bin"))
    assert shards and shards == sorted(p.name for p in caches[1].glob("params_shard_*.bin"))
    for name in shards:
        assert (caches[0] / name).read_bytes() == (caches[1] / name).read_bytes()


@pytest.mark.parametrize("target", ["android-adreno", pytest.param("android-cpu", marks=pytest.mark.slow)])
def test_phone_targets_place_every_hybrid_kernel(random_model, build_bundle, target):
    """Adreno: every kernel (GDN, conv, gates, RNN-state copies, attention) is an OpenCL kernel in the
    library — none silently left on the CPU. android-cpu: the same model builds for aarch64."""
    import tarfile

    folder, _ = random_model
    bundle = build_bundle(folder, target, "q4f16", verify=False)   # placement only: 20 s, not 65 (PoCL run: below)
    build = json.loads((bundle / "reports" / "kernels.json").read_text())
    kernels, prefix = {k["name"]: k for k in build["kernels"]}, build["system_lib_prefix"]
    for name in ("gdn_prefill", "gdn_decode", "rnn_state_get_1", "rnn_state_set_1"):
        assert name in kernels, sorted(kernels)
    meta = json.loads((bundle / "mlc-chat-config.json").read_text())
    assert meta["model_type"] == "qwen3_5"
    if target != "android-adreno":
        return
    assert all(k["on_device"] for k in kernels.values()), [n for n, k in kernels.items() if not k["on_device"]]
    assert kernels["gdn_prefill"]["rule"] == "library" and kernels["gdn_decode"]["rule"] == "library"
    with tarfile.open(next((bundle / "lib").glob("*.tar"))) as tar:
        devc = next(m for m in tar.getmembers() if m.name.endswith("_devc.o"))
        source = tar.extractfile(devc).read()
    for name in ("gdn_prefill", "gdn_decode", "gdn_gates", "gdn_conv1d_silu", "rnn_state_get_1", "rnn_state_set_0"):
        assert f"{prefix}{name}".encode() in source or f"{prefix}fused_{name}".encode() in source, name


@pytest.mark.slow     # the default Adreno build, its kernels run on PoCL at build time (~65 s): `make test-slow`
def test_hybrid_adreno_build_runs_its_kernels_on_pocl(random_model, build_bundle):
    from pipeline.verify.opencl import find_opencl_device

    if find_opencl_device() is None:
        pytest.skip("no OpenCL platform (install pocl-opencl-icd)")
    cov = json.loads((build_bundle(random_model[0], "android-adreno", "q4f16") / "reports" / "coverage.json"
                      ).read_text())
    rows = {r["name"]: r["executed"] for r in cov["kernels"]}
    e = cov["summary"]["execution"]
    print({n: v for n, v in rows.items() if not v.startswith("executed here")})
    assert not e["mismatched"] and e["executed"] >= 20 and e["executed"] + e["not_executed"] == len(rows)


def test_pipeline_run_drives_a_hybrid_bundle(trained_model, build_bundle, capsys):
    """`python -m pipeline run` on a hybrid bundle: greedy text equals transformers' greedy generate."""
    from pipeline.cli import main

    folder, model, perm, _ = trained_model
    prompt_ids = [int(x) for x in chain(np.random.default_rng(3), 1, 12, perm)[0]]
    bundle = build_bundle(folder, "host-cpu", "q0f32")
    assert main(["run", str(bundle), "--prompt", " ".join(f"w{i}" for i in prompt_ids),
                 "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr()
    with torch.no_grad():
        # an explicit mask: without one generate masks every prompt token equal to pad_token_id (this
        # prompt holds a 0), which changed its first token
        ref = model.generate(torch.tensor([prompt_ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                             pad_token_id=0, attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long)
                             )[0, len(prompt_ids):].tolist()
    assert out.out.split() == [f"w{i}" for i in ref]
    assert "prompt tokens" in out.err and "decode" in out.err


def test_batch_prefill_and_decode_scan_each_sequence_from_its_own_state(random_model, build_bundle):
    """MLC's engine serves a hybrid model only through batch_prefill / batch_decode (with the RNN state): two
    prompts of different lengths prefilled in one call, then decoded together, give transformers' logits for
    each prompt alone (the GDN conv windows and delta-rule scans restart at each sequence's boundary)."""
    import tvm
    import tvm_ffi
    from tvm.runtime import ShapeTuple

    folder, model = random_model
    engine = Bundle(build_bundle(folder, "host-cpu", "q0f32")).engine()
    prompts = [np.random.default_rng(11).integers(0, VOCAB, 23), np.random.default_rng(12).integers(0, VOCAB, 9)]
    refs = [reference(model, p, 2) for p in prompts]
    vm, params = engine.vm, engine._param_array
    kv = vm["create_tir_paged_kv_cache"](ShapeTuple([2]), ShapeTuple([1024]), ShapeTuple([64]), ShapeTuple([16]),
                                         ShapeTuple([0]))
    rnn = vm["create_rnn_state"](ShapeTuple([2]), ShapeTuple([1]))
    for state in (kv, rnn):
        for s in (0, 1):
            tvm_ffi.get_global_func("vm.builtin.kv_state_add_sequence")(state, s)

    def step(fn, ids, lengths, *extra):
        emb = vm["embed"](tvm.runtime.tensor(np.asarray(ids, "int32")), params)
        shape = (1, len(ids), emb.shape[1]) if fn == "batch_prefill" else (len(ids), 1, emb.shape[1])
        for state in (kv, rnn):
            tvm_ffi.get_global_func("vm.builtin.kv_state_begin_forward")(state, ShapeTuple([0, 1]),
                                                                         ShapeTuple(lengths))
        logits, *_ = vm[fn](emb._create_view(shape), *extra, kv, rnn, params)
        for state in (kv, rnn):
            tvm_ffi.get_global_func("vm.builtin.kv_state_end_forward")(state)
        return logits.numpy()

    ends = np.cumsum([len(p) for p in prompts]).astype("int32") - 1
    logits = step("batch_prefill", np.concatenate(prompts), [len(p) for p in prompts], tvm.runtime.tensor(ends))
    for i, (prefill, _, tokens) in enumerate(refs):
        assert_close(logits[0, i], prefill[-1], f"batch_prefill, sequence {i}")
        assert int(np.argmax(logits[0, i])) == tokens[0]
    logits = step("batch_decode", [tokens[0] for _, _, tokens in refs], [1, 1])
    for i, (_, decode, _) in enumerate(refs):
        assert_close(logits[i, 0], decode[0], f"batch_decode, sequence {i}")
