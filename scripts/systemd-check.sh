#!/bin/bash
# `make systemd-check`: the units under a real systemd.  Builds a minimal
# Debian 12 root with debootstrap (cached), boots it with systemd-nspawn (its
# own root, its own network namespace: nothing of this machine is touched but
# the cache and build/systemd-check), installs Tessera into it with `make
# install`, creates the keys as the README says and then, through systemctl
# inside the container: starts the coordinator and three CPU workers
# (tessera-worker@0..2), generates, reloads after a YAML edit, kills a worker
# (SIGKILL, then a stuck data plane: exit status 75), stalls one with SIGSTOP
# until its watchdog fires, and reads the daemons' lines in the journal.
# Every wait is bounded.  Prints PASS or FAIL per step and a summary; exits 1
# on a failure.  Needs root on a Debian 12 machine (apt, dpkg).
#
#   scripts/systemd-check.sh [--rebuild] [--keep]
#     --rebuild  make the cached Debian root again
#     --keep     leave the container's root (CACHE/run) after the run
#   TESSERA_CHECK_CACHE   where the root is cached (default /var/cache/tessera-systemd-check)
#   TESSERA_DEBIAN_MIRROR the mirror debootstrap uses (default: apt's for bookworm)
set -u
cd "$(dirname "$0")/.." || exit 2
SRC=$PWD
REBUILD=0; KEEP=0
for a in "$@"; do
    case "$a" in
        --rebuild) REBUILD=1 ;;
        --keep) KEEP=1 ;;
        -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "systemd-check: unknown argument $a (see --help)" >&2; exit 2 ;;
    esac
done
[ "$(id -u)" -eq 0 ] || { echo "systemd-check: needs root (debootstrap, systemd-nspawn)" >&2; exit 2; }
command -v dpkg > /dev/null || { echo "systemd-check: needs a Debian machine (dpkg, apt)" >&2; exit 2; }

SUITE=bookworm
MACHINE=tessera-check          # the container's host name: the workers' key is tessera-check.key
CACHE=${TESSERA_CHECK_CACHE:-/var/cache/tessera-systemd-check}
ROOTFS=$CACHE/root-$SUITE      # the cached, clean root
RUN=$CACHE/run                 # this run's copy, with Tessera installed
BUILD=build/systemd-check
LOGS=$BUILD/logs
CG=tessera-systemd-check       # the cgroup the container runs under without a host systemd
YAML=/etc/tessera/deployment.yaml
MODEL=/srv/tessera/models/tiny
T0=$(date +%s)
NSPAWN_PID=""; LEADER=""
PASSED=0; FAILED=0; FAILED_NAMES=""

