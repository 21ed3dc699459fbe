#!/bin/bash
# call-cycles.sh: finds circles of calls between source files, from their objects.
#   scripts/call-cycles.sh [--src ROOT] OBJ_DIR...
# File A calls file B when one of A's undefined symbols is defined in B (nm).  The
# objects of every OBJ_DIR are taken together, so a circle that passes through two
# directories is found too.  Each circle is printed as its files, with the calls that
# close it (a few symbols per pair of files); the exit status is 1 when there is one,
# 0 when there is none, 2 on a usage error.  A module that calls the module that calls
# it is one module in two files (STYLE.md): the fix is to move the lower half down.
# With --src ROOT an object whose source (ROOT/coordinator/loop.c for
# .../obj/coordinator/loop.o) is gone is left out: a stale object of a file since
# removed or split would make circles that are no longer there.
set -u
src=
if [ "${1:-}" = --src ]; then src=${2:-}; shift 2 || { echo "usage: $0 [--src ROOT] OBJ_DIR..." >&2; exit 2; }; fi
[ $# -ge 1 ] || { echo "usage: $0 [--src ROOT] OBJ_DIR..." >&2; exit 2; }
objs=()
for d in "$@"; do
    [ -d "$d" ] || { echo "$0: $d: not a directory" >&2; exit 2; }
    for o in "$d"/*.o; do [ -e "$o" ] && objs+=("$o"); done
done
[ ${#objs[@]} -gt 0 ] || { echo "$0: no objects under $*" >&2; exit 2; }

# One line per symbol: "D file symbol" for a global definition, "U file symbol" for a
# use.  Files are named by their source: build/obj/coordinator/loop.o -> coordinator/loop.c.
for o in "${objs[@]}"; do
    name=${o#*/obj/}
    name=${name%.o}
    case "$name" in *.c|*.cu) ;; *) name="$name.c" ;; esac
    [ -z "$src" ] || [ -e "$src/$name" ] || continue
    nm -g --defined-only "$o" | awk -v f="$name" 'NF >= 3 {print "D", f, $3}'
    nm -u "$o" | awk -v f="$name" '{print "U", f, $NF}'
done | awk '
$1 == "D" { def[$3] = $2; files[$2] = 1; next }
$1 == "U" { use[++nu] = $2 SUBSEP $3; files[$2] = 1 }
END {
    n = 0
    for (f in files) name[++n] = f
    # sorted, so the report is the same from run to run
    for (i = 2; i <= n; i++)
        for (j = i; j > 1 && name[j - 1] > name[j]; j--) { t = name[j]; name[j] = name[j - 1]; name[j - 1] = t }
    for (i = 1; i <= n; i++) idx[name[i]] = i
    for (k = 1; k <= nu; k++) {
        split(use[k], p, SUBSEP)
        a = p[1]; s = p[2]
        if (!(s in def) || def[s] == a) continue
        i = idx[a]; j = idx[def[s]]
        reach[i, j] = 1
        if (cnt[i, j]++ < 3) via[i, j] = via[i, j] (via[i, j] == "" ? "" : ", ") s
        else if (cnt[i, j] == 4) via[i, j] = via[i, j] ", ..."
    }
    # transitive closure (Warshall): a few dozen files
    for (k = 1; k <= n; k++)
        for (i = 1; i <= n; i++) {
            if (!((i, k) in reach)) continue
            for (j = 1; j <= n; j++) if ((k, j) in reach) reach[i, j] = 1
        }
    found = 0
    for (i = 1; i <= n; i++) {
        if (done[i]) continue
        m = 0
        for (j = 1; j <= n; j++)
            if (j == i || (((i, j) in reach) && ((j, i) in reach))) member[++m] = j
        if (m < 2) continue
        found++
        line = ""
        for (x = 1; x <= m; x++) { done[member[x]] = 1; line = line (x > 1 ? " " : "") name[member[x]] }
        printf "circle of calls among: %s\n", line
        for (x = 1; x <= m; x++)
            for (y = 1; y <= m; y++) {
                a = member[x]; b = member[y]
                if (a != b && ((a, b) in via))
                    printf "  %s -> %s: %s\n", name[a], name[b], via[a, b]
            }
    }
    if (found) { printf "%d circle(s) of calls\n", found; exit 1 }
    printf "no circle of calls among %d file(s)\n", n
}'
