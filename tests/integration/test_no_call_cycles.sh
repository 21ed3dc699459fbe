# No two source files in coordinator/ or common/ call each other, directly or
# round a circle (scripts/call-cycles.sh, from the built objects): calls go one
# way, loop -> control -> requests -> placement -> state.  The check is first
# shown to find a circle made on purpose, and to pass a chain without one.
source "$(dirname "$0")/lib.sh"
CHECK="$ROOT/scripts/call-cycles.sh"
OBJ="${TSR_BUILD:-build}"
case "$OBJ" in /*) ;; *) OBJ="$ROOT/$OBJ" ;; esac
OBJ="$OBJ/obj"

# a.c -> b.c -> c.c -> a.c is a circle; d.c calls into it from above and is not in it.
mkdir -p "$T/obj/x" "$T/obj/y"
printf 'int b_f(void);\nint a_f(void) { return b_f(); }\n' > "$T/a.c"
printf 'int c_f(void);\nint b_f(void) { return c_f(); }\n' > "$T/b.c"
printf 'int a_f(void);\nint c_f(void) { return a_f() + 1; }\n' > "$T/c.c"
printf 'int a_f(void);\nint d_f(void) { return a_f(); }\n' > "$T/d.c"
for f in a b d; do cc -c "$T/$f.c" -o "$T/obj/x/$f.o" || fail "cc $f.c"; done
cc -c "$T/c.c" -o "$T/obj/y/c.o" || fail "cc c.c"
"$CHECK" "$T/obj/x" "$T/obj/y" > "$T/planted.txt"; rc=$?
[ $rc = 1 ] || fail "a planted circle was not found (rc $rc): $(cat "$T/planted.txt")"
grep -q "circle of calls among: x/a.c x/b.c y/c.c$" "$T/planted.txt" ||
    fail "the planted circle is not named: $(cat "$T/planted.txt")"
grep -q "y/c.c -> x/a.c: a_f" "$T/planted.txt" || fail "the closing call is not named: $(cat "$T/planted.txt")"
grep -q "d.c" "$T/planted.txt" && fail "a caller outside the circle is named: $(cat "$T/planted.txt")"
# the same files without the call that closes the circle: no circle
printf 'int c_f(void) { return 1; }\n' > "$T/c.c"
cc -c "$T/c.c" -o "$T/obj/y/c.o" || fail "cc c.c"
"$CHECK" "$T/obj/x" "$T/obj/y" > "$T/chain.txt" || fail "a chain was taken for a circle: $(cat "$T/chain.txt")"
ok "the check finds a planted circle and passes a chain"

[ -d "$OBJ/coordinator" ] && [ -d "$OBJ/common" ] || fail "no objects under $OBJ (run make first)"
# every source file's object is there to be looked at
for d in coordinator common; do
    for f in "$ROOT"/$d/*.c; do
        [ -f "$OBJ/$d/$(basename "${f%.c}").o" ] || fail "no object for $d/$(basename "$f") under $OBJ"
    done
done
"$CHECK" --src "$ROOT" "$OBJ/coordinator" "$OBJ/common" > "$T/tree.txt" || fail "$(cat "$T/tree.txt")"
ok "$(cat "$T/tree.txt")"
