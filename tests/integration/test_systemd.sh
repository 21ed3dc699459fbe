# systemd integration: `make install` lays out binaries, units and configs;
# the units carry Type=notify, a watchdog, reload by SIGHUP, device access
# for GPUs and the sandbox; and the daemons really send READY=1 and WATCHDOG=1.
source "$(dirname "$0")/lib.sh"
P="$T/prefix"
make -s -C "$ROOT" install TESTING=1 PREFIX="$P" SYSCONFDIR="$P/etc" BIN="$BIN" BUILD="${TSR_BUILD:-build/test}" > "$T/install.log" 2>&1 || fail "make install: $(cat "$T/install.log")"
[ -d "$P/etc/tessera/keys/allowed" ] || fail "make install did not lay out the key store directory"
grep -q "tessera keys init $P/etc/tessera/keys" "$T/install.log" || fail "make install gave no key hint: $(cat "$T/install.log")"
for f in bin/tessera bin/tessera-coordinator bin/tessera-worker \
         lib/systemd/system/tessera-coordinator.service lib/systemd/system/tessera-worker@.service \
         share/tessera/configs/demo.yaml share/tessera/configs/cluster.yaml; do
    [ -e "$P/$f" ] || fail "make install did not install $f"
done
C="$P/lib/systemd/system/tessera-coordinator.service"; W="$P/lib/systemd/system/tessera-worker@.service"
for u in "$C" "$W"; do
    grep -q "^Type=notify" "$u" || fail "$u: not Type=notify"
    grep -q "^WatchdogSec=" "$u" || fail "$u: no watchdog"
    grep -q "$P/bin/" "$u" || fail "$u: PREFIX not substituted"
done
grep -q '^ExecReload=/bin/kill -HUP $MAINPID' "$C" || fail "no ExecReload by SIGHUP"
grep -q "^DeviceAllow=/dev/nvidiactl" "$W" || fail "worker cannot open /dev/nvidiactl"
grep -q "^DeviceAllow=char-nvidia-frontend" "$W" || fail "worker cannot open /dev/nvidia*"
grep -q -- "--device-index %i" "$W" || fail "instance is not the device index"
# CURVE keys reach the sandboxed (DynamicUser) services as credentials under
# the names the daemons look for (common/keys.h); the sd_notify run below
# starts the worker the way the unit does.
# The paths follow SYSCONFDIR (they named /etc/tessera whatever it was).
grep -qx "LoadCredential=coordinator.key:$P/etc/tessera/keys/coordinator.key" "$C" || fail "coordinator key not passed"
grep -qx "LoadCredential=coordinator.pub:$P/etc/tessera/keys/coordinator.pub" "$W" || fail "coordinator.pub not passed"
grep -qx "LoadCredential=tessera-identity.key:$P/etc/tessera/keys/%H.key" "$W" || fail "worker key not passed"
grep -q "^ExecStart=$P/bin/tessera-coordinator $P/etc/tessera/deployment.yaml" "$C" || fail "coordinator unit: deployment file not under SYSCONFDIR"
grep -qx "EnvironmentFile=-$P/etc/default/tessera-worker" "$W" || fail "worker unit: EnvironmentFile not under SYSCONFDIR"
! grep -h '^[^#]' "$C" "$W" | sed "s|$P/etc||g" | grep -q "/etc/tessera\\|/etc/default\\|@SYSCONFDIR@\\|@PREFIX@" ||
    fail "a unit names a path outside SYSCONFDIR, or a placeholder"
