"""`python -m pipeline check`: a bundle against an app runtime's contract, read without running it. Each way a
bundle can differ is one line naming it; the real bundles of every target pass."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from pipeline.verify.contract import check_bundle


@pytest.fixture(scope="module")
def host_bundle(build_bundle):
    return build_bundle("smollm2-135m", "host-cpu", "q4f16")


@pytest.fixture()
def copy(host_bundle, tmp_path):
    """A private copy of the host-cpu bundle to damage."""
    dest = tmp_path / host_bundle.name
    shutil.copytree(host_bundle, dest)
    return dest


def _edit(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _violations(bundle, runtime=None):
    return check_bundle(bundle, runtime).violations


def test_real_bundle_passes_and_the_cli_says_ok(host_bundle):
    assert _violations(host_bundle) == []
    out = subprocess.run([sys.executable, "-m", "pipeline", "check", str(host_bundle)], capture_output=True,
                         text=True)
    assert out.returncode == 0 and "ok for runtime mlc-llm-79d603f" in out.stdout, out.stdout + out.stderr


def test_other_runtime_names_the_kv_cache_arity(host_bundle):
    lines = _violations(host_bundle, "tvm-0.27")
    assert any("passes 5 config fields" in line and "tvm-0.27 takes 6" in line for line in lines), lines
    assert any("built for runtime mlc-llm-79d603f" in line for line in lines), lines
    out = subprocess.run([sys.executable, "-m", "pipeline", "check", str(host_bundle), "--runtime", "tvm-0.27"],
                         capture_output=True, text=True)
    assert out.returncode == 1 and len(out.stdout.strip().splitlines()) == len(lines)


def test_missing_function(copy):
    _edit(copy / "reports" / "kernels.json", lambda d: d["engine_abi"]["functions"].pop("batch_decode"))
    assert _violations(copy) == ["function batch_decode: missing (runtime mlc-llm-79d603f calls it)"]


def test_wrong_signature(copy):
    def change(d):
        args = d["engine_abi"]["functions"]["batch_prefill"]["args"]
        args[1]["dims"] = ["seq_len"]          # logit positions sized like the tokens
        args[0], args[2] = args[2], args[0]    # and the KV cache first
    _edit(copy / "reports" / "kernels.json", change)
    lines = _violations(copy)
    assert len(lines) == 2 and all(line.startswith("function batch_prefill: arg ") for line in lines), lines


def test_recorded_function_absent_from_the_library(copy):
    _edit(copy / "reports" / "kernels.json",
          lambda d: d["engine_abi"]["functions"].__setitem__("batch_extend", {"args": [], "returns": []}))
    assert any("not in the library: batch_extend" in line for line in _violations(copy))


def test_chat_config_with_a_template_name(copy):
    _edit(copy / "mlc-chat-config.json", lambda d: d.__setitem__("conv_template", "chatml"))
    assert any("conv_template is 'chatml'" in line for line in _violations(copy))


def test_metadata_and_tensor_cache(copy):
    def meta(d):
        d["metadata"].pop("memory_usage")
        d["metadata"]["params"][0].pop("preprocs")
    _edit(copy / "reports" / "kernels.json", meta)

    def records(d):
        d["records"][0]["records"][0]["shape"] = [1]
    _edit(copy / "tensor-cache.json", records)
    lines = _violations(copy)
    assert any("no 'memory_usage'" in line for line in lines)
    assert any("has no preprocs" in line for line in lines)
    assert any(line.startswith("tensor-cache.json: model.embed_tokens") for line in lines)
    # the library's own _metadata() (loaded: a host-cpu .so) no longer matches the record
    assert any("its _metadata() differs" in line for line in lines)


def test_metal_and_vulkan_bundles_need_the_gpu_sampler(copy):
    """Where MLC's engine samples on the device (Metal, Vulkan, CUDA) it calls four more functions; a library
    for such a target without them is reported (the host-cpu record relabelled as a Metal one)."""
    _edit(copy / "reports" / "kernels.json", lambda d: d["engine_abi"].__setitem__("target_kind", "metal"))
    missing = sorted(line.split()[1].rstrip(":") for line in _violations(copy) if line.endswith("calls it)"))
    assert missing == ["argsort_probs", "multinomial_from_uniform", "sample_with_top_p", "sampler_take_probs"]