mkdir -p "$LOGS" "$CACHE"
# one run at a time: they would share the machine name, the root and the logs
exec 9> "$CACHE/lock"
flock -n 9 || { echo "systemd-check: another run holds $CACHE/lock" >&2; exit 2; }
rm -f "$LOGS"/*.log

pass() { PASSED=$((PASSED + 1)); printf 'PASS  %-34s %s\n' "$1" "${2:-}"; }
failed() {
    FAILED=$((FAILED + 1)); FAILED_NAMES="$FAILED_NAMES $1"
    printf 'FAIL  %-34s %s\n' "$1" "${2:-}"
}
# step NAME FUNCTION: FUNCTION prints its detail on stdout; a non-zero status fails the step.
step() {
    local name=$1 out rc; shift
    "$@" > "$LOGS/step.out" 2>&1; rc=$?
    out=$(cat "$LOGS/step.out")
    if [ $rc -eq 0 ]; then pass "$name" "$(tail -n 1 <<< "$out")"
    else failed "$name" "$(tail -n 1 <<< "$out")"; sed 's/^/      /' <<< "$out" | tail -n 15; fi
    return $rc
}
# wait_until SECONDS COMMAND...: true as soon as COMMAND is, false after SECONDS.
wait_until() {
    local end=$(($(date +%s%N) / 1000000 + $1 * 1000)); shift
    until "$@"; do
        [ $(($(date +%s%N) / 1000000)) -ge $end ] && return 1
        sleep 0.2
    done
}
elapsed() { echo $(($(date +%s) - T0)); }

# ---- the container ------------------------------------------------------------
# ct COMMAND...: runs COMMAND inside the booted container (all its namespaces,
# its root), with a clean environment.
ct() { nsenter -t "$LEADER" -a env -i PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$@"; }
cli() { ct tessera --config "$YAML" "$@"; }
unit_prop() { ct systemctl show -p "$2" --value "$1"; }

stop_container() {
    [ -n "$NSPAWN_PID" ] || return 0
    if kill -0 "$NSPAWN_PID" 2> /dev/null; then
        # nspawn answers SIGTERM by shutting the container's systemd down cleanly
        kill -TERM "$NSPAWN_PID" 2> /dev/null
        wait_until 30 eval '! kill -0 '"$NSPAWN_PID"' 2> /dev/null' || kill -KILL "$NSPAWN_PID" 2> /dev/null
    fi
    wait "$NSPAWN_PID" 2> /dev/null
    NSPAWN_PID=""
    # Without a host systemd the container ran in a cgroup of ours (below): remove it.
    local d
    for d in /sys/fs/cgroup/*/"$CG" /sys/fs/cgroup/"$CG"; do
        [ -d "$d" ] && find "$d" -depth -type d -exec rmdir {} \; 2> /dev/null
    done
    return 0
}
cleanup() {
    stop_container
    if [ $KEEP -eq 0 ]; then rm -rf "$RUN"; else echo "systemd-check: the container's root stays in $RUN"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---- host packages, build, root ------------------------------------------------
host_packages() {
    local missing="" p
    for p in debootstrap systemd-container; do dpkg -s "$p" > /dev/null 2>&1 || missing="$missing $p"; done
    if [ -n "$missing" ]; then
        DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing ||
            return 1
    fi
    "$SRC/scripts/install-deps.sh" > /dev/null || return 1
    echo "debootstrap and systemd-nspawn present"
}

build() {
    # CPU workers: the CUDA engine is left out (CUDA=0); the units are the same.
    make -C "$SRC" -j"$(nproc)" CUDA=0 BUILD=$BUILD BIN=$BUILD/bin \
        $BUILD/bin/tessera $BUILD/bin/tessera-coordinator $BUILD/bin/tessera-worker \
        > "$LOGS/build.log" 2>&1 || { tail -n 20 "$LOGS/build.log"; return 1; }
    echo "release build, CUDA=0, in $BUILD"
}

# The Debian packages of the libraries the binaries load, and what a booted
# minimal system needs.
root_packages() {
    local arch lib
    arch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2> /dev/null || gcc -print-multiarch)
    {
        # procps: /bin/kill, which the coordinator's ExecReload runs
        echo systemd; echo systemd-sysv; echo dbus; echo procps
        for lib in $(ldd "$BUILD"/bin/* | awk '/=>/ {print $1}' | sort -u); do
            dpkg -S "*/$arch/$lib" 2> /dev/null | head -n 1 | cut -d: -f1
        done
    } | sort -u | tr '\n' ',' | sed 's/,$//'
}

mirror() {
    if [ -n "${TESSERA_DEBIAN_MIRROR:-}" ]; then echo "$TESSERA_DEBIAN_MIRROR"; return; fi
    apt-get indextargets --format '$(REPO_URI) $(CODENAME)' 'Identifier: Packages' 2> /dev/null |
        awk -v s=$SUITE '$2 == s {print $1; exit}'
}

make_root() {
    local pkgs m
    pkgs=$(root_packages)
    [ -n "$pkgs" ] || { echo "could not list the binaries' packages"; return 1; }
    if [ $REBUILD -eq 0 ] && [ -x "$ROOTFS/lib/systemd/systemd" ] &&
       [ "$(cat "$ROOTFS.packages" 2> /dev/null)" = "$pkgs" ]; then
        echo "cached in $ROOTFS"
        return 0
    fi
    m=$(mirror)
    [ -n "$m" ] || { echo "no $SUITE mirror in apt's sources; set TESSERA_DEBIAN_MIRROR"; return 1; }
    rm -rf "$ROOTFS" "$ROOTFS.new" "$ROOTFS.packages"
    timeout 900 debootstrap --variant=minbase --include="$pkgs" $SUITE "$ROOTFS.new" "$m" \
        > "$LOGS/debootstrap.log" 2>&1 || { tail -n 5 "$LOGS/debootstrap.log"; return 1; }
    mv "$ROOTFS.new" "$ROOTFS" && echo "$pkgs" > "$ROOTFS.packages"
    echo "debootstrap $SUITE: $(du -sh "$ROOTFS" | cut -f1) in $ROOTFS"
}

install_tessera() {
    rm -rf "$RUN"
    cp -a "$ROOTFS" "$RUN" || return 1
    echo $MACHINE > "$RUN/etc/hostname"
    make -C "$SRC" install DESTDIR="$RUN" PREFIX=/usr/local SYSCONFDIR=/etc CUDA=0 \
        BUILD=$BUILD BIN=$BUILD/bin > "$LOGS/install.log" 2>&1 || { cat "$LOGS/install.log"; return 1; }
    local f
    for f in usr/local/bin/tessera-coordinator usr/local/bin/tessera-worker usr/local/bin/tessera \
             usr/local/lib/systemd/system/tessera-coordinator.service \
             usr/local/lib/systemd/system/tessera-worker@.service; do
        [ -e "$RUN/$f" ] || { echo "make install did not install /$f"; return 1; }
    done
    echo "make install DESTDIR=$RUN PREFIX=/usr/local SYSCONFDIR=/etc"
}

boot() {
    local args=(-D "$RUN" --boot --machine="$MACHINE" --private-network --console=passive)
    if [ -d /run/systemd/system ]; then
        setsid systemd-nspawn "${args[@]}" > "$LOGS/console.log" 2>&1 &
    else
        # No systemd on this host to register with or to make a scope: run
        # the container in a cgroup of our own (nspawn puts it below this).
        local h
        for h in /sys/fs/cgroup/*/ /sys/fs/cgroup/; do
            [ -e "$h/cgroup.procs" ] && [ ! -e "$h/$CG" ] && mkdir "$h/$CG"
        done
        setsid bash -c 'for h in /sys/fs/cgroup/*/"$0" /sys/fs/cgroup/"$0"; do
                            [ -e "$h/cgroup.procs" ] && echo $$ > "$h/cgroup.procs"; done
                        exec systemd-nspawn --register=no --keep-unit "$@"' "$CG" "${args[@]}" \
            > "$LOGS/console.log" 2>&1 &
    fi
    NSPAWN_PID=$!
    leader() {
        LEADER=$(pgrep -P "$NSPAWN_PID" -x systemd | head -n 1)
        [ -n "$LEADER" ]
    }
    wait_until 30 leader || { echo "no systemd in the container"; tail -n 5 "$LOGS/console.log"; return 1; }
    # is-system-running answers once systemd's socket is up; until then it fails.
    local state=""
    up() {
        state=$(ct systemctl is-system-running 2>&1)
        case "$state" in running|degraded) return 0 ;; esac
        return 1
    }
    wait_until 90 up || { echo "the container's systemd did not come up: '$state'"; return 1; }
    [ "$state" = running ] ||
        echo "failed units: $(ct systemctl --failed --no-legend --plain | cut -d' ' -f1 | tr '\n' ' ')"
    echo "systemd-nspawn --boot: $(ct systemctl --version | head -n 1), $state"
}

