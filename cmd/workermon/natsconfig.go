package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"

	"github.com/nats-io/nats-server/v2/conf"
	"github.com/nats-io/nats-server/v2/server"

	"github.com/workermon/workermon/events"
)

// runNATSConfig prints what an operator adds to an external NATS server's
// configuration for --partitions P (contract §10): the subject mappings,
// and the publish permissions engines then need.
func runNATSConfig(_ context.Context, args []string, stdout, stderr io.Writer) error {
	var (
		parts   = 1
		prefix  = events.DefaultSubjectPrefix
		account string
	)
	fs := flag.NewFlagSet("nats-config", flag.ContinueOnError)
	fs.IntVar(&parts, "partitions", parts, "the --partitions of the monitors")
	fs.StringVar(&prefix, "subject-prefix", prefix, "the --subject-prefix of the monitors and engines")
	fs.StringVar(&account, "account", "", "print the block for this account (default: the server's default account, at the root)")
	check := newCheck(fs, "nats-config")
	if err := parseFlags(fs, args, stderr, nil); err != nil {
		return err
	}
	var errs []error
	if parts < 1 || parts > 1024 {
		errs = append(errs, fmt.Errorf("%w: --partitions %d must be 1 to 1024", errUsage, parts))
	}
	if err := events.ValidatePrefix(prefix); err != nil {
		errs = append(errs, fmt.Errorf("%w: --subject-prefix: %v", errUsage, err))
	}
	if err := validAccountName(account); err != nil {
		errs = append(errs, fmt.Errorf("%w: --account: %v", errUsage, err))
	}
	if err := errors.Join(errs...); err != nil {
		return check.report(stdout, err, nil)
	}
	if check.on {
		return check.report(stdout, nil, nil)
	}
	fmt.Fprint(stdout, natsConfig(prefix, parts, account))
	return nil
}

// validAccountName returns an error unless name is empty (the default
// account) or one the NATS server takes as it is, unquoted, for the key of
// an accounts block: the printed block parsed by the server's own
// configuration parser must name exactly that account, and not the
// reserved global account.
func validAccountName(name string) error {
	if name == "" {
		return nil
	}
	if name == server.DEFAULT_GLOBAL_ACCOUNT {
		return fmt.Errorf("%q is the server's reserved global account; leave --account unset for the default account", name)
	}
	parsed, err := conf.Parse("accounts {\n  " + name + " {\n  }\n}\n")
	if err == nil {
		accounts, _ := parsed["accounts"].(map[string]any)
		if _, ok := accounts[name]; ok && len(parsed) == 1 && len(accounts) == 1 {
			return nil
		}
	}
	return fmt.Errorf("%q is not an account name a NATS server configuration takes unquoted: use letters, digits, '-' and '_'", name)
}

// natsConfig renders the configuration block.
func natsConfig(prefix string, parts int, account string) string {
	var b strings.Builder
	if parts < 2 {
		fmt.Fprintf(&b, "# workermon with --partitions %d needs no subject mapping.\n", parts)
		return b.String()
	}
	indent := ""
	fmt.Fprintf(&b, "# workermon: %d partitions of the subjects under %q (contract §10).\n", parts, prefix)
	fmt.Fprintf(&b, "# Add to every NATS server of the deployment, then reload it (nats-server --signal reload).\n")
	if account != "" {
		fmt.Fprintf(&b, "accounts {\n  %s {\n    # ... the account's users and settings ...\n", account)
		indent = "    "
	}
	fmt.Fprintf(&b, "%smappings {\n", indent)
	for _, m := range events.PartitionMappings(prefix, parts) {
		fmt.Fprintf(&b, "%s  %q: %q\n", indent, m.From, m.To)
	}
	fmt.Fprintf(&b, "%s}\n", indent)
	if account != "" {
		b.WriteString("  }\n}\n")
	}
	fmt.Fprintf(&b, `
# NATS checks publish permissions on the mapped subject: an engine allowed
# its own subjects needs the mapped forms too. For worker id <ID>:
#   publish: {
#     allow: [
#       %q, %q,
#       %q, %q,
#       %q, %q
#     ]
#   }
`, prefix+".load.*.<ID>.*", prefix+".part.*.load.*.<ID>.*", prefix+".bye.*.<ID>", prefix+".part.*.bye.*.<ID>",
		prefix+".lat.*.<ID>", prefix+".part.*.lat.*.<ID>")
	fmt.Fprintf(&b, "# (the lat pair for the engine's latency windows, section 18, sent by workermon scrape).\n")
	fmt.Fprintf(&b, "# A router publishing estimates (section 11) likewise needs %q and %q,\n",
		prefix+".est.>", prefix+".part.*.est.>")
	fmt.Fprintf(&b, "# and for its latency windows (section 18) %q and %q.\n",
		prefix+".latr.>", prefix+".part.*.latr.>")
	fmt.Fprintf(&b, "# Monitors subscribe to %q.\n", prefix+".part.>")
	return b.String()
}