grep -qx "Environment=TESSERA_IDENTITY=%H" "$W" || fail "worker identity not set"
# Hardening: the sandbox lines are installed as written (README, "Running on
# a real cluster"), and what only the coordinator can do without is only there.
for line in DynamicUser=yes UMask=0077 ProtectSystem=strict ProtectHome=yes PrivateTmp=yes \
            PrivateMounts=yes NoNewPrivileges=yes ProtectClock=yes ProtectHostname=yes \
            ProtectKernelTunables=yes ProtectKernelModules=yes ProtectKernelLogs=yes \
            ProtectControlGroups=yes ProtectProc=invisible RestrictNamespaces=yes \
            RestrictRealtime=yes RestrictSUIDSGID=yes LockPersonality=yes \
            SystemCallArchitectures=native SystemCallFilter=@system-service \
            SystemCallErrorNumber=EPERM CapabilityBoundingSet= AmbientCapabilities=; do
    for u in "$C" "$W"; do
        grep -qx -- "$line" "$u" || fail "$(basename "$u"): hardening line $line missing"
    done
done
for line in PrivateDevices=yes PrivateUsers=yes ProcSubset=pid MemoryDenyWriteExecute=yes \
            "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK" "SystemCallFilter=~@privileged @resources"; do
    grep -qx -- "$line" "$C" || fail "coordinator unit: hardening line $line missing"
done
# The GPU stack needs the devices, /proc/driver/nvidia and JIT memory.
for line in PrivateDevices=yes ProcSubset=pid MemoryDenyWriteExecute=yes; do
    ! grep -qx -- "$line" "$W" || fail "worker unit: $line would lock out the GPU"
done
grep -qx "DevicePolicy=closed" "$W" || fail "worker unit: devices not closed by default"
# video exists on every Debian system (render only with udev: a group that is
# missing stops the unit from starting, status 216/GROUP).
grep -qx "SupplementaryGroups=video" "$W" || fail "worker unit: groups other than video: $(grep SupplementaryGroups "$W")"
grep -qx "SystemCallFilter=~@privileged" "$W" || fail "worker unit: @privileged not filtered"
if command -v systemd-analyze > /dev/null; then
    systemd-analyze verify "$C" "$W" > "$T/verify.log" 2>&1 || fail "systemd-analyze: $(cat "$T/verify.log")"
    echo "systemd-analyze verify: clean"
    # Exposure (0-100 here; the README gives it /10): coordinator 1.1 and a
    # worker 1.6 when written; fail if either loosens past 1.5 / 2.0.
    cp "$W" "$T/tessera-worker@0.service"
    if systemd-analyze security --offline=true "$C" > "$T/sec.log" 2>&1; then
        for pair in "$C:15" "$T/tessera-worker@0.service:20"; do
            u=${pair%:*}; max=${pair##*:}
            systemd-analyze security --offline=true --threshold="$max" "$u" > "$T/sec.log" 2>&1 ||
                fail "$(basename "$u"): exposure above $max/100: $(grep -E 'Overall|✗' "$T/sec.log")"
            echo "systemd-analyze security: $(grep -o 'Overall exposure level.*' "$T/sec.log")"
        done
    else
        echo "systemd-analyze security --offline not available here: exposure not checked"
    fi
fi

# sd_notify: listen on a datagram socket as systemd would and check that the
# coordinator reports READY=1 and keeps petting the watchdog from its loop.
write_yaml "$T/d.yaml" 1 1 1
# listen SOCKET OUT: record sd_notify datagrams for 6 s, as systemd would.
listen() {
    python3 - "$1" "$2" <<'PY' &
import socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(sys.argv[1]); s.settimeout(0.2)
end = time.time() + 6
with open(sys.argv[2], "w") as out:
    while time.time() < end:
        try:
            out.write(s.recv(4096).decode() + "\n"); out.flush()
        except socket.timeout:
            pass
PY
    PIDS+=("$!")
}
listen "$T/notify.sock" "$T/notify.txt"
listen "$T/wnotify.sock" "$T/wnotify.txt"
bound() { [ -S "$T/notify.sock" ] && [ -S "$T/wnotify.sock" ]; }
wait_until 5 bound || fail "notify listener did not start"
NOTIFY_SOCKET="$T/notify.sock" WATCHDOG_USEC=400000 bash -c 'export WATCHDOG_PID=$$; exec "$0" "$1"' \
    "$BIN/tessera-coordinator" "$T/d.yaml" >> "$T/coordinator.log" 2>&1 &
CP=$!; PIDS+=("$CP")
# The worker as its unit runs it: identity from TESSERA_IDENTITY, its key
# pair and the coordinator's public key from $CREDENTIALS_DIRECTORY only.
"$BIN/tessera" keys add "$KEYS" wnhost > /dev/null || fail "keys add wnhost"
mkdir -m 0700 "$T/cred"
cp "$KEYS/wnhost.key" "$T/cred/tessera-identity.key"; cp "$KEYS/coordinator.pub" "$T/cred/"
NOTIFY_SOCKET="$T/wnotify.sock" WATCHDOG_USEC=400000 CREDENTIALS_DIRECTORY="$T/cred" \
    TESSERA_IDENTITY=wnhost TESSERA_KEYS= TESSERA_NODE=rack7 TESSERA_DATA_ADDRESS=127.0.0.2 \
    bash -c 'export WATCHDOG_PID=$$; exec "$0" --coordinator "$1" --name wnhost-cpu0' \
    "$BIN/tessera-worker" "$WEP" >> "$T/wn.log" 2>&1 &
WP=$!; PIDS+=("$WP")
# Both report READY=1 and keep petting the watchdog (every 0.2 s with
# WatchdogSec=0.4 s: four pings take under a second).
notified() {
    grep -q "READY=1" "$T/notify.txt" && grep -q "READY=1" "$T/wnotify.txt" &&
        [ "$(grep -c "WATCHDOG=1" "$T/notify.txt")" -ge 4 ] &&
        [ "$(grep -c "WATCHDOG=1" "$T/wnotify.txt")" -ge 4 ]
}
wait_until 4 notified || fail "READY=1 and four WATCHDOG=1 not seen: $(cat "$T/notify.txt") / $(cat "$T/wnotify.txt")"
registered() { case "$(worker_field wnhost-cpu0 state 2>/dev/null)" in idle|loading|ready) return 0;; esac; return 1; }
wait_until 5 registered || fail "the worker with credentials did not register"
# The unit's EnvironmentFile can set the node and the data address (and more options).
[ "$(worker_field wnhost-cpu0 node)" = rack7 ] || fail "TESSERA_NODE not taken: node $(worker_field wnhost-cpu0 node)"
case "$(worker_field wnhost-cpu0 data_endpoint)" in 127.0.0.2:*) ;;
    *) fail "TESSERA_DATA_ADDRESS not taken: $(worker_field wnhost-cpu0 data_endpoint)" ;; esac