# ---- the operator's steps, as the README gives them ---------------------------
setup() {
    # keys: a store, and a key for the machine (its workers) and one for the CLI
    ct tessera keys init /etc/tessera/keys > /dev/null || return 1
    ct tessera keys add /etc/tessera/keys $MACHINE > /dev/null || return 1
    ct tessera keys add /etc/tessera/keys cli > /dev/null || return 1
    ct tessera model-init $MODEL --layers 6 > /dev/null || return 1
    write_yaml 2 || return 1
    printf 'TESSERA_COORDINATOR_WORKERS=tcp://127.0.0.1:7400\nTESSERA_DEVICE=cpu\n' |
        ct tee /etc/default/tessera-worker > /dev/null || return 1
    echo "keys: $(ct tessera keys list /etc/tessera/keys | awk '{print $1}' | tr '\n' ' ')"
}

# write_yaml PIPELINE: the deployment: one model in PIPELINE stages on the CPU workers.
write_yaml() {
    ct tee $YAML > /dev/null <<EOF
version: 1
coordinator:
  workers_endpoint: tcp://127.0.0.1:7400
  control_endpoint: tcp://127.0.0.1:7401
  http_endpoint: 127.0.0.1:8000
  heartbeat_interval_ms: 100
  worker_timeout_ms: 1000
  security: curve
  keys_dir: /etc/tessera/keys
deployments:
  - name: tiny
    model: $MODEL
    device: cpu
    parallel:
      tensor: 1
      pipeline: $1
      replicas: 1
    max_seq_len: 128
    collective_timeout_ms: 2000
EOF
}

