/* keys.c: `tessera keys init|add|remove|list DIR [NAME]`. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "common/keys.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: tessera keys init DIR          create a key store and the coordinator's\n"
            "                                      key pair (DIR/coordinator.key, .pub)\n"
            "       tessera keys add DIR NAME      make a key pair for worker or client NAME\n"
            "                                      (DIR/NAME.key) and allow it\n"
            "                                      (DIR/allowed/NAME.pub)\n"
            "       tessera keys remove DIR NAME   stop allowing NAME and delete DIR/NAME.key; a\n"
            "                                      running coordinator drops its live sessions\n"
            "                                      within a second\n"
            "       tessera keys list DIR          the allowed keys (files that are not, on stderr)\n"
            "\n"
            "The coordinator reads coordinator.key and allowed/.  Copy coordinator.pub and\n"
            "NAME.key (mode 0600) to the machine that runs worker or client NAME, into its\n"
            "key store (default /etc/tessera/keys, or --keys DIR, or $TESSERA_KEYS).\n"
            "A worker's key name defaults to the worker's name, the CLI's to 'cli'.\n"
            "\n"
            "exit status: 0 done, 1 failed, 2 bad usage.\n");
}

int tsr_cmd_keys(int argc, char **argv)
{
    if (argc >= 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"))) {
        usage(stdout);
        return 0;
    }
    if (argc < 3) {
        usage(stderr);
        return 2;
    }
    const char *sub = argv[1], *dir = argv[2];
    int want = !strcmp(sub, "add") || !strcmp(sub, "remove") ? 4
               : !strcmp(sub, "init") || !strcmp(sub, "list") ? 3 : 0;
    if (!want) {
        fprintf(stderr, "tessera keys: unknown subcommand '%s' (init, add, remove, list)\n", sub);
        return 2;
    }
    if (argc != want) {
        fprintf(stderr, "tessera keys %s: expected %s\n", sub,
                want == 4 ? "DIR NAME" : "DIR");
        return 2;
    }
    char err[1024];
    if (!strcmp(sub, "init")) {
        if (tsr_keys_init(dir, err, sizeof err) < 0) goto fail;
        printf("key store %s created: the coordinator reads %s/coordinator.key; workers and "
               "clients need %s/coordinator.pub\n", dir, dir, dir);
        return 0;
    }
    if (!strcmp(sub, "add")) {
        if (tsr_keys_add(dir, argv[3], err, sizeof err) < 0) goto fail;
        printf("%s allowed; its key pair is %s/%s.key (copy it, with %s/coordinator.pub, to "
               "the machine that runs %s)\n", argv[3], dir, argv[3], dir, argv[3]);
        return 0;
    }
    if (!strcmp(sub, "remove")) {
        if (tsr_keys_remove(dir, argv[3], err, sizeof err) < 0) goto fail;
        printf("%s removed\n", argv[3]);
        return 0;
    }
    tsr_allowed_key_t *keys = NULL;
    tsr_keys_skipped_t sk;
    int n = tsr_keys_allowed(dir, &keys, &sk, err, sizeof err);
    if (n < 0) goto fail;
    /* The coordinator leaves such files out too (and refuses to start). */
    if (sk.n) fprintf(stderr, "tessera keys list: %zu file(s) are not allowed keys: %s\n", sk.n, sk.why);
    for (int i = 0; i < n; i++) {
        char p[TSR_PATH_MAX + 200];
        snprintf(p, sizeof p, "%s/%s.key", dir, keys[i].name);
        printf("%-32s %s%s\n", keys[i].name, keys[i].pub,
               access(p, F_OK) == 0 ? "  (key pair here)" : "");
    }
    free(keys);
    return 0;
fail:
    fprintf(stderr, "tessera keys %s: %s\n", sub, err);
    return 1;
}
