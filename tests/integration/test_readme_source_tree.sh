# The README's source tree names every source file: each .c, .cu, .h, .sh, .py and
# .proto under the code folders appears there by name (a header as itself or through
# the .c beside it, written "x.c + .h").
source "$(dirname "$0")/lib.sh"
cd "$ROOT"
tree=$(sed -n '/^## Source tree/,/^## /p' README.md)
[ -n "$tree" ] || fail "README.md has no Source tree section"
missing=()
for f in $(git ls-files common coordinator worker cli proto scripts bench systemd tests/*.sh \
           tests/unit tests/integration tests/cuda tests/chaos tests/fuzz tests/reference \
           tests/tokenizer tests/http | grep -v '^tests/fuzz/corpus/' |
           grep -v '^tests/unit/test_.*\.c$\|^tests/integration/test_.*\.sh$'); do
    b=$(basename "$f")
    grep -qF "$b" <<< "$tree" && continue
    case "$b" in
        *.h) grep -qF "${b%.h}.c + .h" <<< "$tree" && continue
             grep -qF "${b%.h}.cu + .h" <<< "$tree" && continue ;;
    esac
    missing+=("$f")
done
[ ${#missing[@]} -eq 0 ] || fail "the README's source tree does not name: ${missing[*]}"
ok "the README's source tree names every source file"
