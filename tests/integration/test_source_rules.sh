# Rules of the source tree that no one test run would catch:
#  - every timed wait is on the monotonic clock: no CLOCK_REALTIME but in the log's wall
#    time stamps, no pthread_timedjoin_np or sem_timedwait, and a file that waits on a
#    condition variable with a timeout makes it with tsr_cond_init_monotonic
#    (common/clock.h);  a wall-clock step must neither cut nor stretch a deadline.
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
ok "timed waits are on the monotonic clock"
