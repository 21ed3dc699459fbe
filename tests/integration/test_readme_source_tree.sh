# The README's source tree names every source file under its own folder: each .c, .cu,
# .h, .sh, .py and .proto of the code folders appears by name in the lines of its
# folder's entry (a header as itself or through the .c beside it: "x.c + .h", or an
# entry that says "a .h beside each .c").
source "$(dirname "$0")/lib.sh"
cd "$ROOT"
tree=$(sed -n '/^## Source tree/,/^## /p' README.md | sed -n '/^```$/,/^```$/p')
[ -n "$tree" ] || fail "README.md has no Source tree section"
# entry DIR: the lines of DIR's entry ("dir/" at the start of a line, or "  sub/" under
# its parent), up to the next entry of the same or a higher level
entry() {
    local top=${1%%/*} sub=${1#*/}
    if [ "$sub" = "$1" ]; then
        awk -v d="$top/" 'index($0, d) == 1 { on = 1; print; next }
                          on && /^[^ ]/ { on = 0 } on { print }' <<< "$tree"
    else
        awk -v d="$top/" -v s="  $sub/" 'index($0, d) == 1 { top = 1; next }
            top && /^[^ ]/ { top = 0 }
            top && index($0, s) == 1 { on = 1; print; next }
            on && /^  [a-z]/ { on = 0 } on { print }' <<< "$tree"
    fi
}
missing=()
for f in $(git ls-files common coordinator worker cli proto scripts bench systemd tests/*.sh \
           tests/unit tests/integration tests/cuda tests/chaos tests/fuzz tests/reference \
           tests/tokenizer tests/http | grep -v '^tests/fuzz/corpus/' |
           grep -v '^tests/unit/test_.*\.c$\|^tests/integration/test_.*\.sh$'); do
    d=$(dirname "$f") b=$(basename "$f")
    lines=$(entry "$d")
    if [ -z "$lines" ] && [ "${d#*/}" != "$d" ]; then
        # a folder without an entry of its own is named in its parent's: "sub/file"
        lines=$(entry "${d%%/*}") b="${d#*/}/$b"
    fi
    [ -n "$lines" ] || { missing+=("$f (no entry for $d/)"); continue; }
    grep -qwF "$b" <<< "$lines" && continue
    case "$b" in
        *.h) grep -qF "${b%.h}.c + .h" <<< "$lines" && continue
             # a folder whose entry says every .c has its .h
             grep -qF "a .h beside each .c" <<< "$lines" && grep -qwF "${b%.h}.c" <<< "$lines" &&
                 continue
             grep -qF "${b%.h}.cu + .h" <<< "$lines" && continue ;;
    esac
    missing+=("$f")
done
[ ${#missing[@]} -eq 0 ] || fail "the README's source tree does not name: ${missing[*]}"
ok "the README's source tree names every source file under its folder"
