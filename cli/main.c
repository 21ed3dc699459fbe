/* tessera: the command-line interface. */
#include <getopt.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "common/deploy.h"
#include "common/wire.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: tessera [--coordinator EP | --config FILE.yaml] [--timeout MS] [--keys DIR]\n"
            "               [--identity NAME] COMMAND ...\n"
            "\n"
            "commands:\n"
            "  status [--json] [--wait-ready S]   deployments, pieces and workers\n"
            "  workers [--json]                   registered workers\n"
            "  plan FILE.yaml [--nodes N] [--per-node G] [--gpu-memory GIB] [--nvlink K]\n"
            "       [--explain] [--diff]          dry run of the placement (no coordinator);\n"
            "                                     --explain: the ways to cut each deployment;\n"
            "                                     --diff: what a reload of FILE would do to\n"
            "                                     the running cluster\n"
            "  generate DEPLOYMENT [--prompt TEXT | --prompt-ids 1,2,3] [--max-tokens N]\n"
            "           [--temperature T] [--top-p P] [--seed S] [--ids | --text] [--timeout MS]\n"
            "           [--token-timeout MS]\n"
            "                                     run a prompt (ids from stdin without either)\n"
            "                                     and print what it generates as it streams\n"
            "  reload                             reread the deployment file\n"
            "  drain WORKER                       move its piece away, keep it idle\n"
            "  undrain WORKER                     make a drained worker placeable again\n"
            "  local FILE.yaml [--workers N] [--nodes K] [--log-dir DIR]\n"
            "                                     coordinator + N CPU workers in the foreground\n"
            "  keys init|add|remove|list DIR [NAME]\n"
            "                                     manage a CURVE key store\n"
            "  model-init DIR [options]           write a random Llama checkpoint\n"
            "  tokenize DIR TEXT | --decode IDS   encode or decode with DIR/tokenizer.json\n"
            "  version                            print the version\n"
            "\n"
            "Every command takes --help.\n"
            "\n"
            "options:\n"
            "  --coordinator EP   control endpoint (default $TESSERA_COORDINATOR, else\n"
            "                     tcp://127.0.0.1:7401)\n"
            "  --config FILE      take the control endpoint from a deployment file\n"
            "  --timeout MS       how long to wait for the coordinator (default 3000)\n"
            "  --keys DIR         key store with this client's key pair (IDENTITY.key) and\n"
            "                     the coordinator's public key (default $TESSERA_KEYS, else\n"
            "                     the --config file's coordinator.keys_dir, else\n"
            "                     /etc/tessera/keys)\n"
            "  --identity NAME    the name of the client's key (default $TESSERA_IDENTITY,\n"
            "                     else cli).  With none of these set and no cli.key in\n"
            "                     /etc/tessera/keys, the CLI connects without CURVE, for a\n"
            "                     coordinator with security: none\n"
            "\n"
            "exit status: 0 ok, 1 error or no answer, 2 bad usage, 3 refused by the\n"
            "coordinator (plan: some deployment cannot be placed), 4 --wait-ready timed out.\n");
}