grep -q '^ExecStart=.* \$TESSERA_WORKER_OPTIONS$' "$W" || fail "the worker unit takes no TESSERA_WORKER_OPTIONS"
kill -TERM "$WP"; wait "$WP"
echo "coordinator watchdog pings so far with WatchdogSec=0.4s: $(grep -c "WATCHDOG=1" "$T/notify.txt")"
kill -TERM "$CP"; wait "$CP"
# make uninstall takes away what make install laid out, and leaves the key store.
"$BIN/tessera" keys init "$P/etc/tessera/keys" > /dev/null 2>&1 || true
make -s -C "$ROOT" uninstall PREFIX="$P" SYSCONFDIR="$P/etc" > "$T/uninstall.log" 2>&1 || fail "make uninstall: $(cat "$T/uninstall.log")"
for f in bin/tessera bin/tessera-coordinator bin/tessera-worker \
         lib/systemd/system/tessera-coordinator.service lib/systemd/system/tessera-worker@.service \
         share/tessera share/doc/tessera; do
    [ ! -e "$P/$f" ] || fail "make uninstall left $f"
done
[ -d "$P/etc/tessera/keys/allowed" ] || fail "make uninstall removed the key store"
stopping() { grep -q "STOPPING=1" "$T/notify.txt" && grep -q "STOPPING=1" "$T/wnotify.txt"; }
wait_until 2 stopping || fail "no STOPPING=1 from both: $(cat "$T/notify.txt") / $(cat "$T/wnotify.txt")"
ok "install layout, unit contents, hardening and sd_notify READY/WATCHDOG/STOPPING"
