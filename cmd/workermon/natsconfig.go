package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"strings"

	"github.com/nats-io/nats-server/v2/conf"
	"github.com/nats-io/nats-server/v2/server"

	"github.com/workermon/workermon/events"
)

// runNATSConfig prints what an operator adds to an external NATS server's
// configuration for --partitions P (contract §10): the subject mappings,
// and the publish permissions engines then need; with --users, the users
// of the three roles with the permissions of each (docs/deployment.md).
func runNATSConfig(_ context.Context, args []string, stdout, stderr io.Writer) error {
	var (
		parts   = 1
		prefix  = events.DefaultSubjectPrefix
		account string
		users   bool
	)
	fs := flag.NewFlagSet("nats-config", flag.ContinueOnError)
	fs.IntVar(&parts, "partitions", parts, "the --partitions of the monitors")
	fs.StringVar(&prefix, "subject-prefix", prefix, "the --subject-prefix of the monitors and engines")
	fs.StringVar(&account, "account", "", "print the block for this account (default: the server's default account, at the root)")
	fs.BoolVar(&users, "users", false, "print also the users monitor, router and engine with the permissions of their role (passwords from the server's environment)")
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
	fmt.Fprint(stdout, natsConfig(prefix, parts, account, users))
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

// natsConfig renders the configuration block: the mappings of parts
// partitions and, with users, the users of the three roles.
func natsConfig(prefix string, parts int, account string, users bool) string {
	var b strings.Builder
	if parts < 2 {
		fmt.Fprintf(&b, "# workermon with --partitions %d needs no subject mapping.\n", parts)
		if !users {
			return b.String()
		}
	} else {
		fmt.Fprintf(&b, "# workermon: %d partitions of the subjects under %q (contract §10).\n", parts, prefix)
		fmt.Fprintf(&b, "# Add to every NATS server of the deployment, then reload it (nats-server --signal reload).\n")
	}
	if users {
		writeUsersHeader(&b, prefix)
	}
	indent := ""
	switch {
	case account != "":
		fmt.Fprintf(&b, "accounts {\n  %s {\n", account)
		indent = "    "
		if users {
			b.WriteString(indent + "# ... the account's other settings (jetstream: enabled) ...\n")
			writeUsers(&b, indent, natsRoles(prefix, parts))
		} else {
			b.WriteString(indent + "# ... the account's users and settings ...\n")
		}
	case users:
		b.WriteString("authorization {\n")
		writeUsers(&b, "  ", natsRoles(prefix, parts))
		b.WriteString("}\n")
	}
	if parts > 1 {
		fmt.Fprintf(&b, "%smappings {\n", indent)
		for _, m := range events.PartitionMappings(prefix, parts) {
			fmt.Fprintf(&b, "%s  %q: %q\n", indent, m.From, m.To)
		}
		fmt.Fprintf(&b, "%s}\n", indent)
	}
	if account != "" {
		b.WriteString("  }\n}\n")
	}
	if parts < 2 {
		return b.String()
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
	fmt.Fprintf(&b, "# for its latency windows (section 18) %q and %q,\n",
		prefix+".latr.>", prefix+".part.*.latr.>")
	fmt.Fprintf(&b, "# and for its queues (section 22) %q and %q; engines may not publish them.\n",
		prefix+".rq.>", prefix+".part.*.rq.>")
	fmt.Fprintf(&b, "# Monitors subscribe to %q.\n", prefix+".part.>")
	return b.String()
}

// natsRole is the NATS user of one role and its permissions
// (docs/deployment.md, "NATS permissions per role").
type natsRole struct {
	user string
	// passwordEnv is the environment variable the server reads the
	// user's password from.
	passwordEnv    string
	publish        []string
	subscribe      []string
	allowResponses bool
}

// natsInbox is where the answers to JetStream API requests and KV puts,
// and the deliveries of the KV watchers, go.
const natsInbox = "_INBOX.>"

// natsRoles returns the users of the monitors, the routers and the
// engines (workermon sim, workermon scrape, or an engine linking package
// publisher), each allowed only the subjects its role uses: the lists of
// deploy/nats/compose.conf under any prefix, with the mapped forms of the
// subjects a role publishes when there are partitions (NATS checks
// publish permissions on the mapped subject), and one engine user for
// every worker id. The Helm chart renders the same lists
// (deploy/helm/workermon, whose tests compare the two).
func natsRoles(prefix string, parts int) []natsRole {
	kv := func(buckets []string, ops ...string) []string {
		var out []string
		for _, b := range buckets {
			for _, op := range ops {
				out = append(out, strings.ReplaceAll(op, "<b>", b))
			}
		}
		return out
	}
	all := []string{events.BusyBucket, events.ThresholdsBucket, events.WorkersBucket, events.LeasesBucket,
		events.CordonsBucket, events.SLOBucket}
	watched := []string{events.BusyBucket, events.WorkersBucket}

	monitor := natsRole{user: "monitor", passwordEnv: "WORKERMON_NATS_MONITOR_PASSWORD"}
	// Full KV on its six buckets; the takeover's key listing of the busy
	// bucket (contract §10); the rescheduler's migrate requests (§12).
	monitor.publish = append(monitor.publish, "$JS.API.INFO")
	monitor.publish = append(monitor.publish, kv(all,
		"$KV.<b>.>",
		"$JS.API.STREAM.INFO.KV_<b>",
		"$JS.API.STREAM.CREATE.KV_<b>",
		"$JS.API.CONSUMER.CREATE.KV_<b>",
		"$JS.API.CONSUMER.CREATE.KV_<b>.>",
		"$JS.API.CONSUMER.DELETE.KV_<b>.*",
		"$JS.API.DIRECT.GET.KV_<b>",
		"$JS.API.DIRECT.GET.KV_<b>.>",
		"$JS.FC.KV_<b>.>")...)
	monitor.publish = append(monitor.publish, "$JS.API.CONSUMER.MSG.NEXT.KV_"+events.BusyBucket+".*", prefix+".migrate.>")
	// Everything under the prefix: the plain subjects with one partition,
	// <prefix>.part.> with more; the rq subjects of the routers (§22).
	monitor.subscribe = []string{events.Wildcard(prefix), natsInbox}

	router := natsRole{user: "router", passwordEnv: "WORKERMON_NATS_ROUTER_PASSWORD"}
	// Watches the busy and workers buckets; publishes its slot tracker's
	// estimates (§11), its latency windows (§18) and its queues (§22).
	router.publish = append(router.publish, "$JS.API.INFO")
	router.publish = append(router.publish, kv(watched,
		"$JS.API.STREAM.INFO.KV_<b>",
		"$JS.API.CONSUMER.CREATE.KV_<b>",
		"$JS.API.CONSUMER.CREATE.KV_<b>.>",
		"$JS.API.CONSUMER.DELETE.KV_<b>.*",
		"$JS.FC.KV_<b>.>")...)
	router.publish = append(router.publish, withMapped(prefix, parts, prefix+".est.>", prefix+".latr.>", prefix+".rq.>")...)
	router.subscribe = []string{natsInbox}

	return []natsRole{monitor, router, engineRole(prefix, parts, "*")}
}

// withMapped returns subjects under prefix followed, with partitions, by
// the forms the servers map them to (<prefix>.part.*.<rest>): NATS checks
// publish permissions on the mapped subject.
func withMapped(prefix string, parts int, subjects ...string) []string {
	out := slices.Clone(subjects)
	if parts > 1 {
		for _, s := range subjects {
			out = append(out, prefix+".part.*."+strings.TrimPrefix(s, prefix+"."))
		}
	}
	return out
}

// engineRole is the user of the engine of worker id (a decimal token), or
// of every engine with id "*": its reports, goodbyes and latency windows,
// and its registry entry; it opens or creates the registry bucket, hears
// the rescheduler's migrate requests and answers them (allow_responses).
func engineRole(prefix string, parts int, id string) natsRole {
	r := natsRole{user: "engine", passwordEnv: "WORKERMON_NATS_ENGINE_PASSWORD", allowResponses: true}
	r.publish = withMapped(prefix, parts, prefix+".load.*."+id+".*", prefix+".bye.*."+id, prefix+".lat.*."+id)
	r.publish = append(r.publish,
		"$KV."+events.WorkersBucket+".*."+id,
		"$JS.API.INFO",
		"$JS.API.STREAM.INFO.KV_"+events.WorkersBucket,
		"$JS.API.STREAM.CREATE.KV_"+events.WorkersBucket)
	r.subscribe = []string{natsInbox, prefix + ".migrate.*." + id}
	return r
}

// writeUsersHeader explains the users block.
func writeUsersHeader(b *strings.Builder, prefix string) {
	fmt.Fprintf(b, `#
# The users of the three roles, each allowed only the subjects its role
# uses (docs/deployment.md, "NATS permissions per role"), with the default
# bucket names and the prefix %q. The server reads the passwords from its
# environment (WORKERMON_NATS_MONITOR_PASSWORD, WORKERMON_NATS_ROUTER_PASSWORD,
# WORKERMON_NATS_ENGINE_PASSWORD); the workermon processes take theirs
# from WORKERMON_NATS_USER and WORKERMON_NATS_PASSWORD. One engine user
# serves every worker id: so that one engine cannot speak for another,
# give each engine a user of its own with its id in place of the
# worker-id wildcard, e.g. %s.
`, prefix, prefix+".load.*.<ID>.*")
}

// writeUsers writes the users list of roles, indented.
func writeUsers(b *strings.Builder, indent string, roles []natsRole) {
	list := func(name string, subjects []string) {
		fmt.Fprintf(b, "%s      %s: {\n%s        allow: [\n", indent, name, indent)
		for _, s := range subjects {
			fmt.Fprintf(b, "%s          %q\n", indent, s)
		}
		fmt.Fprintf(b, "%s        ]\n%s      }\n", indent, indent)
	}
	fmt.Fprintf(b, "%susers: [\n", indent)
	for _, r := range roles {
		fmt.Fprintf(b, "%s  {\n%s    user: %s\n%s    password: $%s\n%s    permissions: {\n", indent, indent, r.user, indent, r.passwordEnv, indent)
		list("publish", r.publish)
		list("subscribe", r.subscribe)
		if r.allowResponses {
			fmt.Fprintf(b, "%s      allow_responses: true\n", indent)
		}
		fmt.Fprintf(b, "%s    }\n%s  }\n", indent, indent)
	}
	fmt.Fprintf(b, "%s]\n", indent)
}
