# Tessera: one Makefile that reads like a table.
#
#   make            bin/tessera-coordinator bin/tessera-worker bin/tessera (a release build)
#   make test       install missing deps, build, run unit + integration tests
#                   (a test build in build/test, and the release build beside it)
#   make asan       the same tests built with AddressSanitizer + UBSan (build/asan)
#   make cpu-only   every test of a CUDA=0 build (build/nocuda)
#   make tsan       unit tests and a few integration tests under ThreadSanitizer
#   make demo       install missing deps, build, run the demo cluster
#   make bench      control-plane, data-plane and serving benchmarks (bench/)
#   make install    PREFIX=/usr/local: binaries, systemd units, example configs
#   make uninstall  removes what make install laid out (not the key store)
#   make systemd-check  as root: the units under a real systemd in a Debian container
#                   (scripts/systemd-check.sh; SYSTEMD_CHECK_FLAGS=--rebuild)
#   make fuzz       libFuzzer targets (tests/fuzz/, clang), each for FUZZ_SECONDS
#
# CFLAGS, LDFLAGS, LDLIBS and NVCCFLAGS given on the command line or in the
# environment are added to the project's own flags, not put in their place.
# WERROR=1 makes warnings errors (the test targets and CI set it); TESTING=1
# compiles in the test settings (TSR_TEST_* variables, the fixed-secret TCP
# group): only the test builds have it, so a release binary ignores them.

PREFIX   ?= /usr/local
SYSCONFDIR ?= /etc
UNITDIR  ?= $(PREFIX)/lib/systemd/system
SANITIZE ?=
TSAN     ?=
WERROR   ?= 0
TESTING  ?= 0
# The test builds have folders of their own, so that their objects (compiled with
# the test settings) never mix with the release build's: a plain `make TESTING=1`
# builds in build/test too.
TEST_BUILD ?= build/test
ifeq ($(TESTING),1)
BUILD    ?= $(TEST_BUILD)
BIN      ?= $(TEST_BUILD)/bin
endif
BUILD    ?= build
BIN      ?= bin

PKGS     := libczmq libzmq yaml-0.1 libprotobuf-c jansson libsystemd libcrypto libpcre2-8 \
            libmicrohttpd
CC       ?= cc
CFLAGS   ?= -O2 -g
WERROR_FLAG := $(if $(filter 1,$(WERROR)),-Werror)
TESTING_FLAG := $(if $(filter 1,$(TESTING)),-DTSR_TESTING)
# The project's flags first, the user's CFLAGS after them (they win where they differ).
TSR_CFLAGS := -std=gnu11 -Wall -Wextra $(WERROR_FLAG) -Wno-format-truncation -Wno-psabi -MMD -MP \
              -D_GNU_SOURCE $(TESTING_FLAG) -I. -I$(BUILD)/gen \
              $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
# --as-needed: a binary records only the libraries it calls (the worker
# needs no HTTP server; each one mapped costs resident pages).
TSR_LDFLAGS := -Wl,--as-needed
TSR_LDLIBS  := $(shell pkg-config --libs $(PKGS) 2>/dev/null) -lm -lpthread
ifneq ($(SANITIZE),)
TSR_CFLAGS  += -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
TSR_LDFLAGS += -fsanitize=address,undefined
endif
ifneq ($(TSAN),)
TSR_CFLAGS  += -fsanitize=thread
TSR_LDFLAGS += -fsanitize=thread
endif
ALL_CFLAGS  = $(TSR_CFLAGS) $(CFLAGS)
ALL_LDFLAGS = $(TSR_LDFLAGS) $(LDFLAGS)
ALL_LDLIBS  = $(LDLIBS) $(TSR_LDLIBS)

# snprintf truncation is how bounded messages are built here, not a bug.

