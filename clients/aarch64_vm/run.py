"""Run an android-cpu bundle's whole decode under qemu-aarch64: the app-side path, executed here.

    .venv/bin/python -m clients.aarch64_vm.run dist/<name>-android-cpu --prompt "The capital of France is" \\
        --steps 16 --threads 1

Builds (or reuses) the cross-built runtime and the bundle's driver (clients/aarch64_vm/build.py), feeds the
prompt's token ids (tokenized here with the bundle's tokenizer.json), and reads back the greedy ids and the
float32 logits of the prompt's last position and of every decode step. `counter` runs the driver under the
project's counting TCG plugin (benchmarks/qemu_counter.py) and returns its counts too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

if str(Path(__file__).resolve().parents[2]) not in sys.path:   # run as a script: the checkout's clients/
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from clients.aarch64_vm import build  # noqa: E402
from clients.native_build import Missing  # noqa: E402

QEMU = "qemu-aarch64"


@dataclass
class Decoded:
    ids: list[int]          # the greedy ids after the prompt
    logits: np.ndarray      # [steps + 1, vocab] float32: the prompt's last position, then each decode step
    seconds: float          # wall time of the qemu run (emulated: says nothing about a phone)


def system_lib_prefix(bundle: Path) -> str:
    config = json.loads((bundle / "mlc-chat-config.json").read_text())
    prefix = config.get("system_lib_prefix")
    if not prefix:
        raise Missing(f"{bundle / 'mlc-chat-config.json'} has no system_lib_prefix: not an android-cpu bundle; "
                      f"build one with `make build TARGET=android-cpu`")
    return prefix


def tokenize(bundle: Path, prompt: str) -> list[int]:
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(bundle / "tokenizer.json")).encode(prompt).ids


def decode(bundle: Path, ids: list[int], steps: int, threads: int = 1, forced: list[int] | None = None,
           qemu_args: list[str] | None = None, timeout: float = 1800) -> Decoded:
    """Prefill `ids` and decode `steps` greedy tokens with the bundle's library under qemu-aarch64; `forced`:
    feed these ids at the steps instead (teacher forcing; `ids` of the result are still each step's argmax)."""
    if shutil.which(QEMU) is None:
        raise Missing(f"{QEMU} not found; run `make system-deps` (Debian: apt-get install qemu-user)")
    exe = build.driver(bundle)
    prefix = system_lib_prefix(bundle)
    with tempfile.TemporaryDirectory(prefix="aarch64-vm-") as tmp:
        t = Path(tmp)
        (t / "ids.txt").write_text(" ".join(str(i) for i in ids) + "\n")
        env = {**os.environ, "TVM_NUM_THREADS": str(threads)}
        cmd = [QEMU, *(qemu_args or []), str(exe), prefix, str(bundle), str(t / "ids.txt"), str(steps),
               str(t / "logits.bin"), str(t / "ids_out.txt")]
        if forced is not None:
            (t / "forced.txt").write_text(" ".join(str(i) for i in forced) + "\n")
            cmd.append(str(t / "forced.txt"))
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        seconds = time.perf_counter() - t0
        if r.returncode != 0:
            tail = "\n".join(r.stderr.strip().splitlines()[-20:])
            raise RuntimeError(f"decode_driver under {QEMU} exited {r.returncode}:\n{tail}")
        out_ids = [int(x) for x in (t / "ids_out.txt").read_text().split()]
        logits = np.fromfile(t / "logits.bin", dtype=np.float32).reshape(steps + 1, -1)
    return Decoded(out_ids, logits, seconds)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    try:
        ids = tokenize(args.bundle, args.prompt)
        out = decode(args.bundle, ids, args.steps, args.threads)
    except Missing as e:
        print(f"aarch64-vm: {e}", file=sys.stderr)
        return 1
    from tokenizers import Tokenizer
    text = Tokenizer.from_file(str(args.bundle / "tokenizer.json")).decode(out.ids)
    print(f"{args.prompt}{text}")
    print(f"ids: {out.ids}  ({out.seconds:.1f} s under {QEMU}, {args.threads} thread(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
