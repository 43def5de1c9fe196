"""benchmarks/phone_cpu.py's arithmetic on made-up counts: goals, PREDICTION, KV bytes, the llama.cpp differences."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks import phone_cpu as pc
from benchmarks import qemu_counter as qc


def _counts(insns, vec=0, load_bytes=0):
    c = dict.fromkeys(qc.COUNT_KEYS, 0)
    c.update(insns=insns, vector_insns=vec, load_bytes=load_bytes)
    return c


def _rows(ours_decode_insns, four_thread_insns):
    gemv = _counts(100, 85)     # the library's kernels
    ours = {"weights_bytes": 1000, "gemv": {"total": _counts(100, 85)},
            "threads": {"1": {"decode": {"total": _counts(ours_decode_insns, 10, 1100), "range": gemv},
                              "prefill": {"total": _counts(50), "range": gemv}},
                        "4": {"decode": {"total": _counts(four_thread_insns, 10, 1100), "range": gemv},
                              "prefill": {"total": _counts(50), "range": gemv}}}}
    theirs = {"1": {"decode": {"total": _counts(100)}, "prefill": {"total": _counts(40)}}}
    return {"ours": {"q4f16": ours}, "llamacpp": {"Q4_0": theirs}, "kv_bytes": 100}


def _verdicts(rows):
    return {g["goal"].split(" (whole program")[0]: g["pass"] for g in pc.goals(rows, [1, 4])}


def test_goals_pass_and_fail_from_the_rows():
    verdicts = _verdicts(_rows(90, 100))
    assert verdicts == {
        "decode instr/token q4f16 <= 1.0x llama.cpp Q4_0 (1 thread)": True,      # 90 vs 100
        "prefill-128 instr/token q4f16 <= 1.0x llama.cpp Q4_0": False,           # 50 vs 40
        "bytes loaded per decoded token q4f16 <= 1.1x weights + KV": True,        # 1100 <= 1.1 x 1100
        ">= 80% vector instructions inside the GEMV kernels q4f16": True,         # 85 %
        "4-thread decode instructions q4f16 <= 1.15x 1-thread": True,             # 100 / 90
    }
    worse = _verdicts(_rows(101, 120))
    assert not worse["decode instr/token q4f16 <= 1.0x llama.cpp Q4_0 (1 thread)"]
    assert not worse["4-thread decode instructions q4f16 <= 1.15x 1-thread"]   # 120 / 101 = 1.19


def test_prediction_is_the_slower_of_compute_and_memory():
    memory_bound = pc.predict(1e6, 76.8e9 / 100, 1)          # 10 ms of DRAM, ~0.1 ms of compute
    assert memory_bound["bound"] == "memory" and memory_bound["tok_s"] == pytest.approx(100)
    compute_bound = pc.predict(3.0 * 3.25e9 / 10, 0, 1)      # IPC 3 at 3.25 GHz: 0.1 s
    assert compute_bound["bound"] == "compute" and compute_bound["tok_s"] == pytest.approx(10)
    assert pc.predict(1e9, 0, 4)["tok_s"] > 3 * pc.predict(1e9, 0, 1)["tok_s"]


def test_kv_bytes_counts_the_new_token():
    decoder = SimpleNamespace(num_hidden_layers=30, num_key_value_heads=3, head_dim=64)
    assert pc.kv_bytes(decoder, 128) == 30 * 2 * 3 * 64 * 2 * 129


def test_run_difference_per_token():
    long = qc.Counts(_counts(1000, 100), _counts(10))
    short = qc.Counts(_counts(200, 20), _counts(2))
    per = long.minus(short).scaled(1 / 8)
    assert per["total"]["insns"] == 100 and per["total"]["vector_insns"] == 10 and per["range"]["insns"] == 1


def test_whole_program_prefill_is_the_prompt_difference_less_its_decode_steps():
    """A = load + P128 + 2 D, B = load + P128 + 10 D, C = load + P1: D = (B - A) / 8, prefill = (P128 - P1) / 127."""
    from benchmarks import phone_cpu_whole as whole

    load, p128, p1, d = 5000, 128 * 30 + 7, 30 + 7, 11
    a, b, c = (qc.Counts(_counts(x), _counts(x // 2)) for x in (load + p128 + 2 * d, load + p128 + 10 * d, load + p1))
    decode, prefill = whole.per_token(a, b, c)
    assert decode["total"]["insns"] == pytest.approx(d)
    assert prefill["total"]["insns"] == pytest.approx(30)
    assert decode["range"]["insns"] == pytest.approx(d // 2, abs=1)


def test_our_side_is_built_for_the_benchmarked_class():
    """--cls i8mm builds ours with --phone of an i8mm phone (the smmla prefill); dotprod is the target's own."""
    from benchmarks import phone_cpu_ours as ours
    from pipeline.config import load_phone

    assert ours.class_phone("dotprod") is None and ours.class_phone(None) is None
    assert load_phone(ours.class_phone("i8mm"))["cpu_class"] == "i8mm"
    with pytest.raises(qc.CounterError):
        ours.class_phone("sve2")


def test_prefill_accuracy_comparison():
    """benchmarks/i8mm_prefill_accuracy.compare on made-up logits: identical rows agree with KL 0; a row whose
    top-1 flips is counted, and its KL is positive."""
    import numpy as np

    from benchmarks.i8mm_prefill_accuracy import compare

    a = np.array([[0.0, 1.0, 3.0], [2.0, 0.0, 1.0]])
    same = compare(a, a)
    assert (same["positions"], same["top1_same"], same["max_abs_dlogit"]) == (2, 2, 0.0) and abs(same["max_kl"]) < 1e-12
    b = a.copy()
    b[1, 1] = 2.5
    moved = compare(a, b)
    assert moved["top1_same"] == 1 and moved["max_abs_dlogit"] == 2.5 and moved["max_kl"] > 0.1
