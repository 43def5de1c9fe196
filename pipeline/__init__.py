"""mobile-llm-pipeline: Hugging Face / GGUF LLMs -> app-ready phone bundles, compiled with TVM."""

import os as _os

__version__ = "0.1.0"

# TVM's runtime thread pool defaults to half the CPUs on x86 (it assumes every core has an SMT sibling):
# on a 2-vCPU machine every kernel of a host-cpu library ran on one thread (decode 1.7x slower), while the
# library was built for all of them (kernels/cpu/probe.build_threads). The pool reads this once, at its first
# parallel launch, so it is set here, before anything of TVM runs; an explicit TVM_NUM_THREADS wins.
if not _os.environ.get("TVM_NUM_THREADS"):
    _cpus = len(_os.sched_getaffinity(0)) if hasattr(_os, "sched_getaffinity") else (_os.cpu_count() or 1)
    _os.environ["TVM_NUM_THREADS"] = str(_cpus)
