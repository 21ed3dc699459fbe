# Rules of the source tree that no one test run would catch:
#  - every timed wait is on the monotonic clock: no CLOCK_REALTIME but in the log's wall
#    time stamps, no pthread_timedjoin_np or sem_timedwait, and a file that waits on a
#    condition variable with a timeout makes it with tsr_cond_init_monotonic
#    (common/clock.h);  a wall-clock step must neither cut nor stretch a deadline;
#  - ThreadSanitizer's suppressions (tests/tsan.supp) each follow a comment saying why,
#    and none covers libprotobuf-c, which keeps no shared state: a report there is a
#    race on Tessera's own messages.
source "$(dirname "$0")/lib.sh"
cd "$ROOT"
SRC="common coordinator worker cli"
bad=$(grep -rln "CLOCK_REALTIME" $SRC --include='*.c' --include='*.h' --include='*.cu' | grep -v '^common/log.c$')
[ -z "$bad" ] || fail "CLOCK_REALTIME outside common/log.c: $bad"
bad=$(grep -rln "pthread_timedjoin_np\|sem_timedwait" $SRC --include='*.c' --include='*.h' --include='*.cu')
[ -z "$bad" ] || fail "a timed wait on the wall clock: $bad"
for f in $(grep -rl "pthread_cond_timedwait" $SRC --include='*.c' --include='*.cu'); do
    grep -q "tsr_cond_init_monotonic" "$f" || fail "$f waits on a condition with a timeout but does not make it with tsr_cond_init_monotonic"
    ! grep -q "pthread_cond_init" "$f" || fail "$f makes a condition variable on the wall clock (pthread_cond_init)"
done
awk '/^#/ { why = 1; next } /^$/ { why = 0; next }
     !why { print "tests/tsan.supp: " $0 " has no comment saying why"; bad = 1 }
     END { exit bad }' tests/tsan.supp || fail "a suppression without its reason"
! grep -v '^#' tests/tsan.supp | grep -qi "protobuf" || fail "tests/tsan.supp hides races inside libprotobuf-c"
ok "timed waits are on the monotonic clock; each TSan suppression is explained and none hides protobuf-c"
