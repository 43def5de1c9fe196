"""The speed benchmark's math and plumbing (benchmarks/speed.py), on made-up data: no timing assertions."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from benchmarks import speed
from pipeline.config import QUANTIZATIONS


def test_spread_is_median_min_max():
    assert speed.spread([3.0, 1.0, 10.0, 2.0]) == {"median": 2.5, "min": 1.0, "max": 10.0, "n": 4}
    assert speed.spread([7]) == {"median": 7.0, "min": 7.0, "max": 7.0, "n": 1}
    assert speed.spread([])["median"] is None


def test_roofline_ratio():
    # 10 tok/s reading 100 MB per token = 1 GB/s, on a 4 GB/s machine: a quarter of the roofline
    assert speed.roofline_ratio(10.0, 100e6, 4e9) == pytest.approx(0.25)


def test_phone_prediction_by_hand():
    # 0.6 x 76.8 GB/s / 78.6 MB per token
    assert speed.predicted_tok_s(76.8, 78.6e6, 0.6) == pytest.approx(0.6 * 76.8e9 / 78.6e6)
    assert speed.predicted_tok_s(76.8, 78.6e6, 0.6) == pytest.approx(586.26, abs=0.01)
    rows = [{"side": "ours", "model": "m", "scheme": "q4f16", "bytes_per_token": 1e8},
            {"side": "llama.cpp", "model": "m", "scheme": "Q4_0", "bytes_per_token": 1e8}]
    phones = {"a": {"bandwidth_gbs": 50.0}, "b": {"bandwidth_gbs": 100.0}}
    (pred,) = speed.phone_predictions(rows, phones, 0.6)
    assert pred["predicted_tok_s"] == {"a": 300.0, "b": 600.0}


def _tiny_gguf(path, tied: bool):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))          # 128 bytes
    w.add_tensor("blk.0.attn_q.weight", np.zeros((4, 4), np.float16))        # 32 bytes
    w.add_tensor("output_norm.weight", np.zeros(4, np.float32))              # 16 bytes
    if not tied:
        w.add_tensor("output.weight", np.zeros((8, 4), np.float16))           # 64 bytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_decode_bytes_untied_skips_the_embedding(tmp_path):
    _tiny_gguf(tmp_path / "u.gguf", tied=False)
    info = speed.gguf_decode_bytes(tmp_path / "u.gguf")
    assert info["file_tensor_bytes"] == 128 + 32 + 16 + 64
    assert info["bytes_per_token"] == 32 + 16 + 64
    assert not info["tied_embeddings"]
    assert info["params"] == 32 + 16 + 4 + 32


def test_gguf_decode_bytes_tied_counts_the_embedding_as_lm_head(tmp_path):
    _tiny_gguf(tmp_path / "t.gguf", tied=True)
    info = speed.gguf_decode_bytes(tmp_path / "t.gguf")
    assert info["tied_embeddings"]
    assert info["bytes_per_token"] == 128 + 32 + 16


def test_gguf_kv_bytes_per_position_from_its_metadata(tmp_path):
    """Keys + values of every layer in f16 (llama-bench's default cache): 3 layers x 2 KV heads x (16 + 16)
    x 2 bytes; the head size is the width / heads when the GGUF does not give key_length."""
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    w.add_block_count(3)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_tensor("blk.0.attn_q.weight", np.zeros((4, 4), np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert speed.gguf_decode_bytes(tmp_path / "m.gguf")["kv_bytes_per_position"] == 3 * 2 * (16 + 16) * 2
    _tiny_gguf(tmp_path / "bare.gguf", tied=True)     # no attention metadata: not guessed
    assert speed.gguf_decode_bytes(tmp_path / "bare.gguf")["kv_bytes_per_position"] is None


def test_kv_read_bytes_is_the_mean_cached_length_of_the_decode_run(tmp_path):
    # after a 128-token prompt, decode steps 1..4 attend over 129..132 positions: 130.5 on average
    assert speed.kv_read_bytes(1000, 128, 4) == pytest.approx(1000 * (129 + 130 + 131 + 132) / 4)
    assert speed.bundle_kv_bytes_per_position(tmp_path) is None      # no memory report: not counted
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "memory.json").write_text(json.dumps({"kv_cache": {"bytes_per_token": 46080}}))
    assert speed.bundle_kv_bytes_per_position(tmp_path) == 46080


def test_bundle_decode_bytes_reads_the_coverage_summary(tmp_path):
    (tmp_path / "reports").mkdir()
    cov = {"summary": {"decode_step": {"total": {"bytes": 12345, "flops": 1}}}}
    (tmp_path / "reports" / "coverage.json").write_text(json.dumps(cov))
    assert speed.bundle_decode_bytes(tmp_path) == 12345


def test_yaml_rows_parse_and_name_real_presets():
    import gguf

    cfg = speed.load_config()
    assert cfg["models"][0]["name"] == "smollm2-135m"
    for m in cfg["models"]:
        assert m["prefill"][0] == 128 and all(isinstance(n, int) for n in m["prefill"])
        assert m["reps"] >= 1 and m.get("long_reps", 1) >= 1
        assert set(m.get("ours", cfg["ours"])) <= set(cfg["ours"])
        assert set(m.get("llamacpp", cfg["llamacpp"])) <= set(cfg["llamacpp"])   # a model's own types: a subset
        assert set(m.get("long_prefill_schemes", [])) <= set(cfg["ours"])
    assert set(cfg["ours"]) <= set(QUANTIZATIONS), "every scheme is a configs/quant preset"
    for t in cfg["llamacpp"]:   # llama-quantize type names are LlamaFileType members without MOSTLY_
        assert f"MOSTLY_{t}" in gguf.LlamaFileType.__members__, t
    for g in cfg["goals"]:
        assert g["ours"] in cfg["ours"] and g.get("theirs", "Q4_0") in cfg["llamacpp"]
        assert ("at_least" in g) != ("at_most" in g)
    quick = speed.load_config(quick=True)
    assert [m["name"] for m in quick["models"]] == ["smollm2-135m"]
    assert quick["models"][0]["prefill"] == [128]
    assert quick["models"][0]["reps"] <= cfg["models"][0]["reps"]


def test_goal_verdicts_ratios_and_missing():
    rows = [{"model": "m", "side": "ours", "scheme": "q4f16", "decode_tok_s": {"median": 5.0},
             "prefill_tok_s": {"128": {"median": 20.0}}, "roofline": 0.8, "decode_rss_bytes": 130},
            {"model": "m", "side": "llama.cpp", "scheme": "Q4_0", "decode_tok_s": {"median": 10.0},
             "prefill_tok_s": {"128": {"median": 10.0}}, "decode_rss_bytes": 100}]
    goals = [{"metric": "decode_tok_s", "ours": "q4f16", "theirs": "Q4_0", "at_least": 1.0},
             {"metric": "prefill_tok_s", "prompt": 128, "ours": "q4f16", "theirs": "Q4_0", "at_least": 1.0},
             {"metric": "roofline", "ours": "q4f16", "at_least": 0.7},
             {"metric": "decode_rss", "ours": "q4f16", "theirs": "Q4_0", "at_most": 1.2},
             {"metric": "decode_tok_s", "ours": "ternary_ptq", "theirs": "TQ2_0", "at_least": 1.0}]
    v = speed.goal_verdicts(rows, goals, ["m"])
    assert [g["value"] for g in v] == [pytest.approx(0.5), pytest.approx(2.0), 0.8, pytest.approx(1.3), None]
    assert [g["met"] for g in v] == [False, True, True, False, None]
    assert v[0]["best_vs_best"] is None   # no max in the made-up spreads
    rows[0]["decode_tok_s"], rows[1]["decode_tok_s"] = speed.spread([4.0, 6.0]), speed.spread([2.0, 12.0])
    assert speed.goal_verdicts(rows, goals[:1], ["m"])[0]["best_vs_best"] == pytest.approx(0.5)
    assert all(speed._goal_text(g) for g in v)


def test_random_model_tensors_match_the_count_and_are_deterministic():
    spec = {"seed": 3, "std": 0.02, "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 96,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 50, "tie_word_embeddings": True}
    a, b = speed._random_tensors(spec), speed._random_tensors(spec)
    assert sum(t.size for t in a.values()) == speed.random_model_params(spec)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    q = a["model.layers.0.self_attn.q_proj.weight"].astype(np.float64)
    assert q.dtype == np.float64 and np.isfinite(q).all() and abs(q.std() - 0.02) < 0.003
    untied = dict(spec, tie_word_embeddings=False)
    assert sum(t.size for t in speed._random_tensors(untied).values()) == speed.random_model_params(untied)


def test_random_qwen3_model_has_its_norms_and_head_dim():
    spec = {"architecture": "qwen3", "seed": 1, "std": 0.02, "hidden_size": 64, "num_hidden_layers": 2,
            "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "vocab_size": 50, "max_position_embeddings": 128, "tie_word_embeddings": True}
    t = speed._random_tensors(spec)
    assert sum(a.size for a in t.values()) == speed.random_model_params(spec)
    assert t["model.layers.1.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    assert t["model.layers.1.self_attn.o_proj.weight"].shape == (64, 4 * 32)
    assert t["model.layers.0.self_attn.k_norm.weight"].shape == (32,)
    cfg = speed._hf_config(spec)
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["head_dim"] == 32
    from pipeline.models.llama import DecoderConfig  # the pipeline reads it as the Qwen3 family
    assert DecoderConfig.from_hf(cfg).qk_norm
    with pytest.raises(ValueError, match="random.architecture"):
        speed._hf_config(dict(spec, architecture="gpt2"))


def test_parse_llama_bench_json():
    text = json.dumps([
        {"n_prompt": 128, "n_gen": 0, "avg_ts": 2.0, "samples_ts": [1.0, 2.0, 3.0], "build_commit": "abc"},
        {"n_prompt": 0, "n_gen": 128, "avg_ts": 5.0, "samples_ts": [5.0, 4.0], "build_commit": "abc"}])
    parsed = speed.parse_llama_bench(text)
    assert parsed["tests"]["pp128"] == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert parsed["tests"]["tg128"]["median"] == 4.5
    assert parsed["build_commit"] == "abc"


def test_run_measured_reports_the_childs_peak_rss_in_bytes():
    """The child's own peak, not this process's: with 600 MiB resident here first, a child that holds 100
    MiB for half a second measures 100-400 MiB (ru_maxrss of a forked child would say >= 600)."""
    held = bytearray(600 * 2**20)
    held[::4096] = b"x" * len(held[::4096])
    code = "import time; b = bytearray(100 * 2**20); b[::4096] = b'x' * len(b[::4096]); time.sleep(0.5)"
    run = speed.run_measured([sys.executable, "-c", code])
    assert run["rc"] == 0
    assert 100 * 2**20 <= run["max_rss_bytes"] < 400 * 2**20
    del held


def _made_up_result() -> dict:
    return {"date": "2026-01-01", "quick": True, "threads": 2, "decode_tokens": 64, "llamacpp_reps": 2,
           "machine": {"cpu": "cpu", "cores": 2, "ram_gb": 8.0, "packages": {"apache-tvm": "0"}},
           "git_commit": "abc", "llamacpp": {"version": "0.3.36", "build_commit": None},
           "bandwidth": {"gbs": 10.0, "spread_gbs": speed.spread([9.0, 10.0]), "threads": 2, "method": "C"},
           "load_average": {"before": 1.0, "after": 1.0},
           "models": [{"name": "m", "params": 1e6, "prefill": [128], "reps": 2}],
           "rows": [{"model": "m", "side": "ours", "scheme": "q4f16", "decode_tok_s": speed.spread([1.0, 2.0]),
                     "prefill_tok_s": {"128": speed.spread([3.0])}, "ttft_s": speed.spread([0.5, 0.7]),
                     "bytes_per_token": 1e8, "kv_bytes_per_token": 4.5e6, "roofline": 0.015, "roofline_near": 0.03,
                     "decode_rss_bytes": 2**30, "peak_rss_bytes": 2**30,
                     "load_average_1m": 1.5}],
           "compile": [{"target": "host-cpu", "args": [], "model": "m", "quant": "q4f16", "cold_s": 10.0,
                        "steps": {"fuse": 1.0}, "rebuild_s": 1.0}],
           "phones": {"p": {"bandwidth_gbs": 50.0}}, "phone_bandwidth_share": 0.6,
           "phone_predictions": [{"model": "m", "scheme": "q4f16", "bytes_per_token": 1e8,
                                  "predicted_tok_s": {"p": 300.0}}],
           "goals": []}


def test_markdown_renders_a_made_up_result():
    md = speed.markdown(_made_up_result())
    assert "| q4f16 | ours | 3.00 | 1.50 (1.00–2.00) | 600 (500–700) | 100.0 | 4.5 | 1.5 | 3.0 | 1024 | 1024 | 1.50 |" in md
    assert "PREDICTION" in md and "| m | q4f16 | 100.0 | 300.0 |" in md


def test_each_of_ours_is_measured_next_to_its_counterpart():
    cfg = speed.load_config()
    order = speed.measurement_order(cfg["ours"], cfg["llamacpp"], cfg["counterparts"])
    assert sorted(order) == sorted([("ours", s) for s in cfg["ours"]] + [("llama.cpp", t) for t in cfg["llamacpp"]])
    for ours, theirs in cfg["counterparts"].items():
        assert order.index(("llama.cpp", theirs)) == order.index(("ours", ours)) + 1
    assert speed.measurement_order(["a", "b"], ["X", "Y"], {"b": "X"}) == [
        ("ours", "a"), ("ours", "b"), ("llama.cpp", "X"), ("llama.cpp", "Y")]


def test_cpu_isa_reads_the_flags_that_pick_kernels():
    text = "processor : 0\nflags\t\t: fpu sse2 avx2 fma avx512f avx512vl avx512_vnni bmi2\n"
    assert speed.cpu_isa(text) == ["avx2", "fma", "avx512f", "avx512vl", "avx512_vnni"]
    assert speed.cpu_isa("processor : 0\n") == []


AMX_CPUINFO = "processor : 0\nflags\t\t: fpu avx2 avx512f avx512_vnni amx_tile amx_int8 amx_bf16\n"


def test_a_cpu_with_amx_gets_a_native_and_a_no_amx_build(tmp_path):
    """The native build always; on a CPU with AMX also one without it (the native one's AMX matmul segfaults in
    prompt processing there), in its own folder and marker: a cached build of one kind is not taken for the
    other. The tools that need one build that runs everything get the one without AMX there."""
    from benchmarks import llamacpp

    plain = AMX_CPUINFO.replace("amx_tile amx_int8 amx_bf16", "")
    assert llamacpp.cpu_has_amx(AMX_CPUINFO) and not llamacpp.cpu_has_amx(plain)
    assert llamacpp.variants(llamacpp.cpu_has_amx(AMX_CPUINFO)) == [llamacpp.NATIVE, llamacpp.NOAMX]
    assert llamacpp.variants(llamacpp.cpu_has_amx(plain)) == [llamacpp.NATIVE]
    assert llamacpp.safe_variant(amx=True) == llamacpp.NOAMX and llamacpp.safe_variant(amx=False) == llamacpp.NATIVE
    assert llamacpp.NATIVE.flags == () and all("-mno-amx-int8" in f for f in llamacpp.NOAMX.flags)
    assert {f.split("=")[0] for f in llamacpp.NOAMX.flags} == {"-DCMAKE_C_FLAGS", "-DCMAKE_CXX_FLAGS"}
    home = tmp_path / llamacpp.VERSION
    for folder in ("build", "build-noamx"):
        (home / folder / "bin").mkdir(parents=True)
        for t in llamacpp.TOOLS:
            (home / folder / "bin" / t).write_text("")
    (home / "BUILT").write_text("")       # only the native build finished
    native = llamacpp.find_built(cache=tmp_path, variant=llamacpp.NATIVE)
    assert native.bin == home / "build" / "bin" and native.build == "native"
    assert llamacpp.find_built(cache=tmp_path, variant=llamacpp.NOAMX) is None


def _bench_json(tests: dict[str, list[float]]) -> str:
    """llama-bench -o json for made-up tests: {'pp128': samples, 'tg32': samples}."""
    return json.dumps([{"n_prompt": int(k[2:]) if k.startswith("pp") else 0,
                        "n_gen": int(k[2:]) if k.startswith("tg") else 0, "avg_ts": 0.0, "samples_ts": v,
                        "build_commit": "abc", "build_number": 1, "model_type": "llama"} for k, v in tests.items()])


def test_a_build_that_crashes_in_prompt_processing_keeps_its_decode_figures(monkeypatch, tmp_path):
    """measure_gguf runs prefill, decode (after the prompt's tokens) and empty-context decode in their own
    processes: a segfault in one is recorded under `crashed` with its signal, the others' figures stay."""
    from benchmarks import llamacpp

    lc = llamacpp.LlamaCpp("0.3.36", tmp_path, tmp_path / "bin", "native")

    def fake_run(cmd, env=None, cwd=None):
        if cmd[cmd.index("-n") + 1] == "0":
            return {"rc": -11, "stdout": "", "stderr": "ggml_backend_amx_mul_mat\nSegmentation fault\n",
                    "seconds": 1.0, "max_rss_bytes": 1}
        deep = "-d" in cmd
        return {"rc": 0, "stdout": _bench_json({"tg32": [200.0, 220.0] if deep else [230.0]}), "stderr": "",
                "seconds": 1.0, "max_rss_bytes": 7 if deep else 5}

    monkeypatch.setattr(speed, "run_measured", fake_run)
    m = speed.measure_gguf(lc, tmp_path / "q.gguf", [128, 512], 32, 2, 2)
    assert m["build"] == "native" and list(m["crashed"]) == ["prefill"]
    assert m["crashed"]["prefill"].startswith("SIGSEGV: Segmentation fault")
    assert "prefill_tok_s" not in m and m["decode_tok_s"]["median"] == 210.0
    assert m["decode_tok_s_empty_context"]["median"] == 230.0 and m["decode_rss_bytes"] == 5


def _measured(build: str, pp: float | None, decode: float | None, crashed=()) -> dict:
    m = {"build": build, "crashed": {run: "SIGSEGV: Segmentation fault" for run in crashed}, "build_commit": "abc"}
    if pp is not None:
        m.update(prefill_tok_s={"128": speed.spread([pp])}, peak_rss_bytes=int(pp))
    if decode is not None:
        m.update(decode_tok_s=speed.spread([decode]), decode_tok_s_empty_context=speed.spread([decode + 10]),
                 decode_rss_bytes=int(decode))
    return m


def test_each_figure_comes_from_the_fastest_build_that_ran_it():
    """The Intel case: the native build decodes ~2x faster but crashes in prompt processing; prefill comes from
    the build without AMX, decode from the native one, and the row says which build gave what."""
    row = speed.fastest_builds([_measured("native", None, 230.0, crashed=["prefill"]),
                                _measured("no-amx", 900.0, 105.0)], [128])
    assert row["build_used"] == {"prefill-128": "no-amx", "decode": "native", "decode_empty_context": "native"}
    assert row["prefill_tok_s"]["128"]["median"] == 900.0 and row["decode_tok_s"]["median"] == 230.0
    assert row["decode_tok_s_empty_context"]["median"] == 240.0
    assert row["peak_rss_bytes"] == 900 and row["decode_rss_bytes"] == 230   # with the runs that gave them
    assert row["ttft_s"]["median"] == 128 / 900.0 and row["build_commit"] == "abc"
    assert set(row["builds"]) == {"native", "no-amx"} and row["builds"]["native"]["crashed"]
    note = speed.builds_note(row)
    assert "prefill-128: no-amx (vs native crashed (SIGSEGV))" in note and "decode: native (vs no-amx 105.00)" in note
    # both ran: the faster one, whichever it is; one build alone: no note (the Versions line names it)
    both = speed.fastest_builds([_measured("native", 1000.0, 230.0), _measured("no-amx", 900.0, 105.0)], [128])
    assert set(both["build_used"].values()) == {"native"}
    one = speed.fastest_builds([_measured("native", 1000.0, 230.0)], [128])
    assert one["build_used"]["decode"] == "native" and speed.builds_note(one) == ""


def test_a_row_that_crashed_with_every_build_says_so(monkeypatch, tmp_path):
    """_measure_theirs measures with every build, keeps the fastest figures and their builds in the row; a row
    that no build ran is a failed row, not the end of the benchmark."""
    monkeypatch.setattr(speed, "gguf_decode_bytes", lambda p: {"bytes_per_token": 1, "kv_bytes_per_position": None})
    monkeypatch.setattr(speed, "_gguf_types", lambda p: "types: Q4_0×1")
    lcs = [type("LC", (), {"build": b})() for b in ("native", "no-amx")]
    model, cfg = {"prefill": [128]}, {"decode_tokens": 32, "threads": 2, "llamacpp_reps": 1}
    fake = {"native": _measured("native", None, 230.0, crashed=["prefill"]), "no-amx": _measured("no-amx", 900.0, 105.0)}
    monkeypatch.setattr(speed, "measure_gguf", lambda lc, *a: fake[lc.build])
    row = {"scheme": "Q4_0"}
    speed._measure_theirs(row, tmp_path / "q.gguf", lcs, model, cfg, log=lambda s: None)
    assert row["build_used"]["decode"] == "native" and row["note"].startswith("types: Q4_0×1; builds — ")
    fake = {b: _measured(b, None, None, crashed=["prefill", "decode", "decode_empty_context"]) for b in fake}
    row = {"scheme": "Q4_0"}
    speed._measure_theirs(row, tmp_path / "q.gguf", lcs, model, cfg, log=lambda s: None)
    assert row["note"].startswith("failed: llama-bench crashed with every build: native: prefill SIGSEGV")


def test_the_versions_line_names_the_builds_and_what_each_gave():
    lcs = [type("LC", (), {"build": "native", "note": "GGML_NATIVE"})(),
           type("LC", (), {"build": "no-amx", "note": "without AMX"})()]
    rows = [{"build_used": {"prefill-128": "no-amx", "decode": "native", "decode_empty_context": "native"}}, {}]
    builds = speed.builds_used(lcs, rows)
    assert builds == [{"name": "native", "note": "GGML_NATIVE", "figures": 2},
                      {"name": "no-amx", "note": "without AMX", "figures": 1}]
    md = speed.markdown({**_made_up_result(), "llamacpp": {"version": "0.3.36", "build_commit": "abc",
                                                           "builds": builds}})
    assert ("builds: native (GGML_NATIVE) gave 2 figures, no-amx (without AMX) gave 1 figure; each figure is from "
            "the fastest build that ran it") in md
    old = speed.markdown({**_made_up_result(), "llamacpp": {"version": "0.3.36", "build_commit": None,
                                                            "note": "built without AMX"}})
    assert "(llama-bench build commit: None; built without AMX)" in old     # results of before: as they were


def test_a_model_that_fits_in_the_last_level_cache_is_flagged(tmp_path):
    """The last-level cache's size from sysfs (the highest level), and a markdown warning for a model whose
    decode bytes per token fit in it (its roofline against the DRAM probe may pass 100%), none otherwise."""
    for index, (level, size) in enumerate([(1, "48K"), (2, "2048K"), (3, "491520K")]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "level").write_text(f"{level}\n")
        (tmp_path / f"index{index}" / "size").write_text(f"{size}\n")
    assert speed.last_level_cache_bytes(tmp_path) == 491520 * 1024
    assert speed.last_level_cache_bytes(tmp_path / "none") is None
    res = _made_up_result()          # q4f16 reads 100 + 4.5 MB per token
    res["machine"]["llc_bytes"] = 480 * 2**20
    assert "Cache: q4f16 (104 MB) read fewer bytes per token than this CPU's last-level cache (480 MiB" in speed.markdown(res)
    res["machine"]["llc_bytes"] = 32 * 2**20
    assert "Cache:" not in speed.markdown(res)


def test_a_second_run_of_a_day_does_not_overwrite_the_first(tmp_path):
    assert speed.result_stem(tmp_path, "2026-12-02", False, "abc1234") == "speed-2026-12-02"
    (tmp_path / "speed-2026-12-02.json").write_text("{}")
    assert speed.result_stem(tmp_path, "2026-12-02", False, "abc1234") == "speed-2026-12-02-abc1234"
    (tmp_path / "speed-2026-12-02-abc1234.json").write_text("{}")
    assert speed.result_stem(tmp_path, "2026-12-02", False, "abc1234") == "speed-2026-12-02-abc1234-2"
    assert speed.result_stem(tmp_path, "2026-12-02", True, "abc1234") == "speed-2026-12-02-quick"


def test_the_roofline_takes_the_best_bandwidth_probe_of_the_run():
    """Probes at the start and after each model: the roofline divides by the best (a lower bound on the share
    the machine allowed), and the result says how far the probes spread."""
    def probe(gbs):
        return {"gbs": gbs, "spread_gbs": speed.spread([gbs]), "threads": 2, "method": "C"}

    bw = speed.combine_bandwidth([("start", probe(25.0)), ("after a", probe(44.0)), ("after b", probe(40.0))])
    assert bw["gbs"] == 44.0 and bw["drift"] == 25.0 / 44.0
    assert [p["when"] for p in bw["probes"]] == ["start", "after a", "after b"]
    rows = [{"decode_tok_s": speed.spread([100.0]), "bytes_per_token": 2.2e8, "bandwidth_near_gbs": 25.0},
            {"decode_tok_s": speed.spread([100.0]), "bytes_per_token": 2.2e8, "kv_bytes_per_token": 0.2e8}]
    speed.add_rooflines(rows, bw["gbs"])
    assert rows[0]["roofline"] == 100.0 * 2.2e8 / 44e9 and rows[0]["roofline_near"] == 100.0 * 2.2e8 / 25e9
    assert rows[1]["roofline_near"] is None     # no probe beside it: only the run's figure
    # the KV cache's reads count with the weights'; roofline_weights is the weights alone
    assert rows[1]["roofline"] == pytest.approx(100.0 * 2.4e8 / 44e9)
    assert rows[1]["roofline_weights"] == pytest.approx(100.0 * 2.2e8 / 44e9)
    failed = {"gbs": None, "error": "no cc", "threads": 2}
    assert speed.combine_bandwidth([("start", failed)]) == failed
    res = {"date": "2026-01-01", "quick": True, "threads": 2, "decode_tokens": 64, "llamacpp_reps": 2,
           "machine": {"cpu": "cpu", "cores": 2, "ram_gb": 8.0, "packages": {"apache-tvm": "0"}},
           "git_commit": "abc", "llamacpp": {"version": "0.3.36", "build_commit": None}, "bandwidth": bw,
           "load_average": {"before": 1.0, "after": 1.0}, "models": [], "rows": [], "compile": [],
           "phones": {}, "phone_bandwidth_share": 0.6, "phone_predictions": [], "goals": []}
    md = speed.markdown(res)
    assert "25.0 (start), 44.0 (after a), 40.0 (after b)" in md and "worst probe 57% of the best" in md


def test_read_floor_kernel_reads_every_word_of_each_half():
    """benchmarks/read_floor.py's read-only kernel: thread t XORs exactly the words of its half (in VEC-wide
    vectors; a tail shorter than threads * VEC is left out), so none of the reads can be optimised away."""
    import tvm

    from benchmarks import read_floor

    read = tvm.compile(tvm.IRModule({"main": read_floor.read_kernel(2).with_attr("global_symbol", "main")}),
                       target=tvm.target.Target({"kind": "llvm"}))["main"]
    nothing = tvm.runtime.tensor(np.zeros(0, np.uint32))
    rng = np.random.default_rng(0)
    vec = read_floor.VEC

    def halves(a):
        per = len(a) // (2 * vec)
        return [np.bitwise_xor.reduce(a[t * per * vec:(t + 1) * per * vec].reshape(per, vec), axis=0) for t in (0, 1)]

    for n, m in ((32, 64), (4096 + 7, 96 + 5)):
        a, b = (rng.integers(0, 2**32, size, dtype=np.uint64).astype(np.uint32) for size in (n, m))
        out = tvm.runtime.tensor(np.zeros((2, vec), np.uint32))
        read(tvm.runtime.tensor(a), nothing, out)
        np.testing.assert_array_equal(out.numpy(), np.stack(halves(a)))
        read(tvm.runtime.tensor(a), tvm.runtime.tensor(b), out)
        np.testing.assert_array_equal(out.numpy(), np.stack(halves(a)) ^ np.stack(halves(b)))


def test_read_floor_counts_what_a_decode_reads():
    """A tied embedding is the lm_head (read whole); an untied one is only gathered (left out)."""
    from benchmarks.read_floor import decode_weights

    tied = ["model.embed_tokens.q_weight", "model.embed_tokens.q_scale", "model.layers.0.mlp.down_proj.q_weight"]
    assert decode_weights(tied) == tied
    untied = [*tied, "lm_head.q_weight", "lm_head.q_scale"]
    assert decode_weights(untied) == untied[2:]


def test_each_measured_row_gets_the_better_of_its_neighbouring_probes(monkeypatch, tmp_path):
    """bench_model probes before the first measurement and after each; a row's near bandwidth is the better
    of the probes on either side of it (the same minutes), a row not measured gets none."""
    cfg = {"ours": ["q4f16", "q8f16"], "llamacpp": ["Q4_0"], "counterparts": {"q4f16": "Q4_0"}}
    model = {"name": "m", "prefill": [128]}
    monkeypatch.setattr(speed, "model_source", lambda m: ("src", tmp_path))
    monkeypatch.setattr(speed, "pipeline_build", lambda *a, **k: {"bundle": speed.ROOT / "b", "seconds": 1.0})
    monkeypatch.setattr(speed, "bundle_decode_bytes", lambda b: 1e8)
    monkeypatch.setattr(speed, "llamacpp_ggufs", lambda lc, w, types, out: {"Q4_0": tmp_path / "q.gguf"})
    measured = []
    monkeypatch.setattr(speed, "_measure_ours", lambda row, *a, **k: measured.append(row["scheme"]))
    monkeypatch.setattr(speed, "_measure_theirs", lambda row, *a, **k: measured.append(row["scheme"]))
    probes = iter([30.0, 50.0, None, 20.0])
    rows = speed.bench_model(model, cfg, lcs=[object()], log=lambda s: None, near_probe=lambda: next(probes))
    assert measured == ["q4f16", "Q4_0", "q8f16"]
    near = {r["scheme"]: r.get("bandwidth_near_gbs") for r in rows}
    assert near == {"q4f16": 50.0, "Q4_0": 50.0, "q8f16": 20.0}
