# systemd integration: `make install` lays out binaries, units and configs;
# the units carry Type=notify, a watchdog, reload by SIGHUP and device access
# for GPUs; and the daemons really send READY=1 and WATCHDOG=1.
source "$(dirname "$0")/lib.sh"
P="$T/prefix"
make -s -C "$ROOT" install PREFIX="$P" BIN="$BIN" BUILD="${TSR_BUILD:-build}" > "$T/install.log" 2>&1 || fail "make install: $(cat "$T/install.log")"
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
if command -v systemd-analyze > /dev/null; then
    systemd-analyze verify "$C" "$W" > "$T/verify.log" 2>&1 || fail "systemd-analyze: $(cat "$T/verify.log")"
    echo "systemd-analyze verify: clean"
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
NOTIFY_SOCKET="$T/wnotify.sock" WATCHDOG_USEC=400000 bash -c 'export WATCHDOG_PID=$$; exec "$0" --coordinator "$1" --name wn' \
    "$BIN/tessera-worker" "$WEP" >> "$T/wn.log" 2>&1 &
WP=$!; PIDS+=("$WP")
sleep 2
grep -q "READY=1" "$T/notify.txt" || fail "no READY=1: $(cat "$T/notify.txt")"
grep -q "READY=1" "$T/wnotify.txt" || fail "worker: no READY=1: $(cat "$T/wnotify.txt")"
[ "$(grep -c "WATCHDOG=1" "$T/wnotify.txt")" -ge 4 ] || fail "worker did not pet its watchdog"
kill -TERM "$WP"; wait "$WP"
n=$(grep -c "WATCHDOG=1" "$T/notify.txt")
echo "watchdog pings in ~1.7 s with WatchdogSec=0.4s: $n"
[ "$n" -ge 4 ] || fail "watchdog petted only $n times"
kill -TERM "$CP"; wait "$CP"
sleep 0.3
grep -q "STOPPING=1" "$T/notify.txt" || fail "no STOPPING=1"
grep -q "STOPPING=1" "$T/wnotify.txt" || fail "worker: no STOPPING=1"
ok "install layout, unit contents and sd_notify READY/WATCHDOG/STOPPING"