# stages: how many stages replica 0 of the deployment has, and whether it is ready.
stages() {
    cli status --json | python3 -c '
import json, sys
d = json.load(sys.stdin)["deployments"][0]["replica_list"][0]
print(len(d["stages"]), d["state"])'
}
ready_with() { [ "$(stages 2> /dev/null)" = "$1 ready" ]; }

start_units() {
    ct systemctl start tessera-coordinator || { ct journalctl -u tessera-coordinator --no-pager | tail -n 20; return 1; }
    ct systemctl start tessera-worker@0 tessera-worker@1 tessera-worker@2 ||
        { ct journalctl -u 'tessera-worker@*' --no-pager | tail -n 20; return 1; }
    local u
    for u in tessera-coordinator tessera-worker@0 tessera-worker@1 tessera-worker@2; do
        [ "$(unit_prop $u ActiveState)" = active ] || { echo "$u is $(unit_prop $u ActiveState)"; return 1; }
    done
    echo "coordinator and tessera-worker@0..2 active (Type=notify: READY=1 seen)"
}

sandboxed() {
    local u pid uid
    for u in tessera-coordinator tessera-worker@0; do
        pid=$(unit_prop $u MainPID)
        uid=$(ct awk '/^Uid:/ {print $2}' /proc/"$pid"/status)
        [ -n "$uid" ] && [ "$uid" -ne 0 ] || { echo "$u runs as uid '$uid', not a dynamic user"; return 1; }
    done
    local c w
    c=$(ct systemd-analyze security tessera-coordinator | grep -o 'Overall exposure level.*')
    w=$(ct systemd-analyze security tessera-worker@0 | grep -o 'Overall exposure level.*')
    echo "coordinator: $c" > "$LOGS/security.log"; echo "worker: $w" >> "$LOGS/security.log"
    awk -v c="${c#*: }" -v w="${w#*: }" 'BEGIN { exit !(c + 0 <= 1.1 && w + 0 <= 1.6) }' ||
        { echo "exposure above 1.1 / 1.6: coordinator $c, worker $w"; return 1; }
    echo "dynamic users; exposure: coordinator ${c#*: }, worker ${w#*: }"
}

wait_ready() {
    cli status --wait-ready 60 > "$LOGS/status.log" 2>&1 || { cat "$LOGS/status.log"; return 1; }
    wait_until 30 ready_with "$1" || { echo "not ready with $1 stages: $(stages)"; return 1; }
    echo "$(stages) at $(elapsed) s"
}

IDS=""
generate() {
    local out
    out=$(cli generate tiny --prompt-ids 1,2,3,4 --max-tokens 12 --ids --timeout 60000) ||
        { echo "generate failed: $out"; return 1; }
    out=$(tr -s ' \n' ' ' <<< "$out" | sed 's/ $//')
    [ -n "$out" ] || { echo "no tokens"; return 1; }
    if [ -z "$IDS" ]; then IDS=$out
    elif [ "$out" != "$IDS" ]; then echo "tokens differ from the first run: $out / $IDS"; return 1; fi
    echo "ids: $out"
}

