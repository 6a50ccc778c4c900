package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"

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
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: workermon nats-config --partitions P [--subject-prefix P] [--account NAME]\n\n"+
			"Prints the subject mappings every NATS server of a deployment with P partitions\n"+
			"needs, and the publish permissions of an engine under them.")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return fmt.Errorf("%w: %v", errUsage, err)
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("%w: unexpected argument %q", errUsage, fs.Arg(0))
	}
	if parts < 1 || parts > 1024 {
		return fmt.Errorf("%w: --partitions %d must be 1 to 1024", errUsage, parts)
	}
	if err := events.ValidatePrefix(prefix); err != nil {
		return fmt.Errorf("%w: --subject-prefix: %v", errUsage, err)
	}
	if check.on {
		return check.report(stdout, nil, nil)
	}
	fmt.Fprint(stdout, natsConfig(prefix, parts, account))
	return nil
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