int main(int argc, char **argv)
{
    tsr_cli_t cli = {.endpoint = getenv("TESSERA_COORDINATOR"), .timeout_ms = 3000};
    char ep_buf[512], keys_buf[TSR_PATH_MAX];
    const char *keys = getenv("TESSERA_KEYS"), *identity = getenv("TESSERA_IDENTITY");
    const char *cfg_keys = NULL;
    int cfg_plain = 0;
    static const struct option opts[] = {{"coordinator", required_argument, 0, 'c'},
                                         {"config", required_argument, 0, 'f'},
                                         {"timeout", required_argument, 0, 't'},
                                         {"keys", required_argument, 0, 'k'},
                                         {"identity", required_argument, 0, 'i'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    int o;
    /* '+': stop at the command name; the rest belongs to the command. */
    while ((o = getopt_long(argc, argv, "+h", opts, NULL)) != -1) {
        switch (o) {
        case 'c': cli.endpoint = optarg; break;
        case 'f': {
            tsr_config_t *cfg = NULL;
            char err[1024];
            if (tsr_config_load(optarg, &cfg, err, sizeof err) < 0) {
                fprintf(stderr, "%s\n", err);
                /* Nothing reached the coordinator: a reload changed nothing. */
                if (optind < argc && !strcmp(argv[optind], "reload"))
                    fprintf(stderr, "tessera: %s\n", TSR_CLI_RELOAD_REFUSED);
                return 1;
            }
            tsr_connect_endpoint(cfg->control_endpoint, ep_buf, sizeof ep_buf);
            cli.endpoint = ep_buf;
            snprintf(keys_buf, sizeof keys_buf, "%s", cfg->keys_dir);
            cfg_keys = keys_buf;
            cfg_plain = cfg->security_none;
            tsr_config_destroy(&cfg);
            break;
        }
        case 'k': keys = optarg; break;
        case 'i': identity = optarg; break;
        case 't': {
            char *end;
            long v = strtol(optarg, &end, 10);
            if (*end || v < 1 || v > 3600000) {
                fprintf(stderr, "tessera: --timeout: expected milliseconds 1..3600000, got '%s'\n", optarg);
                return 2;
            }
            cli.timeout_ms = (int)v;
            break;
        }
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (!cli.endpoint) cli.endpoint = "tcp://127.0.0.1:7401";
    if (optind >= argc) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[optind];
    int cargc = argc - optind;
    char **cargv = argv + optind;
    int rc;
    /* The commands that talk to the coordinator need its keys; a file that
     * says security: none needs none (unless keys were asked for). */
    static const char *const net[] = {"status", "workers", "reload", "drain", "undrain",
                                      "generate"};
    /* plan --diff asks the coordinator too */
    bool plan_diff = false;
    for (int i = 1; !strcmp(cmd, "plan") && i < cargc; i++) plan_diff |= !strcmp(cargv[i], "--diff");
    for (size_t i = 0; i < sizeof net / sizeof net[0] + plan_diff; i++) {
        if ((i < sizeof net / sizeof net[0] && strcmp(cmd, net[i])) ||
            (cargc > 1 && (!strcmp(cargv[1], "--help") || !strcmp(cargv[1], "-h"))))
            continue;
        char why[320];
        if (!tsr_endpoint_check(cli.endpoint, why, sizeof why)) {
            fprintf(stderr, "tessera: the coordinator's endpoint '%s' (--coordinator, "
                    "$TESSERA_COORDINATOR or --config): %s\n", cli.endpoint, why);
            return 2;
        }
        if (cfg_plain && !keys && !identity) break;
        char err[1024];
        if (tsr_security_client(keys ? keys : cfg_keys, identity, "cli", &cli.sec, err,
                                sizeof err) < 0) {
            fprintf(stderr, "tessera: cannot read the client's keys: %s\n", err);
            return 1;
        }
    }
    if (!strcmp(cmd, "status")) rc = tsr_cmd_status(&cli, cargc, cargv);
    else if (!strcmp(cmd, "workers")) rc = tsr_cmd_workers(&cli, cargc, cargv);
    else if (!strcmp(cmd, "reload")) rc = tsr_cmd_reload(&cli, cargc, cargv);
    else if (!strcmp(cmd, "drain")) rc = tsr_cmd_drain(&cli, cargc, cargv, 1);
    else if (!strcmp(cmd, "undrain")) rc = tsr_cmd_drain(&cli, cargc, cargv, 0);
    else if (!strcmp(cmd, "plan")) rc = tsr_cmd_plan(&cli, cargc, cargv);
    else if (!strcmp(cmd, "generate")) rc = tsr_cmd_generate(&cli, cargc, cargv);
    else if (!strcmp(cmd, "local")) rc = tsr_cmd_local(cargc, cargv);
    else if (!strcmp(cmd, "keys")) rc = tsr_cmd_keys(cargc, cargv);
    else if (!strcmp(cmd, "model-init")) rc = tsr_cmd_model_init(cargc, cargv);
    else if (!strcmp(cmd, "tokenize")) rc = tsr_cmd_tokenize(cargc, cargv);
    else if (!strcmp(cmd, "version")) {
        if (cargc > 1 && strcmp(cargv[1], "--help") && strcmp(cargv[1], "-h")) {
            fprintf(stderr, "tessera version: unexpected argument '%s'\n", cargv[1]);
            rc = 2;
        } else {
            if (cargc > 1) printf("usage: tessera version\n\nPrints the version and protocol.\n");
            else printf("tessera %s (protocol %d)\n", TSR_SOFTWARE_VERSION, TSR_PROTOCOL_VERSION);
            rc = 0;
        }
    } else if (!strcmp(cmd, "help")) {
        usage(stdout);
        rc = 0;
    } else {
        fprintf(stderr, "tessera: unknown command '%s'\n", cmd);
        usage(stderr);
        rc = 2;
    }
    memset(&cli.sec, 0, sizeof cli.sec);
    tsr_zmq_term();
    return rc;
}