# ---- CUDA -----------------------------------------------------------------
# The CUDA engine (worker/cuda/) is built whenever nvcc is found, on PATH or
# in /usr/local/cuda; `make CUDA=0` leaves it out, and the worker then runs
# CPU pieces only.  A machine without a GPU builds and tests it all the same
# (the kernels' math is tested on the CPU: tests/cuda/).
NVCC     ?= $(or $(shell command -v nvcc 2>/dev/null),$(wildcard /usr/local/cuda/bin/nvcc))
CUDA     ?= $(if $(NVCC),1,0)
comma := ,
ifeq ($(CUDA),1)
ifeq ($(NVCC),)
$(error CUDA=1 but nvcc is neither on PATH nor in /usr/local/cuda/bin)
endif
CUDA_HOME  := $(patsubst %/bin/nvcc,%,$(realpath $(NVCC)))
# sm_80 (A100) and sm_90 (H100, H200) as machine code, plus PTX for newer GPUs.
CUDA_ARCH  ?= -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
              -gencode arch=compute_90,code=compute_90
NVCCFLAGS  ?= -O2 -g
TSR_NVCCFLAGS := -std=c++17 $(CUDA_ARCH) -Xcompiler -Wall,-Wextra$(if $(WERROR_FLAG),$(comma)-Werror) \
              $(if $(WERROR_FLAG),-Werror all-warnings) -MMD -MP -D_GNU_SOURCE $(TESTING_FLAG) \
              -DTSR_HAVE_CUDA -I. -I$(BUILD)/gen
