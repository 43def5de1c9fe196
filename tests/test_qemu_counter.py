"""The qemu counting plugin (benchmarks/native/insn_counter.c) on a tiny static aarch64 program with known counts.

The program's `count_loop` is hand-written assembly: for n iterations one 16-byte vector load, one 4-byte scalar
load, one vector add, one `sdot` by element and the loop's own two instructions, then one 16-byte vector store.
So inside its symbol range it executes exactly 3 + 6n instructions (2 + 3n vector: movi, str q and per iteration
ldr q, add v, sdot — which qemu 7.2's disassembler prints as `.byte`, so the plugin reads its encoding), 20n
bytes loaded and 16 stored — per thread, whether run on one or four guest threads.
"""

from __future__ import annotations

import subprocess

import pytest

from benchmarks import qemu_counter as qc

pytestmark = pytest.mark.skipif(bool(qc.missing_tools()), reason=f"needs {qc.missing_tools()} (make system-deps)")

PROGRAM = r"""
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

void count_loop(const uint8_t* src, long n, uint8_t* dst);
__asm__(
    ".text\n.global count_loop\n.type count_loop, %function\n"
    "count_loop:\n"
    "  movi v1.4s, #0\n"
    "1:\n"
    "  ldr q0, [x0], #16\n"
    "  ldr w3, [x0, #-4]\n"
    "  add v1.4s, v1.4s, v0.4s\n"
    "  sdot v1.4s, v0.16b, v0.4b[0]\n"
    "  subs x1, x1, #1\n"
    "  b.ne 1b\n"
    "  str q1, [x2]\n"
    "  ret\n"
    ".size count_loop, .-count_loop\n");

static long n;
static void* worker(void* arg) {
  uint8_t* src = calloc((size_t)n, 16);
  count_loop(src, n, arg);
  free(src);
  return NULL;
}

int main(int argc, char** argv) {
  n = atol(argv[1]);
  int threads = atoi(argv[2]);
  pthread_t tid[8];
  static uint8_t out[8][16];
  for (int t = 0; t < threads; ++t) pthread_create(&tid[t], NULL, worker, out[t]);
  for (int t = 0; t < threads; ++t) pthread_join(tid[t], NULL);
  return 0;
}
"""


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    folder = tmp_path_factory.mktemp("counter")
    (folder / "loop.c").write_text(PROGRAM)
    exe = folder / "loop"
    subprocess.run(["aarch64-linux-gnu-gcc", "-static", "-O1", "-march=armv8.2-a+dotprod", "-pthread", str(folder / "loop.c"), "-o", str(exe)],
                   check=True)
    return exe


@pytest.mark.parametrize("n,threads", [(1000, 1), (3000, 1), (1000, 4)])
def test_exact_counts_inside_the_loop_symbol(program, n, threads):
    ranges = qc.symbol_ranges(program, {"count_loop"})
    assert set(ranges) == {"count_loop"}
    counts, _ = qc.run([program, str(n), str(threads)], list(ranges.values()))
    got = counts.range
    assert got["insns"] == threads * (3 + 6 * n)
    assert got["vector_insns"] == threads * (2 + 3 * n)
    assert got["load_bytes"] == threads * 20 * n
    assert got["store_bytes"] == threads * 16
    assert threads * 2 * n <= got["loads"] <= threads * 3 * n      # qemu 7.2 may split a 16-byte access in two
    assert counts.total["insns"] > got["insns"]                     # start-up, calloc and pthread code outside
    # qemu-user reuses a finished thread's vCPU index, so slots <= threads + 1; their sum is the total
    assert 1 <= len(counts.per_vcpu_insns) <= threads + 1 and sum(counts.per_vcpu_insns) == counts.total["insns"]


def test_bad_plugin_argument_fails_in_one_line(program):
    with pytest.raises(qc.CounterError):
        qc.run([program, "1", "1"], [(0x200, 0x100 + 0x10)])   # hi <= lo


# Hexagon: qemu translates a packet as one guest instruction. `count_loop` runs 4 packets per iteration, two of
# them HVX (a 128-byte vmem load, a vector add), n times; the vmem load is 128 bytes (qemu: 16 accesses of 8).
HEXAGON_PROGRAM = """\t.text
\t.globl _start
_start:
\t{ r0 = #%d }
\t{ r1 = add(r29, #-512) }
\t.globl count_loop
\t.type count_loop,@function
count_loop:
\t{ v0 = vmem(r1+#0) }
\t{ v1.w = vadd(v0.w, v0.w) }
\t{ r0 = add(r0, #-1) }
\t{ p0 = cmp.gt(r0, #0); if (p0.new) jump:t count_loop }
\t.size count_loop, .-count_loop
\t{ r0 = #0; r6 = #93 }
\t{ trap0(#1) }
"""


@pytest.mark.parametrize("n", [1000, 3000])
def test_exact_hexagon_packet_counts(tmp_path, n):
    from pipeline.verify import qemu_hexagon as qh

    if qh.missing_tools():
        pytest.skip(f"needs Debian packages {qh.missing_tools()} (make system-deps)")
    (tmp_path / "loop.S").write_text(HEXAGON_PROGRAM % n)
    obj, exe = tmp_path / "loop.o", tmp_path / "loop"
    subprocess.run([qh._tool("clang"), "--target=hexagon-unknown-none-elf", "-mcpu=hexagonv67", "-mhvx",
                    "-mhvx-length=128b", "-c", str(tmp_path / "loop.S"), "-o", str(obj)], check=True)
    subprocess.run([qh._tool("ld.lld"), "-static", "-e", "_start", str(obj), "-o", str(exe)], check=True)
    qh.set_qemu_cpu_flags(exe)
    ranges = qc.symbol_ranges(exe, {"count_loop"}, nm=qh._tool("llvm-nm"))
    counts, _ = qc.run([exe], list(ranges.values()), qemu="qemu-hexagon", stdin=b"")
    got = counts.range
    assert (got["insns"], got["vector_insns"], got["load_bytes"], got["stores"]) == (4 * n, 2 * n, 128 * n, 0)
    assert counts.total["insns"] == got["insns"] + 4          # _start's two packets before, two after
