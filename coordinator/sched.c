/* sched.c: libzmq's threads under the coordinator's system-call filter.
 *
 * Every thread libzmq starts (a context's I/O and reaper threads) applies its
 * scheduling policy and priority first, with pthread_setschedparam, even when
 * neither was configured, and aborts the process if that fails (libzmq 4.3:
 * "Operation not permitted (src/thread.cpp:345)").  The coordinator's unit
 * refuses the @resources system calls (SystemCallFilter=~@resources), so
 * sched_setscheduler fails with EPERM and the coordinator died at its first
 * socket under systemd.  This definition comes before the C library's for the
 * whole process (an executable's symbols are looked up first): a call that
 * would change nothing succeeds without the system call; any other goes on
 * to the C library, and a sandbox refuses it as before. */
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>

typedef int (*setschedparam_fn)(pthread_t, int, const struct sched_param *);

int pthread_setschedparam(pthread_t thread, int policy, const struct sched_param *param)
{
    int now_policy;
    struct sched_param now;
    if (pthread_getschedparam(thread, &now_policy, &now) == 0 && now_policy == policy &&
        now.sched_priority == param->sched_priority)
        return 0;
    setschedparam_fn libc_fn;
    *(void **)&libc_fn = dlsym(RTLD_NEXT, "pthread_setschedparam");
    return libc_fn ? libc_fn(thread, policy, param) : ENOSYS;
}
