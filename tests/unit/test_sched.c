/* test_sched.c: coordinator/sched.c: libzmq's threads start under a system-call
 * filter that refuses the scheduling calls with EPERM, as the coordinator's
 * unit does (SystemCallFilter=~@resources), and a real change of policy is
 * still refused.  Each case runs in a child: a filter cannot be taken back. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <pthread.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

/* sched_setscheduler and sched_setparam fail with EPERM, everything else runs. */
static int deny_scheduling(void)
{
    struct sock_filter f[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_sched_setscheduler, 2, 0),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_sched_setparam, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
    };
    struct sock_fprog prog = {.len = sizeof f / sizeof f[0], .filter = f};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return -1;
    return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog);
}

/* Runs fn in a child under the filter; its exit status (a signal: -signal). */
static int in_sandbox(int (*fn)(void))
{
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        if (deny_scheduling() != 0) _exit(90);
        struct sched_param p = {.sched_priority = 0};
        if (syscall(__NR_sched_setscheduler, 0, SCHED_OTHER, &p) == 0 || errno != EPERM)
            _exit(91);  /* the filter is not in force: the test would prove nothing */
        _exit(fn());
    }
    int st;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st);
}

static int zmq_threads(void)
{
    void *ctx = zmq_ctx_new();
    if (!ctx) return 1;
    /* the first socket starts the context's I/O and reaper threads */
    void *a = zmq_socket(ctx, ZMQ_PAIR), *b = zmq_socket(ctx, ZMQ_PAIR);
    if (!a || !b || zmq_bind(a, "tcp://127.0.0.1:*") != 0) return 2;
    char ep[64];
    size_t len = sizeof ep;
    if (zmq_getsockopt(a, ZMQ_LAST_ENDPOINT, ep, &len) != 0 || zmq_connect(b, ep) != 0) return 3;
    char buf[8];
    if (zmq_send(b, "ping", 4, 0) != 4 || zmq_recv(a, buf, sizeof buf, 0) != 4) return 4;
    zmq_close(a);
    zmq_close(b);
    zmq_ctx_term(ctx);
    return 0;
}

static int realtime_refused(void)
{
    struct sched_param p = {.sched_priority = 1};
    return pthread_setschedparam(pthread_self(), SCHED_FIFO, &p) == EPERM ? 0 : 1;
}

static void test_zmq_threads_start_when_scheduling_calls_are_refused(void **state)
{
    (void)state;
    assert_int_equal(in_sandbox(zmq_threads), 0);
}

static void test_a_real_change_of_policy_is_still_refused(void **state)
{
    (void)state;
    assert_int_equal(in_sandbox(realtime_refused), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_zmq_threads_start_when_scheduling_calls_are_refused),
        cmocka_unit_test(test_a_real_change_of_policy_is_still_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