reload() {
    local before
    before=$(unit_prop tessera-coordinator MainPID)
    write_yaml "$1" || return 1
    ct systemctl reload tessera-coordinator || return 1
    wait_until 30 ready_with "$1" || { echo "the reload did not give $1 stages: $(stages)"; return 1; }
    [ "$(unit_prop tessera-coordinator MainPID)" = "$before" ] || { echo "the coordinator restarted"; return 1; }
    echo "pipeline $1 after systemctl reload (same coordinator pid $before)"
}

# restarted UNIT N OLDPID: the unit has been restarted N times and runs again
# with another main process.
restarted() {
    [ "$(unit_prop "$1" NRestarts)" = "$2" ] && [ "$(unit_prop "$1" ActiveState)" = active ] &&
        [ "$(unit_prop "$1" MainPID)" != "$3" ] && [ "$(unit_prop "$1" MainPID)" != 0 ]
}

sigkill() {
    local u=tessera-worker@1 pid n
    pid=$(unit_prop $u MainPID); n=$(unit_prop $u NRestarts)
    ct systemctl kill --kill-whom=main --signal=SIGKILL $u || return 1
    wait_until 30 restarted $u $((n + 1)) "$pid" || { echo "$u not restarted: $(ct systemctl status $u --no-pager | head -n 5)"; return 1; }
    wait_until 60 ready_with "$1" || { echo "not ready again: $(stages)"; return 1; }
    echo "$u: pid $pid killed, restarted as $(unit_prop $u MainPID), ready again at $(elapsed) s"
}

# host_pid CONTAINER_PID: the pid this machine sees for a process of the container.
host_pid() {
    local ns p
    ns=$(readlink /proc/"$LEADER"/ns/pid)
    for p in /proc/[0-9]*; do
        [ "$(readlink "$p/ns/pid" 2> /dev/null)" = "$ns" ] || continue
        [ "$(awk '/^NSpid:/ {print $NF}' "$p/status" 2> /dev/null)" = "$1" ] && { echo "${p#/proc/}"; return 0; }
    done
    return 1
}

# freeze SECONDS TID...: stops these threads alone (ptrace's interrupt, not a
# signal, which would stop the whole process) until they exit or SECONDS pass.
freeze() {
    python3 - "$@" <<'PY'
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
PTRACE_SEIZE, PTRACE_INTERRUPT, WALL = 0x4206, 0x4207, 0x40000000
end = time.time() + float(sys.argv[1])
for tid in map(int, sys.argv[2:]):
    for req in (PTRACE_SEIZE, PTRACE_INTERRUPT):
        if libc.ptrace(req, tid, None, None) != 0:
            sys.exit("ptrace %d on thread %d: %s" % (req, tid, os.strerror(ctypes.get_errno())))
print("frozen", flush=True)
# Reap the threads' stops and exits (a traced thread that exits waits for its
# tracer), leaving them stopped; exiting detaches whatever is left.
while time.time() < end:
    try:
        if os.waitpid(-1, os.WNOHANG | WALL)[0] == 0:
            time.sleep(0.05)
    except ChildProcessError:
        break
PY
}

