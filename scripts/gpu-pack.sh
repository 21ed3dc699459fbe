#!/bin/bash
# Packs what scripts/gpu-check.sh runs, for a GPU machine that has the CUDA
# toolkit and driver but none of Tessera's other libraries (and cannot
# install them): the binaries, the check's two programs, and every library
# they load except the C library, the C++ runtime and CUDA's own, into
# build/gpu-pack.tar.xz.  On the GPU machine, from the repository root:
#
#   tar -xJf build/gpu-pack.tar.xz -C build && \
#   TSR_BIN=build/gpu-pack/bin TSR_BUILD=build/gpu-pack TSR_LIBS=build/gpu-pack/lib \
#   scripts/gpu-check.sh
set -eu
cd "$(dirname "$0")/.."
# The test build: the check uses its test settings (a release build ignores them).
TB=build/test
make -j"$(nproc)" TESTING=1 BUILD=$TB BIN=$TB/bin all $TB/tests/test_kmath $TB/bench/gpu_bench > /dev/null
P=build/gpu-pack
rm -rf "$P" build/gpu-pack.tar.xz
mkdir -p "$P/bin" "$P/lib" "$P/tests" "$P/bench"
cp $TB/bin/tessera $TB/bin/tessera-worker $TB/bin/tessera-coordinator "$P/bin/"
cp $TB/tests/test_kmath "$P/tests/"
cp $TB/bench/gpu_bench "$P/bench/"
for b in "$P"/bin/* "$P"/tests/* "$P"/bench/*; do ldd "$b"; done | awk '/=> \// {print $3}' | sort -u |
    grep -vE '/(libc|libm|libpthread|libdl|librt|libresolv|ld-linux[^/]*|libcuda|libcublas[^/]*|libcudart|libgcc_s|libstdc\+\+)\.so' |
    while read -r lib; do cp -L "$lib" "$P/lib/"; done
tar -C build -cJf build/gpu-pack.tar.xz gpu-pack
echo "build/gpu-pack.tar.xz: $(du -h build/gpu-pack.tar.xz | cut -f1), $(ls "$P/lib" | wc -l) libraries"
