package natsconn

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
)

// MinServerVersion is the oldest NATS server workermon works with (contract
// §14): JetStream KV with compare-and-set, watches and bucket max age.
const MinServerVersion = "2.10.0"

// minMajor and minMinor are MinServerVersion's parts, for comparing.
const minMajor, minMinor = 2, 10

// ErrServerUnsupported matches the error of CheckServer when the server
// cannot carry workermon: too old, or JetStream off.
var ErrServerUnsupported = errors.New("unsupported NATS server")

// CheckServer checks that the server nc is connected to can carry workermon:
// version MinServerVersion or later, with JetStream enabled for the
// account. The error matches ErrServerUnsupported and is one line naming
// what is missing and the version needed. A version it cannot parse is let
// through (a development build); a JetStream probe that fails for another
// reason (a timeout, a permission the account lacks) is not held against
// the server: the buckets' own errors say more then.
//
// The connected server speaks only for itself: other nodes of a cluster may
// run another version (contract §14).
func CheckServer(ctx context.Context, nc *nats.Conn) error {
	version := nc.ConnectedServerVersion()
	if tooOld(version) {
		return fmt.Errorf("%w: nats-server %s at %s is too old: workermon needs NATS server %s or later",
			ErrServerUnsupported, version, ConnectedURL(nc), MinServerVersion)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return fmt.Errorf("natsconn: jetstream: %w", err)
	}
	_, err = js.AccountInfo(ctx)
	if errors.Is(err, jetstream.ErrJetStreamNotEnabled) || errors.Is(err, jetstream.ErrJetStreamNotEnabledForAccount) {
		return fmt.Errorf("%w: JetStream is disabled on nats-server %s at %s: workermon needs JetStream (nats-server -js) on NATS server %s or later",
			ErrServerUnsupported, version, ConnectedURL(nc), MinServerVersion)
	}
	return nil
}

// tooOld reports whether a server version is older than MinServerVersion;
// a version it cannot read is not.
func tooOld(version string) bool {
	major, minor, ok := parseVersion(version)
	return ok && (major < minMajor || major == minMajor && minor < minMinor)
}

// parseVersion reads the major and minor numbers of a server version such
// as "2.10.29" or "2.11.0-RC.1".
func parseVersion(v string) (major, minor int, ok bool) {
	parts := strings.SplitN(v, ".", 3)
	if len(parts) < 2 {
		return 0, 0, false
	}
	major, err1 := strconv.Atoi(parts[0])
	minor, err2 := strconv.Atoi(parts[1])
	if err1 != nil || err2 != nil {
		return 0, 0, false
	}
	return major, minor, true
}

// ServerInfo is a Prometheus collector of workermon_nats_server_info: 1,
// labelled with the version of the server nc is connected to at the scrape
// ("" while disconnected).
func ServerInfo(nc *nats.Conn) prometheus.Collector {
	return serverInfo{nc: nc, desc: prometheus.NewDesc("workermon_nats_server_info",
		"The NATS server this process is connected to: 1, with its version (empty while disconnected).",
		[]string{"version"}, nil)}
}

type serverInfo struct {
	nc   *nats.Conn
	desc *prometheus.Desc
}

func (s serverInfo) Describe(ch chan<- *prometheus.Desc) { ch <- s.desc }

func (s serverInfo) Collect(ch chan<- prometheus.Metric) {
	ch <- prometheus.MustNewConstMetric(s.desc, prometheus.GaugeValue, 1, s.nc.ConnectedServerVersion())
}