# A worker whose data-plane thread is stuck (here: held by ptrace, while its
# main loop and ZeroMQ's threads go on) reports the piece failed at its next
# assignment and exits with status 75; systemd restarts it.
stuck_data_plane() {
    local u=tessera-worker@0 pid hp n tids t
    pid=$(unit_prop $u MainPID); n=$(unit_prop $u NRestarts)
    hp=$(host_pid "$pid") || { echo "no host pid for $u's $pid"; return 1; }
    tids=""
    for t in /proc/"$hp"/task/*; do
        t=${t##*/}
        [ "$t" = "$hp" ] && continue                                # the main loop
        case "$(cat /proc/"$hp"/task/"$t"/comm)" in ZMQbg*) continue ;; esac
        tids="$tids $t"
    done
    [ -n "$tids" ] || { echo "no data-plane threads in $u"; return 1; }
    freeze 60 $tids > "$LOGS/freeze.log" 2>&1 &
    local fp=$!
    wait_until 10 grep -q frozen "$LOGS/freeze.log" || { cat "$LOGS/freeze.log"; kill $fp; return 1; }
    # a new assignment for every worker: the stuck one cannot take its own
    write_yaml "$1" && ct systemctl reload tessera-coordinator || { kill $fp; return 1; }
    exited75() { ct journalctl -u $u -o cat --no-pager | grep -q "status=75"; }
    wait_until 30 exited75 || { echo "$u did not exit with 75"; kill $fp; return 1; }
    wait "$fp"
    wait_until 30 restarted $u $((n + 1)) "$pid" || { echo "$u not restarted: $(ct systemctl status $u --no-pager | head -n 5)"; return 1; }
    wait_until 60 ready_with "$1" || { echo "not ready again: $(stages)"; return 1; }
    echo "$u: threads$tids held; exited 75, restarted as $(unit_prop $u MainPID), ready at $(elapsed) s"
}

watchdog() {
    local u=tessera-worker@2 pid n t0
    pid=$(unit_prop $u MainPID); n=$(unit_prop $u NRestarts)
    t0=$(date +%s)
    ct systemctl kill --kill-whom=main --signal=SIGSTOP $u || return 1
    wait_until 40 restarted $u $((n + 1)) "$pid" || { echo "$u not restarted: $(ct systemctl status $u --no-pager | head -n 5)"; return 1; }
    ct journalctl -u $u -o cat --no-pager | grep -q "Watchdog timeout" || { echo "no watchdog timeout in the journal"; return 1; }
    wait_until 60 ready_with "$1" || { echo "not ready again: $(stages)"; return 1; }
    echo "$u: stopped, watchdog fired, restarted after $(($(date +%s) - t0)) s"
}

journal() {
    local u n
    for u in tessera-coordinator tessera-worker@0 tessera-worker@1 tessera-worker@2; do
        ct journalctl -u $u -o short-monotonic --no-pager > "$LOGS/journal-$u.log"
        # the daemon's own lines (systemd's about the unit carry no _SYSTEMD_UNIT)
        n=$(ct journalctl _SYSTEMD_UNIT=$u.service -o cat --no-pager | grep -c .)
        [ "$n" -gt 0 ] || { echo "no lines from $u's daemon"; return 1; }
    done
    if ct journalctl -u 'tessera-*' -o cat --no-pager | grep -i "operation not permitted\|EPERM\|bad system call"; then
        echo "a sandbox refusal in the journal"; return 1
    fi
    echo "daemon lines from all four units, no EPERM (logs in $LOGS)"
}

# ---- the run --------------------------------------------------------------------
echo "systemd-check: Tessera's units under systemd in a Debian $SUITE container"
step "host packages" host_packages || exit 1
step "build" build || exit 1
step "debian root" make_root || exit 1
step "make install into the root" install_tessera || exit 1
step "boot (systemd-nspawn --boot)" boot || exit 1
if step "keys, model, deployment" setup && step "start coordinator + 3 workers" start_units &&
   step "ready (pipeline 2)" wait_ready 2; then
    step "sandbox in force" sandboxed
    step "generate" generate
    step "reload after a YAML edit" reload 3 && step "generate after reload" generate
    step "SIGKILL a worker" sigkill 3 && step "generate after the restart" generate
    step "stuck data plane: exit 75" stuck_data_plane 2
    step "SIGSTOP until the watchdog" watchdog 2
    step "generate at the end" generate
    step "journal" journal
fi
ct journalctl --no-pager -o short-monotonic > "$LOGS/journal.log" 2>&1
echo
echo "systemd-check: $PASSED passed, $FAILED failed${FAILED_NAMES:+ (${FAILED_NAMES# })} in $(elapsed) s"
[ $FAILED -eq 0 ]