CUDA_CFLAGS := -DTSR_HAVE_CUDA -I$(CUDA_HOME)/include
# cuBLAS is not linked: the CUDA engine opens it when a cuda piece loads
# (linking it makes every worker start with ~150 MB resident).
CUDA_LIBS  := -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart -lstdc++
CUDA_CU    := $(wildcard worker/cuda/*.cu)
CUDA_C     := $(wildcard worker/cuda/*.c)
endif
# ---- sources -------------------------------------------------------------
PROTO        := proto/tessera.proto
PROTO_C      := $(BUILD)/gen/proto/tessera.pb-c.c
COMMON_SRC   := $(wildcard common/*.c)
COORD_SRC    := $(filter-out coordinator/main.c,$(wildcard coordinator/*.c))
WORKER_SRC   := $(filter-out worker/main.c,$(wildcard worker/*.c))
CLI_SRC      := $(filter-out cli/main.c,$(wildcard cli/*.c))
UNIT_SRC     := $(wildcard tests/unit/test_*.c)
BENCH_SRC    := $(wildcard bench/*.c)

obj = $(patsubst %.c,$(BUILD)/obj/%.o,$(1))
COMMON_OBJ   := $(call obj,$(COMMON_SRC)) $(PROTO_C:.c=.o)
COORD_OBJ    := $(call obj,$(COORD_SRC))
WORKER_OBJ   := $(call obj,$(WORKER_SRC))
ifeq ($(CUDA),1)
WORKER_OBJ   += $(call obj,$(CUDA_C)) $(patsubst %.cu,$(BUILD)/obj/%.cu.o,$(CUDA_CU))
WORKER_LIBS  := $(CUDA_LIBS)
# Host programs nvcc builds from tests/cuda/: the kernels' math on the CPU.
CUDA_TEST_BIN := $(patsubst tests/cuda/%.cu,$(BUILD)/tests/%,$(wildcard tests/cuda/test_*.cu))
# The device check's engine comparison and speed figures (scripts/gpu-check.sh).
CUDA_BENCH_BIN := $(BUILD)/bench/gpu_bench
endif
CLI_OBJ      := $(call obj,$(CLI_SRC))
UNIT_BIN     := $(patsubst tests/unit/%.c,$(BUILD)/tests/%,$(UNIT_SRC))
BENCH_BIN    := $(patsubst bench/%.c,$(BUILD)/bench/%,$(BENCH_SRC))

PROGRAMS := $(BIN)/tessera-coordinator $(BIN)/tessera-worker $(BIN)/tessera

.PHONY: all deps test unit integration asan cpu-only tsan demo bench install uninstall clean fuzz \
        fuzz-build fuzz-corpus systemd-check
all: $(PROGRAMS) build/models/demo/config.json

# The demo's model: a small random Llama checkpoint (configs/demo.yaml).
build/models/demo/config.json: | $(BIN)/tessera
	$(BIN)/tessera model-init build/models/demo --force > /dev/null

deps:
	@./scripts/install-deps.sh

# ---- generated protocol code --------------------------------------------
$(PROTO_C): $(PROTO)
	@mkdir -p $(dir $@)
	protoc-c --c_out=$(BUILD)/gen $(PROTO)
$(PROTO_C:.c=.h): $(PROTO_C)

$(BUILD)/obj/%.o: %.c $(PROTO_C)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -c $< -o $@
# Only the worker's backend table, the CUDA sources and the host-staged
# collectives' test see the CUDA headers.
$(BUILD)/obj/worker/backend.o $(BUILD)/obj/worker/main.o $(call obj,$(CUDA_C)): TSR_CFLAGS += $(CUDA_CFLAGS)
$(BUILD)/tests/test_coll_staged: TSR_CFLAGS += $(CUDA_CFLAGS)
# These tests step the wall clock their code reads (a wrapped clock_gettime).
$(BUILD)/tests/test_tokload: TSR_LDFLAGS += -Wl,--wrap=clock_gettime
$(BUILD)/obj/%.cu.o: %.cu $(PROTO_C)
	@mkdir -p $(dir $@)
	$(NVCC) $(TSR_NVCCFLAGS) $(NVCCFLAGS) -c $< -o $@
$(PROTO_C:.c=.o): $(PROTO_C)
	$(CC) $(filter-out -Werror,$(ALL_CFLAGS)) -c $< -o $@

# ---- binaries -------------------------------------------------------------
$(BIN)/tessera-coordinator: $(call obj,coordinator/main.c) $(COORD_OBJ) $(COMMON_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_LDFLAGS) $^ $(ALL_LDLIBS) -o $@
$(BIN)/tessera-worker: $(call obj,worker/main.c) $(WORKER_OBJ) $(COMMON_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_LDFLAGS) $^ $(ALL_LDLIBS) $(WORKER_LIBS) -o $@
# The tokenizer model-init writes (configs/tokenizer/, made by scripts/make-tokenizer.py),
# as C arrays: od is in coreutils, so building needs nothing more.
TOKENIZER_C := $(BUILD)/gen/shipped_tokenizer.c
$(TOKENIZER_C): configs/tokenizer/tokenizer.json configs/tokenizer/tokenizer_config.json
	@mkdir -p $(dir $@)
	@{ for f in tokenizer tokenizer_config; do \
	    echo "const unsigned char tsr_shipped_$${f}[] = {"; \
	    od -An -v -tx1 configs/tokenizer/$$f.json | sed 's/ *\([0-9a-f][0-9a-f]\)/0x\1,/g'; \
	    echo "};"; \
	    echo "const unsigned long tsr_shipped_$${f}_len = sizeof tsr_shipped_$${f};"; \
	  done; } > $@.tmp && mv $@.tmp $@
$(BUILD)/obj/shipped_tokenizer.o: $(TOKENIZER_C)
	$(CC) $(ALL_CFLAGS) -c $< -o $@
CLI_OBJ += $(BUILD)/obj/shipped_tokenizer.o

$(BIN)/tessera: $(call obj,cli/main.c) $(CLI_OBJ) $(COORD_OBJ) $(COMMON_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_LDFLAGS) $^ $(ALL_LDLIBS) -o $@

$(BUILD)/tests/%: tests/unit/%.c $(COORD_OBJ) $(WORKER_OBJ) $(CLI_OBJ) $(COMMON_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $(ALL_LDFLAGS) $^ $(ALL_LDLIBS) $(WORKER_LIBS) -lcmocka -o $@
$(BUILD)/tests/%: $(BUILD)/obj/tests/cuda/%.cu.o $(WORKER_OBJ) $(COMMON_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_LDFLAGS) $^ $(ALL_LDLIBS) $(WORKER_LIBS) -lcmocka -o $@
$(BUILD)/bench/%: bench/%.c $(COMMON_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $(ALL_LDFLAGS) $^ $(ALL_LDLIBS) -o $@
$(BUILD)/bench/gpu_bench: $(BUILD)/obj/bench/cuda/gpu_bench.cu.o $(WORKER_OBJ) $(COMMON_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_LDFLAGS) $^ $(ALL_LDLIBS) $(WORKER_LIBS) -lcublas -o $@
# A worker whose cuda row is the CPU engine over the fake NCCL
# (tests/integration/fake_nccl_worker.c): test_n5, n6 and n7 run NCCL groups
# through real daemons on machines without a GPU.
FAKE_NCCL_WORKER := $(BUILD)/tests/tessera-worker-fake-nccl
$(BUILD)/obj/worker/main_fake_nccl.o: worker/main.c $(PROTO_C)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $(CUDA_CFLAGS) -Dmain=tsr_worker_main -c $< -o $@
$(FAKE_NCCL_WORKER): tests/integration/fake_nccl_worker.c $(BUILD)/obj/worker/main_fake_nccl.o \
                     $(WORKER_OBJ) $(COMMON_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $(ALL_LDFLAGS) $^ $(ALL_LDLIBS) $(WORKER_LIBS) -o $@
# bench_pool measures the worker's thread pool and the f32 products on it, so it
# links those objects alone, against OpenBLAS (which nothing else links).
$(BUILD)/bench/bench_pool: $(call obj,worker/cpu_pool.c worker/matmul_f32.c worker/cpu_kernels.c)
$(BUILD)/bench/bench_pool: TSR_CFLAGS += $(shell pkg-config --cflags openblas 2>/dev/null)
$(BUILD)/bench/bench_pool: TSR_LDLIBS += $(shell pkg-config --libs openblas 2>/dev/null)
# matmul measures the bf16 or the int8 products alone.
$(BUILD)/bench/matmul: $(call obj,worker/cpu_pool.c worker/matmul_bf16.c worker/matmul_f32.c \
                                 worker/matmul_i8.c worker/cpu_kernels.c)
# seq_split runs the CPU engine's sequence split alone, its ranks over loopback TCP.
$(BUILD)/bench/seq_split: $(call obj,worker/engine_cpu.c worker/cpu_pool.c worker/kvpool.c \
                                    worker/batch.c worker/sample.c worker/matmul_bf16.c \
                                    worker/matmul_f32.c worker/matmul_i8.c worker/cpu_kernels.c \
                                    worker/kv_format.c worker/attention_cpu.c \
                                    worker/collective_tcp.c)
# engine_step runs the CPU engine alone.
$(BUILD)/bench/engine_step: $(call obj,worker/engine_cpu.c worker/cpu_pool.c worker/kvpool.c \
                                      worker/batch.c worker/sample.c worker/matmul_bf16.c \
                                      worker/matmul_f32.c worker/matmul_i8.c worker/cpu_kernels.c \
                                      worker/kv_format.c worker/attention_cpu.c)

# ---- tests ----------------------------------------------------------------
# `make test` builds the release programs (bin/, warnings as errors) and the test
# build (build/test: the test settings compiled in); the tests run the test
# build, and test_release_ignores_test_hooks the release one (TSR_RELEASE_BIN).
TEST_VARS := BUILD=$(TEST_BUILD) BIN=$(TEST_BUILD)/bin TESTING=1 WERROR=1
TEST_ENV  := TSR_RELEASE_BIN=$(BIN) TSR_BIN=$(TEST_BUILD)/bin TSR_BUILD=$(TEST_BUILD)
test: deps
	@./scripts/pyenv.sh > /dev/null
	@$(MAKE) --no-print-directory WERROR=1 $(PROGRAMS)
	@$(MAKE) --no-print-directory $(TEST_VARS) all-tests
	@$(TEST_ENV) ./tests/run.sh

all-tests: all $(UNIT_BIN) $(CUDA_TEST_BIN) $(BENCH_BIN) $(CUDA_BENCH_BIN) $(FAKE_NCCL_WORKER)

unit:
	@$(MAKE) --no-print-directory $(TEST_VARS) all-tests
	@$(TEST_ENV) ./tests/run.sh unit
integration:
	@$(MAKE) --no-print-directory WERROR=1 $(PROGRAMS)
	@$(MAKE) --no-print-directory $(TEST_VARS) all-tests
	@$(TEST_ENV) ./tests/run.sh integration

# Like make test, these build the release programs too: the test that they ignore the
# test settings runs beside the others (TSR_RELEASE_BIN).
asan: deps
	@./scripts/pyenv.sh > /dev/null
	@$(MAKE) --no-print-directory WERROR=1 $(PROGRAMS)
	@$(MAKE) --no-print-directory BUILD=build/asan BIN=build/asan/bin SANITIZE=1 TESTING=1 WERROR=1 \
	  all-tests
	@ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  TSR_RELEASE_BIN=$(BIN) TSR_BIN=build/asan/bin TSR_BUILD=build/asan TSR_SLOW=1 ./tests/run.sh

# The build `make test` makes on a machine without the toolkit (CUDA=0), in a
# folder of its own, so that it and the CUDA build's objects never mix: every
# unit test, and the integration tests that meet what CUDA=0 changes (the
# worker's backend table and --help: a cuda piece refused "built without
# CUDA", an idle worker's memory, a fatal device error, text generation end to
# end, make install; CUDA=0 in the tests' environment too).  The other
# integration tests run the same CPU code in make test; CPU_ONLY_INTEG=all runs
# them all here too.  CI runs it beside the CUDA build's tests.
CPU_ONLY_INTEG ?= test_n_cuda_piece_without_cuda test_n4_idle_worker_memory \
                  test_n3_fatal_device_error test_h_generate test_a_ready_with_spare test_systemd
cpu-only: deps
	@./scripts/pyenv.sh > /dev/null
	@$(MAKE) --no-print-directory WERROR=1 $(PROGRAMS)
	@$(MAKE) --no-print-directory CUDA=0 BUILD=build/nocuda BIN=build/nocuda/bin TESTING=1 WERROR=1 \
	  all-tests
	@build/nocuda/bin/tessera-worker --help | grep -q "built without CUDA"
	@CUDA=0 TSR_INTEGRATION_ONLY="$(filter-out all,$(CPU_ONLY_INTEG))" TSR_RELEASE_BIN=$(BIN) \
	  TSR_BIN=build/nocuda/bin TSR_BUILD=build/nocuda ./tests/run.sh

# ThreadSanitizer (CI runs it): the unit tests of the threaded code (the worker's
# agent, executor, replica, collectives and pool; the coordinator and its tokenizer
# loader; the kernels' threads) and the integration tests that serve requests
# through real daemons, on a CUDA=0 build.  tests/tsan.supp names each suppression's
# symbol and why.
TSAN_UNIT  ?= test_agent test_collective test_executor test_replica test_scheduler \
              test_tokload test_coordinator test_cpu_pool test_nccl
TSAN_INTEG ?= test_h_generate test_i_concurrent_requests test_j_peer_dies_during_generation
tsan: deps
	@./scripts/pyenv.sh > /dev/null
	@$(MAKE) --no-print-directory CFLAGS="-O1 -g" TSAN=1 \
	  CUDA=0 BUILD=build/tsan BIN=build/tsan/bin TESTING=1 WERROR=1 all \
	  $(patsubst %,build/tsan/tests/%,$(TSAN_UNIT))
	@TSAN_OPTIONS="suppressions=$(CURDIR)/tests/tsan.supp exitcode=66 halt_on_error=1" \
	  TSR_BIN=build/tsan/bin TSR_BUILD=build/tsan TSR_SLOW=1 \
	  ./tests/run.sh only $(TSAN_UNIT) $(TSAN_INTEG)

demo: deps
	@$(MAKE) --no-print-directory all
	@./scripts/demo.sh

# It builds its own CUDA=0 release (build/systemd-check) and installs that.
systemd-check:
	@./scripts/systemd-check.sh $(SYSTEMD_CHECK_FLAGS)

# The release programs serve the benchmarks; the wedged-rank one needs the test
# build's fake-NCCL worker and its test settings.
bench: deps
	@./scripts/pyenv.sh > /dev/null
	@$(MAKE) --no-print-directory $(PROGRAMS) $(BENCH_BIN)
	@$(MAKE) --no-print-directory $(TEST_VARS) all $(TEST_BUILD)/tests/tessera-worker-fake-nccl
	@./bench/run.sh
	@./bench/data.sh
	@./bench/serve.sh
	@./bench/tokenize.sh
	@./bench/http.sh
	@./bench/client_kill.sh
	@TSR_BIN=$(TEST_BUILD)/bin TSR_BUILD=$(TEST_BUILD) ./bench/wedge.sh
	@./bench/chaos.sh
	@./bench/chaos.sh --netns 300
	@./bench/autoscale.sh
	@./bench/cost_model.sh
	@./bench/reshard.sh
	@./bench/prefix.sh
	@./bench/weights.sh
	@./bench/serve.sh --quick --weights-dtype int8
	@./bench/sequence.sh

# The units name the installed binaries and SYSCONFDIR's files (@PREFIX@,
# @SYSCONFDIR@); UNITDIR is where systemd finds them.
UNITS := tessera-coordinator.service tessera-worker@.service
install: $(PROGRAMS)
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(UNITDIR) \
	  $(DESTDIR)$(PREFIX)/share/tessera/configs $(DESTDIR)$(PREFIX)/share/doc/tessera
	install -m 0755 $(PROGRAMS) $(DESTDIR)$(PREFIX)/bin/
	for u in $(UNITS); do \
	  sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@SYSCONFDIR@|$(SYSCONFDIR)|g' systemd/$$u > \
	    $(DESTDIR)$(UNITDIR)/$$u || exit 1; \
	done
	cp -r configs/*.yaml configs/models $(DESTDIR)$(PREFIX)/share/tessera/configs/
	install -m 0644 README.md $(DESTDIR)$(PREFIX)/share/doc/tessera/
	install -d -m 0755 $(DESTDIR)$(SYSCONFDIR)/tessera/keys/allowed
	@if [ ! -e $(DESTDIR)$(SYSCONFDIR)/tessera/keys/coordinator.key ]; then \
	  echo "make install: the units expect CURVE keys in $(SYSCONFDIR)/tessera/keys:"; \
	  echo "  on the coordinator host: tessera keys init $(SYSCONFDIR)/tessera/keys, then"; \
	  echo "  tessera keys add $(SYSCONFDIR)/tessera/keys HOSTNAME for each machine and cli"; \
	fi

# What install laid out, with the same PREFIX, SYSCONFDIR, UNITDIR and DESTDIR; the
# key store and the deployment file under SYSCONFDIR/tessera are the operator's and
# stay.
uninstall:
	rm -f $(addprefix $(DESTDIR)$(PREFIX)/bin/,$(notdir $(PROGRAMS))) \
	  $(addprefix $(DESTDIR)$(UNITDIR)/,$(UNITS)) $(DESTDIR)$(PREFIX)/share/doc/tessera/README.md
	rm -rf $(DESTDIR)$(PREFIX)/share/tessera
	-rmdir $(DESTDIR)$(PREFIX)/share/doc/tessera 2> /dev/null

# ---- fuzzing ----------------------------------------------------------------
# libFuzzer targets, built with clang in their own tree: every object with
# -fsanitize=fuzzer-no-link plus ASan and UBSan, each target linked with
# -fsanitize=fuzzer.  `make fuzz` runs each for FUZZ_SECONDS from its seed
# corpus (tests/fuzz/corpus/<target>/) and fails on any finding; the inputs it
# finds go to $(FUZZ_BUILD)/corpus/, crashes to $(FUZZ_BUILD)/findings/.
# FUZZ_TARGETS=fuzz_wire limits the run to some targets.
FUZZ_CC      ?= clang
FUZZ_SECONDS ?= 60
FUZZ_BUILD   ?= build/fuzz
FUZZ_SRC     := $(wildcard tests/fuzz/fuzz_*.c)
FUZZ_TARGETS ?= $(patsubst tests/fuzz/%.c,%,$(FUZZ_SRC))
FUZZ_BIN     := $(patsubst tests/fuzz/%.c,$(FUZZ_BUILD)/bin/%,$(FUZZ_SRC))
# Not -Werror: clang warns about things gcc does not, and the gcc build is
# the one that keeps the tree warning-free.
FUZZ_CFLAGS  := -O1 -g -fno-omit-frame-pointer -std=gnu11 -Wall -Wextra \
                -Wno-unknown-warning-option -MMD -MP -D_GNU_SOURCE -DTSR_TESTING -I. -I$(BUILD)/gen \
                $(shell pkg-config --cflags $(PKGS) 2>/dev/null) \
                -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined
fuzzobj = $(patsubst %.c,$(FUZZ_BUILD)/obj/%.o,$(1))
FUZZ_LIB_OBJ := $(call fuzzobj,$(COMMON_SRC) $(COORD_SRC) $(PROTO_C))
FUZZ_WORKER_OBJ := $(call fuzzobj,$(WORKER_SRC))

fuzz: deps
	@command -v $(FUZZ_CC) > /dev/null 2>&1 || { echo "make fuzz: $(FUZZ_CC) not found;" \
	  "the fuzz targets need clang with libFuzzer (scripts/install-deps.sh installs it," \
	  "or set FUZZ_CC)" >&2; exit 1; }
	@$(MAKE) --no-print-directory fuzz-build
	@FUZZ_BUILD=$(FUZZ_BUILD) FUZZ_SECONDS=$(FUZZ_SECONDS) ./tests/fuzz/run.sh $(FUZZ_TARGETS)

fuzz-build: $(FUZZ_BIN)
# The worker agent and data-port targets link the worker.  The CPU vector
# kernels (the engine, its attention and KV rows, the f32 and bf16 products,
# the kernel chooser and greedy sampling: worker/simd.h) are gcc's (clang 14
# refuses them), so those objects are gcc's and uninstrumented: neither target
# runs them.
$(FUZZ_BUILD)/bin/fuzz_agent $(FUZZ_BUILD)/bin/fuzz_dataport: $(FUZZ_WORKER_OBJ)
$(call fuzzobj,worker/engine_cpu.c worker/cpu_pool.c worker/sample.c worker/matmul_bf16.c \
                worker/matmul_f32.c worker/matmul_i8.c worker/cpu_kernels.c worker/kv_format.c \
                worker/attention_cpu.c): $(FUZZ_BUILD)/obj/%.o: %.c $(PROTO_C)
	@mkdir -p $(dir $@)
	$(CC) -O2 -g -std=gnu11 -Wno-psabi -D_GNU_SOURCE -DTSR_TESTING -I. -I$(BUILD)/gen \
	  $(shell pkg-config --cflags $(PKGS) 2>/dev/null) -MMD -MP -c $< -o $@
# Kept between runs: they are not intermediate files.
.SECONDARY: $(FUZZ_LIB_OBJ) $(FUZZ_WORKER_OBJ)

# Rewrites the encoded seeds (wire messages, coordinator scripts) after a
# protocol change; the other seeds are plain files.
fuzz-corpus: $(BUILD)/tests/fuzz_mkcorpus
	$(BUILD)/tests/fuzz_mkcorpus tests/fuzz/corpus
$(BUILD)/tests/fuzz_mkcorpus: tests/fuzz/mkcorpus.c $(COMMON_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $(ALL_LDFLAGS) $^ $(ALL_LDLIBS) -o $@

$(FUZZ_BUILD)/obj/%.o: %.c $(PROTO_C)
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -c $< -o $@
$(FUZZ_BUILD)/bin/%: tests/fuzz/%.c $(FUZZ_LIB_OBJ)
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer $(filter %.c %.o,$^) $(ALL_LDLIBS) -o $@

clean:
	rm -rf build bin

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
-include $(shell find $(FUZZ_BUILD)/obj $(FUZZ_BUILD)/bin -name '*.d' 2>/dev/null)
