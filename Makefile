# Tessera: one Makefile that reads like a table.
#
#   make            bin/tessera-coordinator bin/tessera-worker bin/tessera
#   make test       install missing deps, build, run unit + integration tests
#   make asan       the same tests built with AddressSanitizer + UBSan
#   make tsan       the same tests built with ThreadSanitizer (not in CI)
#   make demo       install missing deps, build, run the demo cluster
#   make bench      control-plane, data-plane and serving benchmarks (bench/)
#   make install    PREFIX=/usr/local: binaries, systemd units, example configs

BUILD    ?= build
BIN      ?= bin
PREFIX   ?= /usr/local
SANITIZE ?=

PKGS     := libczmq libzmq yaml-0.1 libprotobuf-c jansson libsystemd openblas libcrypto
CC       ?= cc
CFLAGS   ?= -O2 -g
CFLAGS   += -std=gnu11 -Wall -Wextra -Werror -Wno-format-truncation -MMD -MP -D_GNU_SOURCE \
            -I. -I$(BUILD)/gen $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
LDLIBS   += $(shell pkg-config --libs $(PKGS) 2>/dev/null) -lm -lpthread
ifneq ($(SANITIZE),)
CFLAGS   += -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
LDFLAGS  += -fsanitize=address,undefined
endif

# snprintf truncation is how bounded messages are built here, not a bug.
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
CLI_OBJ      := $(call obj,$(CLI_SRC))
UNIT_BIN     := $(patsubst tests/unit/%.c,$(BUILD)/tests/%,$(UNIT_SRC))
BENCH_BIN    := $(patsubst bench/%.c,$(BUILD)/bench/%,$(BENCH_SRC))

PROGRAMS := $(BIN)/tessera-coordinator $(BIN)/tessera-worker $(BIN)/tessera

.PHONY: all deps test unit integration asan tsan demo bench install clean
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
	$(CC) $(CFLAGS) -c $< -o $@
$(PROTO_C:.c=.o): $(PROTO_C)
	$(CC) $(filter-out -Werror,$(CFLAGS)) -c $< -o $@

# ---- binaries -------------------------------------------------------------
$(BIN)/tessera-coordinator: $(call obj,coordinator/main.c) $(COORD_OBJ) $(COMMON_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) $^ $(LDLIBS) -o $@
$(BIN)/tessera-worker: $(call obj,worker/main.c) $(WORKER_OBJ) $(COMMON_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) $^ $(LDLIBS) -o $@
$(BIN)/tessera: $(call obj,cli/main.c) $(CLI_OBJ) $(COORD_OBJ) $(COMMON_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) $^ $(LDLIBS) -o $@

$(BUILD)/tests/%: tests/unit/%.c $(COORD_OBJ) $(WORKER_OBJ) $(CLI_OBJ) $(COMMON_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(LDFLAGS) $^ $(LDLIBS) -lcmocka -o $@
$(BUILD)/bench/%: bench/%.c $(COMMON_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(LDFLAGS) $^ $(LDLIBS) -o $@
# bench_pool measures the worker's thread pool, so it links that one object.
$(BUILD)/bench/bench_pool: $(call obj,worker/cpu_pool.c)

# ---- tests ----------------------------------------------------------------
test: deps
	@$(MAKE) --no-print-directory all-tests
	@TSR_BIN=$(BIN) TSR_BUILD=$(BUILD) ./tests/run.sh

all-tests: all $(UNIT_BIN) $(BENCH_BIN)

unit: $(PROGRAMS) $(UNIT_BIN)
	@TSR_BIN=$(BIN) TSR_BUILD=$(BUILD) ./tests/run.sh unit
integration: $(PROGRAMS)
	@TSR_BIN=$(BIN) TSR_BUILD=$(BUILD) ./tests/run.sh integration

asan: deps
	@$(MAKE) --no-print-directory BUILD=build/asan BIN=build/asan/bin SANITIZE=1 all-tests
	@ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  TSR_BIN=build/asan/bin TSR_BUILD=build/asan TSR_SLOW=1 ./tests/run.sh

# ThreadSanitizer on the multi-threaded paths (worker agent + data plane,
# collectives); not part of CI, which runs asan.
tsan: deps
	@CFLAGS="-O1 -g -fsanitize=thread" LDFLAGS="-fsanitize=thread" $(MAKE) --no-print-directory \
	  BUILD=build/tsan BIN=build/tsan/bin all-tests
	@TSAN_OPTIONS="suppressions=$(CURDIR)/tests/tsan.supp exitcode=66" \
	  TSR_BIN=build/tsan/bin TSR_BUILD=build/tsan TSR_SLOW=1 ./tests/run.sh

demo: deps
	@$(MAKE) --no-print-directory all
	@./scripts/demo.sh

bench: deps
	@$(MAKE) --no-print-directory $(PROGRAMS) $(BENCH_BIN)
	@./bench/run.sh
	@./bench/data.sh
	@./bench/serve.sh

install: $(PROGRAMS)
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/lib/systemd/system \
	  $(DESTDIR)$(PREFIX)/share/tessera/configs $(DESTDIR)$(PREFIX)/share/doc/tessera
	install -m 0755 $(PROGRAMS) $(DESTDIR)$(PREFIX)/bin/
	sed 's|@PREFIX@|$(PREFIX)|g' systemd/tessera-coordinator.service > \
	  $(DESTDIR)$(PREFIX)/lib/systemd/system/tessera-coordinator.service
	sed 's|@PREFIX@|$(PREFIX)|g' systemd/tessera-worker@.service > \
	  $(DESTDIR)$(PREFIX)/lib/systemd/system/tessera-worker@.service
	cp -r configs/*.yaml configs/models $(DESTDIR)$(PREFIX)/share/tessera/configs/
	install -m 0644 README.md $(DESTDIR)$(PREFIX)/share/doc/tessera/

clean:
	rm -rf build bin

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
