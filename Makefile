# Stand-alone builds of the core, for the sanitizer run and the C test driver.
CC ?= cc
# GM_DEBUG: the core's assertions at its state changes (csrc/core/debug.h) are on in
# these builds; the extension that setup.py builds leaves them out.
CFLAGS_COMMON = -std=c11 -D_GNU_SOURCE -DGM_DEBUG -Wall -Wextra -Werror -Icsrc/include -Icsrc/core -pthread
CORE_SRC = $(wildcard csrc/core/*.c) $(wildcard csrc/device/*.c)
# the model of torch's allocator: plain C on its own, no core
NATIVE_SRC = csrc/model/native_model.c
# the fuzz driver: its run and main (fuzz.c), its model of the heap, its operations, its threaded run
FUZZ_SRC = csrc/tests/fuzz.c csrc/tests/fuzz_model.c csrc/tests/fuzz_ops.c csrc/tests/fuzz_threads.c
FUZZ_DEPS = $(FUZZ_SRC) csrc/tests/fuzz.h csrc/tests/args.h csrc/tests/rng.h
ASAN = -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all

.PHONY: fuzz asan tsan clean
fuzz: csrc/tests/fuzz csrc/tests/fuzz_native
asan: csrc/tests/fuzz_asan csrc/tests/fuzz_native_asan
tsan: csrc/tests/fuzz_tsan

csrc/tests/fuzz: $(FUZZ_DEPS) $(CORE_SRC)
	$(CC) $(CFLAGS_COMMON) -O2 -g -o $@ $(filter %.c,$^) -ldl

csrc/tests/fuzz_asan: $(FUZZ_DEPS) $(CORE_SRC)
	$(CC) $(CFLAGS_COMMON) $(ASAN) -o $@ $(filter %.c,$^) -ldl

# ThreadSanitizer: run with --threads (the single-threaded run has nothing to race).
csrc/tests/fuzz_tsan: $(FUZZ_DEPS) $(CORE_SRC)
	$(CC) $(CFLAGS_COMMON) -O1 -g -fno-omit-frame-pointer -fsanitize=thread -o $@ $(filter %.c,$^) -ldl

csrc/tests/fuzz_native: csrc/tests/fuzz_native.c csrc/tests/args.h csrc/tests/rng.h $(NATIVE_SRC)
	$(CC) $(CFLAGS_COMMON) -O2 -g -o $@ $(filter %.c,$^)

csrc/tests/fuzz_native_asan: csrc/tests/fuzz_native.c csrc/tests/args.h csrc/tests/rng.h $(NATIVE_SRC)
	$(CC) $(CFLAGS_COMMON) $(ASAN) -o $@ $(filter %.c,$^)

clean:
	rm -f csrc/tests/fuzz csrc/tests/fuzz_asan csrc/tests/fuzz_tsan csrc/tests/fuzz_native csrc/tests/fuzz_native_asan
